#!/usr/bin/env bash
# The main job, from a clone: set up the environment (scripts/_env.sh), build
# offload, and run every benchmark section that applies to the device present
# (CUDA, Ascend, or the CPU subset) with `python -m benchmarks`. Arguments go to
# the runner (--quick, --only <section>..., --list). Results land in bench_out/:
# results.json, report.md and the figures (PNG) where matplotlib is installed.
source "$(dirname "$0")/_env.sh" --want matplotlib transformers
"$OFFLOAD_PYTHON" -m benchmarks --out "${OFFLOAD_BENCH_OUT:-bench_out}" "$@"
