#!/usr/bin/env bash
# The test suite, from a fresh clone: set up .venv, build offload's native core
# against the installed torch, run every test (each core test runs on the
# compiled core and on the pure-PyTorch path), then run the core tests once more
# with the compiled core switched off, as a user without it would run them.
source "$(dirname "$0")/_env.sh" pytest hypothesis transformers
python -m pytest tests -q -p no:cacheprovider "$@"
OFFLOAD_FORCE_FALLBACK=1 python -m pytest tests/test_package.py tests/test_pool.py tests/test_copy.py \
  tests/test_buckets.py tests/test_staging.py tests/test_activation.py -q -p no:cacheprovider -m "not slow"
