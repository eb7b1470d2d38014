#!/usr/bin/env bash
# Installs jax's CUDA PJRT plugin (jax-cuda13-pjrt and jax-cuda13-plugin, the installed jaxlib's version, ~130 MB,
# no CUDA libraries) into DIR (default <repo>/.gpu-aot, ignored by git), off the Python path:
# triage_jax/tools/gpu_aot.py compiles programs for an H200 with it on a machine without a GPU, and
# tests/test_gpu_aot.py reads their PTX and kernels (skipped without it). Installed into site-packages it would
# make every jax import on a GPU-less machine print the plugin's failed initialization. It also puts NVIDIA's
# nvdisasm (PyPI's nvidia-cuda-nvdisasm, ~5 MB) in DIR/nvdisasm: triage_jax/tools/gpu_kernels.py reads the SASS of
# the Mosaic GPU kernels with it (and the machine's ptxas), and skips the SASS without it.
#   bash .ci/gpu_aot_plugin.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-${TRIAGE_GPU_AOT:-.gpu-aot}}
ver=$(python -c "import jaxlib; print(jaxlib.__version__)")
nvdisasm_ver=13.2.51  # the oldest CUDA 13 nvdisasm on PyPI; it reads ptxas 13.0's sm_90a cubins
if [ ! -x "$dir/nvdisasm/nvidia/cu13/bin/nvdisasm" ]; then
  python -m pip install -q --no-deps --no-compile --target "$dir/nvdisasm" "nvidia-cuda-nvdisasm==$nvdisasm_ver" \
    || echo "gpu_aot: nvidia-cuda-nvdisasm did not install (gpu_kernels reads no SASS without it)"
fi
if [ -f "$dir/jax_plugins/xla_cuda13/xla_cuda_plugin.so" ] && \
   python -c "import sys; sys.path.insert(0, '$dir'); from jax_plugins.xla_cuda13 import version; \
sys.exit(version._version != '$ver')" 2>/dev/null; then
  echo "gpu_aot: jax-cuda13-pjrt $ver already in $dir"
  exit 0
fi
rm -rf "$dir/jax_plugins" "$dir/jax_cuda13_plugin" "$dir"/jax_cuda13_*.dist-info
python -m pip install -q --no-deps --no-compile --target "$dir" "jax-cuda13-pjrt==$ver" "jax-cuda13-plugin==$ver"
echo "gpu_aot: jax-cuda13-pjrt $ver installed in $dir"
