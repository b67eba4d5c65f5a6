"""`python -m benchmarks` from a clone: the main job (see benchmarks/runner.py)."""

import sys

from benchmarks.runner import main

sys.exit(main())
