#!/usr/bin/env bash
# Build, on a machine that reaches the package index, every wheel a GPU machine without
# DeepSpeed and without a package index needs to run this project (docs/gpu.md):
#
#     bash benchmarks/gpu_wheels.sh [DIR]      # DIR defaults to gpu-wheels/ (git-ignored)
#
# The GPU machine is assumed to have Python 3.12 with a CUDA build of torch (2.11 or newer),
# pyarrow, sentencepiece, tensorboard, mpi4py and transformers (which brings numpy, pyyaml,
# tqdm, safetensors, packaging). The folder gets:
#   - DeepSpeed 0.19.8 as a pure-Python wheel (DS_BUILD_OPS=0: no compiled op; the trainer
#     uses torch's AdamW, so none is needed on a GPU);
#   - DeepSpeed's own requirements and this project's that such a machine may lack, as
#     cp312 manylinux (or pure-Python) wheels;
#   - pytest and its plugins for `pytest -m gpu`.
# benchmarks/gpu_proof.sh installs from it only what the machine's Python lacks, with
# `pip install --no-index --no-deps --target`, so the preinstalled torch is never touched.
# Pins below are the versions CI tests with; change them together.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-${GPU_WHEELS:-$ROOT/gpu-wheels}}
PYTHON=${PYTHON:-python3}
LIMIT_MIB=40

DEEPSPEED=deepspeed==0.19.8
WHEELS=(
  # DeepSpeed's requirements (its setup.py: einops hjson msgpack ninja numpy packaging psutil
  # py-cpuinfo pydantic>=2 torch tqdm; numpy and torch are on the GPU machine)
  hjson==3.1.0
  pydantic==2.13.4
  pydantic-core==2.46.4
  annotated-types==0.7.0
  typing-inspection==0.4.2
  typing-extensions==4.16.0
  einops==0.8.2
  msgpack==1.2.4
  ninja==1.13.2
  psutil==7.2.2
  py-cpuinfo==9.0.0
  packaging==26.2
  tqdm==4.70.1
  # this project's (setup.py) beyond what the GPU machine has: zstandard (data sources),
  # matplotlib and its requirements (moe-eval's report figures), pyyaml and safetensors
  # (normally there with transformers)
  zstandard==0.25.0
  matplotlib==3.11.2
  contourpy==1.3.3
  cycler==0.12.1
  fonttools==4.68.0
  kiwisolver==1.5.1
  pyparsing==3.3.2
  python-dateutil==2.9.0.post0
  six==1.17.0
  pyyaml==6.0.3
  safetensors==0.8.0
  # QLoRA's NF4 (finetune.method qlora; the extra "qlora" of setup.py)
  torchao==0.18.0
  # model.cross_entropy: liger (the extra "liger"; pure Python, runs on the machine's triton)
  liger-kernel==0.8.5
  # the tests: pytest (pyproject.toml sets a timeout, hence pytest-timeout; the proof runs
  # them on several workers, hence pytest-xdist and execnet), as constraints.txt pins them
  pytest==9.1.1
  pluggy==1.6.0
  iniconfig==2.3.0
  pygments==2.20.0
  pytest-timeout==2.4.0
  pytest-xdist==3.8.0
  execnet==2.1.2
)

rm -rf "$OUT"
mkdir -p "$OUT"

# DeepSpeed's setup.py imports torch: build without isolation, with this Python's torch. The
# wheel holds no compiled code whatever torch this is (py3-none-any), so a CPU build will do.
"$PYTHON" -c "import torch, setuptools" 2>/dev/null || {
  echo "gpu_wheels: $PYTHON needs torch and setuptools to build the DeepSpeed wheel" >&2
  echo "            (python3 -m pip install -c constraints.txt -e . installs both)" >&2
  exit 1
}
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --no-cache-dir \
  -w "$OUT" "$DEEPSPEED"
ls "$OUT"/deepspeed-0.19.8-py3-none-any.whl >/dev/null || {
  echo "gpu_wheels: the DeepSpeed wheel is not pure Python:" "$OUT"/deepspeed-* >&2
  exit 1
}

"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 \
  -d "$OUT" "${WHEELS[@]}"

# Every pin has exactly one wheel, none of them is torch or a CUDA library, and the folder
# stays small enough to carry along with a checkout.
"$PYTHON" - "$OUT" "$DEEPSPEED" "${WHEELS[@]}" <<'EOF'
import re
import sys
from pathlib import Path

out, pins = Path(sys.argv[1]), sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
have = {}
for w in out.glob("*.whl"):
    name, version = w.name.split("-")[:2]
    have.setdefault(norm(name), []).append((version, w.name))
problems = []
for pin in pins:
    name, version = pin.split("==")
    got = have.pop(norm(name), [])
    if [v for v, _ in got] != [version]:
        problems.append(f"{pin}: found {[f for _, f in got] or 'nothing'}")
for name in have:
    problems.append(f"unexpected wheel {have[name]}")
for name in list(have) + [norm(p.split('==')[0]) for p in pins]:
    if name == "torch" or name.startswith("nvidia_") or name == "triton":
        problems.append(f"{name}: the GPU machine's own torch stack must not be shadowed")
if problems:
    sys.exit("gpu_wheels: " + "; ".join(problems))
EOF

BYTES=$(du -sb "$OUT" | cut -f1)
COUNT=$(ls "$OUT"/*.whl | wc -l)
if (( BYTES >= LIMIT_MIB * 1024 * 1024 )); then
  echo "gpu_wheels: $OUT holds $BYTES bytes, over the $LIMIT_MIB MiB limit" >&2
  exit 1
fi
awk -v n="$COUNT" -v b="$BYTES" -v d="$OUT" 'BEGIN { printf "gpu_wheels: %d wheels, %.1f MiB in %s\n", n, b / 1048576, d }'
