#!/usr/bin/env bash
# The one command for a lent GPU machine (run from the repository root, e.g. by the
# device tool with timeout_s 540): one NVIDIA H200, python3 with jax 0.11.2 +
# jax-cuda13-plugin, torch 2.11 (CUDA), numpy, numba, optax, orbax-checkpoint,
# flatbuffers, tensorstore, hypothesis, pytest; no package registry. embedmesh is not
# installed there: PYTHONPATH=. (the script also puts the repository root first on
# sys.path). Results: $OUT/gpu.json, $OUT/gpu.md (also printed last), $OUT/children.log
# (each child's output), $OUT/log (this run's output). Exit status: see benchmarks/gpu.py.
set -u
OUT=${OUT:-/tmp/embedmesh-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true
PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu.py --out "$OUT" --budget-s 420 "$@" 2>&1 | tee "$OUT/log"
exit "${PIPESTATUS[0]}"
