#!/usr/bin/env bash
# The test suite, from a clone: set up the environment (scripts/_env.sh), build
# offload's native core against its torch, run every test (each core test runs on
# the compiled core and on the pure-PyTorch path), then run the core tests once
# more with the compiled core switched off, as a user without it would run them,
# and the tests that take the `device` fixture once more on the npu stand-in
# (tests/npu_standin: offload's NPU path over a test-only PrivateUse1 device; it
# compiles once into build/npu_standin, and runs only with the default selection).
# Arguments go to both pytest runs; when they name test files or folders, those
# replace the default selections.
source "$(dirname "$0")/_env.sh" --need pytest hypothesis --want transformers accelerate

selection=(tests)
copy_tests=(tests/test_copy_*.py)
staging_tests=()  # the degrade tests stay out of the fallback pass; the stand-in pass names them itself
for file in tests/test_staging_*.py; do
  case "$file" in *_degrade.py) ;; *) staging_tests+=("$file") ;; esac
done
fallback=(tests/test_package.py tests/test_pool.py "${copy_tests[@]}" tests/test_buckets.py "${staging_tests[@]}")
for file in tests/test_activation*.py; do
  case "$file" in *_cuda.py) ;; *) fallback+=("$file") ;; esac
done
standin=(tests/test_npu_standin.py tests/test_activation_device.py tests/test_pool.py "${copy_tests[@]}" tests/test_buckets.py
         "${staging_tests[@]}" tests/test_staging_degrade.py tests/test_param_offload.py tests/test_faults_memory.py
         tests/test_saved_tensor_hooks.py tests/test_faults_weight_sync.py)
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then  # a path (or path::test) names the selection
    selection=()
    fallback=()
    standin=()
    break
  fi
done

# Test files side by side (pytest-xdist, where installed) on hosts with cores to spare: a GPU host's
# suite is mostly compiles, spawned ranks and small model steps that leave its cores idle. One file
# per worker (--dist loadfile), so a file's module fixtures and cached builds stay in one process.
# The stand-in pass stays in one process: each worker would load the stand-in build at start.
# OFFLOAD_TEST_WORKERS=N sets the count; 1 runs every pass in one process.
workers="${OFFLOAD_TEST_WORKERS:-}"
if [ -z "$workers" ]; then
  cores="$(nproc 2>/dev/null || echo 1)"
  workers=$(( cores >= 8 ? cores / 4 : 1 ))
fi
side_by_side=()
if [ "$workers" -gt 1 ] && "$OFFLOAD_PYTHON" -c "import xdist" >/dev/null 2>&1; then
  side_by_side=(-n "$workers" --dist loadfile)
fi

"$OFFLOAD_PYTHON" -m pytest ${selection[@]+"${selection[@]}"} -q -p no:cacheprovider ${side_by_side[@]+"${side_by_side[@]}"} "$@"
OFFLOAD_FORCE_FALLBACK=1 "$OFFLOAD_PYTHON" -m pytest ${fallback[@]+"${fallback[@]}"} -q -p no:cacheprovider -m "not slow" \
  ${side_by_side[@]+"${side_by_side[@]}"} "$@"
if [ ${#standin[@]} -gt 0 ]; then
  OFFLOAD_TEST_DEVICE=npu "$OFFLOAD_PYTHON" -m pytest "${standin[@]}" -q -p no:cacheprovider -m "not slow" "$@"
fi
