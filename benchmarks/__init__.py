"""offload's benchmarks: one section per capability against PyTorch's own way; `python -m benchmarks` runs them."""

import time

# When the package began to load, before torch and offload are imported: the run's start-up time
# (imports, device initialisation) is counted from here.
LOADED_AT = time.perf_counter()
