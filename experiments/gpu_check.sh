#!/usr/bin/env bash
# The GPU check, one command (<= 8 minutes on one H200): the gpu-marked tests, the backend alignment check with the
# compiled Pallas kernels and Transformer Engine (where installed), and the sampler benchmark.
#   bash experiments/gpu_check.sh            (from the repository root, on a machine with a CUDA GPU)
# Each part runs under its own time limit and the script goes on after a failure; it exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== ${name} (limit ${limit}s) ==="
  local t0=$SECONDS
  timeout "${limit}" "$@"
  local rc=$?
  echo "=== ${name}: exit ${rc}, $((SECONDS - t0)) s ==="
  [ "${rc}" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import jax; print('jax', jax.__version__, jax.devices())"
step "gpu tests" 150 python -m pytest -m gpu -q -x -n 0
step "align (every available backend: xla, pallas compiled, cudnn, te)" 150 python -m triage_jax.tools.align
step "sampler bench" 180 python experiments/bench_sampler.py
exit "${status}"
