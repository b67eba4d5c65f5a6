#!/usr/bin/env bash
# The main job, from a clone: set up the environment (scripts/_env.sh), build
# offload, and run the benchmark sections that apply to the device present (CUDA,
# Ascend, or the CPU subset) with `python -m benchmarks`: about 5 minutes on one
# H100/H200; --full adds the long sections and sizes. Arguments go to the runner
# (--quick, --full, --only <section>..., --list). Results land in bench_out/
# ($OFFLOAD_BENCH_OUT), rewritten after every section: results.json, report.md and
# the figures (PNG) where matplotlib is installed; --only merges into them.
source "$(dirname "$0")/_env.sh" --want matplotlib transformers
"$OFFLOAD_PYTHON" -m benchmarks --out "${OFFLOAD_BENCH_OUT:-bench_out}" "$@"
