"""Measured constants of the memory model (``tilec.cost``): element sizes, kernel workspaces and
weight copies, as measured on CPU (``python benchmarks/workspace.py``)."""

ELEMENT_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "uint8": 1, "int8": 1, "int16": 2,
                 "int32": 4, "int64": 8, "bool": 1}
#: Convolution kernel workspace of stored segments (NCHW), in multiples of the padded input
#: (measured on CPU oneDNN: about 1x in forward, 2-3x in backward, reorders into blocked layouts).
CONV_FORWARD_WORKSPACE = 1.0
CONV_BACKWARD_WORKSPACE = 2.5
#: Tiles compute channels-last, which oneDNN convolves without reordering the activations, but
#: every call copies the weight: into a blocked layout, and first into channels-last unless the
#: kernel is 1x1. Measured on CPU: 1x (1x1) or 2x the weight's bytes in forward, one more in
#: backward (besides the weight gradient).
WEIGHT_BACKWARD_EXTRA_COPIES = 1.0
#: A tile convolution in the arena (its channels-last weight copy there) whose weight gradient
#: oneDNN computes: the backward's blocked copies of the weight and of its gradient besides
#: (measured on CPU, 3x3 stride 2 and 1x1, 512-1024 channels: 1.96-1.99x the weight's bytes).
ARENA_WEIGHT_BACKWARD_COPIES = 2.0
#: One whose weight gradient is matrix products: the input gradient's blocked weight copy
#: besides (3x3, 512-1024 channels, 11-14² tiles: 2.03-2.10x with the channels-last copy). That
#: backward takes the output gradient padded to the input's size and one weight-sized buffer of
#: taps instead of oneDNN's weight copies.
ARENA_GEMM_WEIGHT_BACKWARD_COPIES = 1.0

#: A tile's depthwise convolution with a kernel larger than 3x3, channels-last float32: its backward
#: (aten's ``convolution_backward``) takes a scratch buffer of about 1 KiB per channel and kernel tap
#: whatever the tile's size (measured on CPU, torch 2.13: 957-1092 bytes over 48-168 channels, 5x5
#: to 11x11 kernels, 8² to 32² outputs, 1 and 2 threads; a 3x3 kernel's 0.1-0.3 MiB at 96-168 channels).
DEPTHWISE_BACKWARD_SCRATCH = 1100

#: Bytes a process holds per tensor of a kept partial besides its elements (the tensor's
#: objects and the allocator's chunk; measured about 620 bytes for a one-element tensor).
PARTIAL_TENSOR_BYTES = 640
