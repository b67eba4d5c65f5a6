#!/usr/bin/env bash
# Configures, builds and runs the C++ unit tests (CMakeLists.txt, tests/cpp/) against
# the installed torch. From the repository root or anywhere:
#   bash tests/cpp/run.sh
# PYTHON picks the interpreter whose torch is used (default: python); MAX_JOBS caps
# parallel compiles (default 2: each job on torch headers takes 1-2 GB);
# BUILD_DIR moves the build (default build/cpp). Exits non-zero on any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python}"
BUILD_DIR="${BUILD_DIR:-build/cpp}"

for tool in cmake ninja "$PYTHON"; do
  command -v "$tool" >/dev/null || { echo "tests/cpp/run.sh: $tool not found on PATH" >&2; exit 2; }
done
TORCH_PREFIX="$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')"

# Python3_EXECUTABLE: the headers and libpython of the interpreter that has this torch.
cmake -S . -B "$BUILD_DIR" -G Ninja \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
  -DPython3_EXECUTABLE="$("$PYTHON" -c 'import sys; print(sys.executable)')" \
  "$@"
cmake --build "$BUILD_DIR" -j"${MAX_JOBS:-2}"
ctest --test-dir "$BUILD_DIR" --output-on-failure
