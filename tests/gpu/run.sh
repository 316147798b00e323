#!/usr/bin/env bash
# tests/gpu/run.sh: the GPU check of gyre's SGLang engine and megatron-core trainer on one
# H100/H200-class GPU, with nothing from the internet. Needs `pip install -e '.[gpu]'` in the
# active Python (or PYTHON=...). Builds a tiny random-weight Qwen2 model directory locally,
# starts one workerd with both backends, and runs generate with log-probs, a role change
# each way, one training step and one weight publication (tests/gpu/check.py), printing the
# switch times, rollout tokens/s and publication seconds. Skipped in CI (no GPU there).
#
#   tests/gpu/run.sh [check.py options]      e.g. --requests 64 --tokens 512
#   GYRE_GPU_OUT=DIR tests/gpu/run.sh         also writes DIR/gpu-check.json and DIR/logs/
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "tests/gpu/run.sh: no NVIDIA GPU here (nvidia-smi -L failed); nothing to check" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ! "$PY" -c "import sglang, megatron.core, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "tests/gpu/run.sh: needs the GPU stack in $PY: pip install -e '.[gpu]'" >&2
    "$PY" -c "import sglang, megatron.core, torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || true
    exit 2
fi
"$PY" -c "import sglang, megatron.core, torch; print('sglang', sglang.__version__, '| megatron-core', megatron.core.__version__, '| torch', torch.__version__)" 2>/dev/null

work="${GYRE_GPU_OUT:-$(mktemp -d -t gyre-gpu-XXXXXX)}"
mkdir -p "$work"
start=$(date +%s)
# 7.5 minutes in all: SGLang's start-up (CUDA graphs for a handful of batch sizes) is most of it.
set +e
timeout 450 "$PY" tests/gpu/check.py --work "$work" --json-out "$work/gpu-check.json" --offload \
    --server '{"mem_fraction_static": 0.3, "dtype": "bfloat16"}' --tolerance 0.2 "$@"
rc=$?
set -e
echo "tests/gpu/run.sh: exit $rc after $(( $(date +%s) - start )) s; workerd log: $work/logs/workerd-0.log"
if [ $rc -ne 0 ] && [ -f "$work/logs/workerd-0.log" ]; then tail -n 40 "$work/logs/workerd-0.log"; fi
exit $rc
