# Shared by scripts/bench.sh and scripts/test.sh: choose the Python environment,
# install what is missing, and build offload into it.
#
#   source scripts/_env.sh --need <packages> --want <packages>
#
# The environment is the one the command is run from: $PYTHON if set, else python3
# (or python) on PATH, as an activated venv, conda env or module puts it there, when
# torch >= 2.6 imports in it. Only where none does is .venv made (without the
# system's site-packages: a venv made from a venv would see the base interpreter's,
# not the user's) and torch==2.13.0 installed into it. torch is never installed or
# replaced in an environment that has one. Packages already importable are not
# installed again, so a host without a package registry runs this offline.
# Afterwards $OFFLOAD_PYTHON is the interpreter to use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

_offload_has_torch() {
  "$1" -c 'import sys, torch; sys.exit(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6))' \
    >/dev/null 2>&1
}

_offload_pick_python() {
  local candidate=""
  if [ -n "${PYTHON:-}" ]; then
    candidate="$PYTHON"
  elif command -v python3 >/dev/null 2>&1; then
    candidate="$(command -v python3)"
  elif command -v python >/dev/null 2>&1; then
    candidate="$(command -v python)"
  else
    echo "offload setup: error: no python3 on PATH; set PYTHON to an interpreter" >&2
    return 1
  fi
  if _offload_has_torch "$candidate"; then
    OFFLOAD_PYTHON="$candidate"
  elif [ -x .venv/bin/python ] && _offload_has_torch .venv/bin/python; then
    OFFLOAD_PYTHON="$PWD/.venv/bin/python"  # made by an earlier run
  else
    echo "offload setup: torch >= 2.6 does not import in $candidate; making .venv and installing torch==2.13.0 there"
    echo "offload setup: (to use a torch you have, run this from the environment that has it, or set PYTHON)"
    "$candidate" -m venv .venv
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    OFFLOAD_PYTHON="$PWD/.venv/bin/python"
  fi
}

_offload_pick_python
export OFFLOAD_PYTHON
"$OFFLOAD_PYTHON" scripts/_setup.py packages "$@"
"$OFFLOAD_PYTHON" scripts/_setup.py build
