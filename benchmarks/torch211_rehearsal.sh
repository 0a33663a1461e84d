#!/usr/bin/env bash
# Rehearse the GPU machine's torch on a CPU machine with a package index (not run in CI; see
# docs/gpu.md, "Torch versions", and BENCHMARKS.md, "torch 2.11 rehearsal"):
#
#     bash benchmarks/torch211_rehearsal.sh [VENV] [PYTEST_ARGS ...]
#
# VENV (default $TORCH211_VENV or ~/venv-torch211) is a virtual environment outside the
# checkout, made with Python 3.12 (the GPU machine's; $PYTHON312 or python3.12, else python3)
# if it does not exist. Into it: torch $TORCH_VERSION (default 2.11.0) from PyPI, a CUDA build
# of a few GB that runs on the CPU; then this project with its test extras under
# constraints.txt less its torch pin. Then the unit and multi-process tests run against it:
# `-m "not integration and not gpu"`, restricted by PYTEST_ARGS if given (e.g. tests/moe
# tests/data_pipeline).
# Run again, it reuses the environment and repeats the tests.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-${TORCH211_VENV:-$HOME/venv-torch211}}
shift || true
TORCH=${TORCH_VERSION:-2.11.0}

VENV=$(mkdir -p "$VENV" && cd "$VENV" && pwd)
case "$VENV/" in
  "$ROOT"/*) echo "torch211_rehearsal: $VENV is inside the checkout; give a folder outside it" >&2
             exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
  PY=${PYTHON312:-$(command -v python3.12 || command -v python3)}
  "$PY" -m venv "$VENV"
fi
PYTHON=$VENV/bin/python
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
grep -v '^torch' "$ROOT/constraints.txt" > "$CONSTRAINTS"
echo "torch==$TORCH" >> "$CONSTRAINTS"

"$PYTHON" -m pip install --quiet --upgrade pip
"$PYTHON" -m pip install --quiet -c "$CONSTRAINTS" "torch==$TORCH"
"$PYTHON" -m pip install --quiet -c "$CONSTRAINTS" -e "$ROOT[test]"
"$PYTHON" - "$TORCH" <<'EOF'
import sys

import deepspeed
import torch

want = sys.argv[1]
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}), deepspeed {deepspeed.__version__}")
if torch.__version__.split("+")[0] != want:
    sys.exit(f"torch {torch.__version__} is installed, not {want}")
EOF

cd "$ROOT"
exec "$PYTHON" -m pytest -p no:cacheprovider -q -m "not integration and not gpu" "$@"
