"""offload's benchmarks: one section per capability against PyTorch's own way; `python -m benchmarks` runs them."""
