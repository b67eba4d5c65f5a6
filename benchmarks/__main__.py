"""`python -m benchmarks` from a clone: the main job (see benchmarks/runner.py)."""

import sys

from benchmarks import LOADED_AT
from benchmarks.runner import main

sys.exit(main(started=LOADED_AT))
