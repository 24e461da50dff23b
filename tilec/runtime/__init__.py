"""The runtime of generated modules: plain Python on torch and the standard library.

Codegen copies these files verbatim into every generated module, in ``SOURCES`` order (each may
use the names of those before it), below the module's header and above its plan tables, so that
the module stays standalone. The files import each other only with one-line
``from tilec.runtime.<file> import <names>`` statements, which the copy drops; their other
imports are gathered at the top of the module. Names are unique across the files.
"""

SOURCES = ("memory.py", "compiled.py", "device.py", "arena.py", "kernels.py", "bits.py", "sources.py", "reduce.py",
           "dropout.py", "reuse.py", "batches.py", "tiles.py", "sweeps.py", "checks.py", "model.py")
