#!/usr/bin/env bash
# The GPU checks, in one run on a CUDA machine (the project's lent H100/H200: docs/support.md).
# Writes its reports under $OUT (default /tmp/tq_gpu_checks):
#   env.txt      GPU, driver, Python/torch/Triton/transformers versions, each step's status and time
#   kernels.md   benchmarks/bench_cuda_kernels.py: probes of the native GEMMs, a Mixtral MoE block and deployed layers vs bf16
#   tests.txt    tests/test_cuda.py and the CUDA tests of tests/test_triton_kernels.py and
#                compile_tests/test_training_compile.py
#   demo.txt     `tqcompile demo --device cuda` (the README's main job on a GPU), demo.png/json beside

# Each step has its own time limit, so one that fails or hangs leaves the others' reports.
# DEMO=0 skips the demo; KERNELS_S, TESTS_S, DEMO_S set the limits (s), WORKERS the test processes.
#
#   bash benchmarks/gpu_checks.sh
set -u
OUT=${OUT:-/tmp/tq_gpu_checks}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)
log() { echo "$1 rc=$2 at $(($(date +%s) - T0)) s" >>"$OUT/env.txt"; }
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    python -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
    nproc
} >"$OUT/env.txt" 2>&1

# 1. Alone on the GPU (timings): probes and one layer per preset at 8B widths.
timeout "${KERNELS_S:-220}" python benchmarks/bench_cuda_kernels.py --compiled --profile --experts >"$OUT/kernels.md" 2>&1
log kernels $?

# 2. The tests and the demo side by side (compiles are CPU-bound; the GPU work is small).
if [ "${DEMO:-1}" = 1 ]; then
    timeout "${DEMO_S:-280}" python -c "import sys; from tqcompile.cli import main; sys.exit(main(sys.argv[1:]))" \
        demo --device cuda --steps 150 --plot "$OUT/demo.png" --results "$OUT/demo.json" >"$OUT/demo.txt" 2>&1 &
fi
PARALLEL=$(python -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-4}")  # pytest-xdist where installed
timeout "${TESTS_S:-280}" python -m pytest -q -p no:cacheprovider $PARALLEL -rfE tests/test_cuda.py tests/test_triton_kernels.py compile_tests/test_training_compile.py -k cuda >"$OUT/tests.txt" 2>&1
log tests $?
wait
log demo $?

