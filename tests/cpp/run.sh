#!/usr/bin/env bash
# Configures, builds and runs the C++ unit tests (CMakeLists.txt, tests/cpp/) against
# the installed torch. From the repository root or anywhere:
#   bash tests/cpp/run.sh
# PYTHON picks the interpreter whose torch is used (default: python); MAX_JOBS caps
# parallel compiles (default: one per core, at most one per 3 GB of memory, as setup.py:
# each job on torch headers takes 1-2 GB); BUILD_DIR moves the build (default build/cpp).
# A build whose inputs (CMakeLists.txt, csrc/, tests/cpp/, torch, the compiler, the
# arguments) hash as the last successful one did is run again without configuring or
# building: a fresh copy of the same sources (new timestamps) compiles nothing.
# Exits non-zero on any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python}"
BUILD_DIR="${BUILD_DIR:-build/cpp}"

for tool in cmake ninja "$PYTHON"; do
  command -v "$tool" >/dev/null || { echo "tests/cpp/run.sh: $tool not found on PATH" >&2; exit 2; }
done
TORCH_PREFIX="$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
if [ -z "${MAX_JOBS:-}" ]; then
  mem_gb=$(awk '/^MemTotal:/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 8)
  cores=$(nproc 2>/dev/null || echo 1)
  MAX_JOBS=$(( cores < mem_gb / 3 ? cores : mem_gb / 3 ))
  MAX_JOBS=$(( MAX_JOBS > 0 ? MAX_JOBS : 1 ))
fi

inputs_key() {
  {
    find CMakeLists.txt csrc tests/cpp -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    "$PYTHON" -c 'import sys, torch; print(sys.executable, torch.__version__, torch.__file__)'
    "${CXX:-c++}" --version 2>&1 | head -1
    printf '%s\n' "$@"
  } | sha256sum | cut -d' ' -f1
}
KEY="$(inputs_key "$@")"
STAMP="$BUILD_DIR/offload-inputs.sha256"

if [ "$(cat "$STAMP" 2>/dev/null)" != "$KEY" ]; then
  rm -f "$STAMP"
  # Python3_EXECUTABLE: the headers and libpython of the interpreter that has this torch.
  cmake -S . -B "$BUILD_DIR" -G Ninja \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
    -DPython3_EXECUTABLE="$("$PYTHON" -c 'import sys; print(sys.executable)')" \
    "$@"
  cmake --build "$BUILD_DIR" -j"$MAX_JOBS"
  echo "$KEY" > "$STAMP"
else
  echo "tests/cpp/run.sh: $BUILD_DIR is built from these inputs already; running its tests"
fi
ctest --test-dir "$BUILD_DIR" --output-on-failure
