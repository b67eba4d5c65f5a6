#!/usr/bin/env bash
# The main job, from a fresh clone: set up .venv, build offload, and run every
# benchmark section that applies to the device present (CUDA, Ascend, or the CPU
# subset). Results land in bench_out/ (results.json and a PNG plot).
source "$(dirname "$0")/_env.sh" matplotlib
python -m offload.bench --out "${OFFLOAD_BENCH_OUT:-bench_out}" "$@"
