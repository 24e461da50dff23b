"""tilec: an ahead-of-time tiling compiler for exact training of CNNs on huge images."""

__version__ = "0.1.0"
