#!/usr/bin/env bash
# The settings matrix in one call (docs/gpu.md, "The settings matrix"): every speed lever on and
# off, eager and compiled, for dense-125m and moe-125m on one GPU, 3 interleaved rounds, inside
# a time budget (420 s by default), from the checkout root:
#
#     bash benchmarks/gpu_speed_matrix.sh OUTDIR                       # at most 7 minutes
#     bash benchmarks/gpu_speed_matrix.sh OUTDIR --scratch DIR         # the proof's wheels
#     bash benchmarks/gpu_speed_matrix.sh OUTDIR --device cpu --tiny --budget 120
#
# OUTDIR gets matrix.md, matrix.json, profile.md, profile.json and worker.log, rewritten after
# every run (benchmarks/gpu_speed_matrix.py says what each holds). The exit status is 0 when
# every admitted run ran. PYTHON chooses the interpreter (default: python3); GPU_WHEELS the
# wheel folder (default: gpu-wheels/ in the checkout), used only if DeepSpeed is missing.
set -uo pipefail
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/gpu_speed_matrix.py" "$@"
