# Shared by scripts/bench.sh and scripts/test.sh: a virtual environment in .venv
# with torch, the build tools, and offload built against that torch.
#
# The environment sees the system's site-packages, so a torch that is already
# installed (a CUDA or Ascend build on a GPU host) is used as it is; only where
# none is importable is torch==2.13.0 installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
python -m pip install --quiet "setuptools>=64" wheel
# offload needs torch >= 2.6; an older one on the system is shadowed inside .venv.
if ! python -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 6))" 2>/dev/null; then
  echo "offload setup: installing torch==2.13.0 (none importable, or older than 2.6)"
  python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet ninja "$@"
echo "offload setup: building against torch $(python -c 'import torch; print(torch.__version__)')"
MAX_JOBS="${MAX_JOBS:-2}" python -m pip install --quiet --no-build-isolation --no-deps -e .
python -m offload.info
