#!/usr/bin/env bash
# The GPU proof in one command (docs/gpu.md, "Running on GPUs"). On a machine with one CUDA GPU,
# a CUDA build of torch and the wheel folder that benchmarks/gpu_wheels.sh builds (gpu-wheels/,
# carried along with the checkout), from the checkout root:
#
#     bash benchmarks/gpu_proof.sh OUTDIR                          # at most 9 minutes
#     bash benchmarks/gpu_proof.sh OUTDIR --dry-run --device cpu   # every part, tiny, on the CPU
#
# OUTDIR (or $GPU_PROOF_OUT) gets summary.md, summary.json, the bench part's step profiles
# (profile.md, profile.json) and one log per part: install, env, pytest, bench, train, eval
# (benchmarks/gpu_proof.py says what each does). The exit status is
# 0 only if every part passed. PYTHON chooses the interpreter (default: python3); GPU_WHEELS the
# wheel folder (default: gpu-wheels/ in the checkout).
set -uo pipefail
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/gpu_proof.py" "$@"
