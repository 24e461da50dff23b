#!/usr/bin/env bash
# The CUDA checks in one run, the most important first: the CUDA tests, then the GPU
# measurements of benchmarks/run.py (float32, each variant in its own process, two steps each,
# with the share of a profiled step's wall time the GPU was busy, --busy).
#
#   bash benchmarks/cuda.sh [SECONDS_PER_PROCESS [NAME...]]
#
# NAMEs pick checks by name (tests, or a measurement's --name below), in this file's order;
# none runs them all. The results land in benchmarks/results/*_cuda.{md,json}. Where OUT names a
# folder, they are also packed into $OUT/cuda.tgz after each measurement, so that what finished is
# kept when a later one runs out of time. Plain PyTorch is measured at the largest side that fits
# a card of about 140 GB (ResNet-50 with frozen BatchNorm peaks at about 7 GiB at 2048², so
# 112 GiB at 8192²). Lightstream (pip install lightstream==1.0.7) is measured beside tilec where
# it imports: ResNet-34 with frozen BatchNorm, its README's 2880² tiles, tilec at Lightstream's
# measured peak, plain at 8192² (the largest side where plain fits); its tile statistics, taken on
# the CPU, take minutes. Needs a CUDA build of torch and tilec's dependencies (pyproject.toml)
# importable.
set -u
cd "$(dirname "$0")/.."
LIMIT=${1:-150}
shift $(($# > 0 ? 1 : 0))
CHOSEN=" $* "
PYTHON=${PYTHON:-python3}

chosen() {
    [ "$CHOSEN" = "  " ] || [[ "$CHOSEN" == *" $1 "* ]]
}

pack() {
    if [ -n "${OUT:-}" ]; then tar czf "$OUT/cuda.tgz" benchmarks/results/*_cuda.* 2>/dev/null; fi
    return 0
}

measure() {
    local name=$1
    shift
    if chosen "$name"; then
        "$PYTHON" benchmarks/run.py --busy --repeats 2 --timeout "$LIMIT" --name "$name" "$@"
        pack
    fi
}

if chosen tests; then
    timeout "$LIMIT" "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py tests/test_gpu_busy.py
fi
measure resnet50_32768_cuda --model examples/resnet50.py --sizes 32768 --variants auto --budget 40GiB,16GiB
measure resnet50_8192_cuda --model examples/resnet50.py --sizes 8192 --variants plain,checkpoint,auto --budget 40GiB
# The ≤10× targets: the 10% plans at 2048² and 1024². ResNet-18's tiles run as they are and also
# captured as CUDA graphs of aten's kernels (kernels="cudagraphs", no code generated; its plan on
# a 2-core CPU has 165 tile functions, traced in their variants in a first step of 109 s there).
measure resnet18_train_cuda --model examples/resnet18.py --sizes 2048 --variants plain,checkpoint,auto --budget 10% \
    --kernels auto,cudagraphs
measure basic_unet_train_cuda --model examples/basic_unet.py --sizes 1024 --variants plain,checkpoint,auto \
    --budget 10%
measure resnet50_16384_cuda --model examples/resnet50.py --sizes 16384 --variants auto --budget 40GiB,16GiB
measure resnet18_train_16384_cuda --model examples/resnet18.py --sizes 16384 --variants auto --budget 40GiB
measure unet_cuda --model examples/unet.py --sizes 4096,8192 --variants plain,auto --budget 40GiB
if "$PYTHON" -c "import lightstream.core.constructor" 2>/dev/null; then
    measure lightstream_8192_cuda --model examples/resnet18.py --attr resnet34_frozen --sizes 8192 \
        --variants plain,lightstream,auto --budget lightstream --timeout 600
    measure lightstream_16384_cuda --model examples/resnet18.py --attr resnet34_frozen --sizes 16384 \
        --variants lightstream,auto --budget lightstream --timeout 600
fi
# BasicUNet's 10% plan with its tiles captured as CUDA graphs: one segment of 18 instance norms,
# each of its 9 classes' functions traced in up to 22 variants (a first step of 359 s on 2 CPU cores).
measure basic_unet_graphs_cuda --model examples/basic_unet.py --sizes 1024 --variants auto --budget 10% \
    --kernels cudagraphs --timeout 600
# The tile functions compiled by inductor (kernels="compiled"), once per shape class and variant in
# the first step, also replayed as CUDA graphs (kernels="reduce-overhead"), against the same plan's
# tiles as they run and captured as CUDA graphs of aten's kernels ("cudagraphs"): ResNet-50's 10%
# plan at 2048², whose small tiles wait on the host, with some 40 tile functions (inductor's
# compiling of the 10% plans above would not fit a process's limit).
measure resnet50_compiled_cuda --model examples/resnet50.py --sizes 2048 --variants plain,auto --budget 10% \
    --kernels auto,cudagraphs,compiled,reduce-overhead --timeout 600
