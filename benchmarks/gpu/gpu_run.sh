#!/usr/bin/env bash
# The command for a lent GPU machine, run from the repository root by the device tool
# (README "GPUs": two calls, `--smoke --variants xla,pallas` with timeout_s 240, then
# `--skip-correctness` with timeout_s 420). The machine: one NVIDIA H200, python3 with
# jax 0.11.2 + jax-cuda13-plugin, torch 2.11 (CUDA), numpy, numba, optax,
# orbax-checkpoint, flatbuffers, tensorstore; no package registry, nothing to install.
# embedmesh is not installed there: PYTHONPATH=. (the script also puts the repository
# root first on sys.path). Results under the tool's $OUT (which comes back; elsewhere
# /tmp/embedmesh-gpu): gpu.json, gpu.md (also printed last), both rewritten as the run
# goes, children.log (each child's output), log (this run's output), nvidia-smi.csv.
# Exit status: see benchmarks/gpu/gpu.py.
set -u
OUT=${OUT:-/tmp/embedmesh-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true
PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu/gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log"
exit "${PIPESTATUS[0]}"
