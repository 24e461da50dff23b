"""Suite-wide settings.

The tests run thousands of tiny tensor ops. On a 2-core CI machine (or one shared with other
jobs) intra-op threads only add synchronisation: a single thread is several times faster and
keeps timings stable, so the whole suite uses one.
"""

import torch

torch.set_num_threads(1)
