#!/usr/bin/env bash
# The test suite under another JAX release's Python (a developer's check; CI does not run it). The GPU machine runs
# jax 0.11, which needs Python 3.12 and which this project's CPU machines cannot pip-install; JAX's Python changes
# defaults the CPU suite would otherwise never see (jax 0.11: Mosaic GPU's lowering semantics, kernels/mosaic.py).
# jax 0.11.0's own sources run over jaxlib 0.10.2 (its version guards cover that jaxlib), so:
#   bash .ci/jax_python.sh JAX_SRC [pytest args]     JAX_SRC: a checkout of jax at a release tag (its jax/ folder)
# makes a Python 3.12 venv (PYTHON312, default python3.12) at VENV (default /tmp/triage_jax_python) holding this
# project with its test extra and the installed jaxlib, puts JAX_SRC/jax first on its path with the minimum-jaxlib
# check relaxed to that jaxlib, and runs `python -m pytest [pytest args]` there (the README's suite by default).
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: bash .ci/jax_python.sh JAX_SRC [pytest args]}; shift
venv=${VENV:-/tmp/triage_jax_python}
jaxlib=$(python -c "import jaxlib; print(jaxlib.__version__)")
[ -x "$venv/bin/python" ] || "${PYTHON312:-python3.12}" -m venv "$venv"
"$venv/bin/python" -m pip install -q -e ".[test]" "jax==$jaxlib" "jaxlib==$jaxlib"
rm -rf "$venv/jax_src" && mkdir -p "$venv/jax_src" && cp -r "$src/jax" "$venv/jax_src/"
sed -i -E "s/^_minimum_jaxlib_version = '[^']*'/_minimum_jaxlib_version = '$jaxlib'/" "$venv/jax_src/jax/version.py"
PYTHONPATH="$venv/jax_src" "$venv/bin/python" -c "import jax; print('jax', jax.__version__, 'from', jax.__file__)"
PYTHONPATH="$venv/jax_src" exec "$venv/bin/python" -m pytest "$@"
