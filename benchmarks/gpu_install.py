"""Installing the wheel folder of benchmarks/gpu_wheels.sh on a GPU machine that has a CUDA torch
but no DeepSpeed and no package index: only the packages this Python lacks, into a target
folder that reaches the commands through PYTHONPATH (the machine's own torch is never touched).
Used by the GPU proof (its install and env parts) and the settings matrix. Standard library
only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import zipfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

NEVER_SHADOWED = re.compile(r"^(torch|triton|nvidia_.*)$")
"""Wheels never installed: the machine's own CUDA torch stack."""
PYDANTIC_FAMILY = {"pydantic", "pydantic_core", "annotated_types", "typing_inspection"}
"""Installed together or not at all (pydantic pins its core exactly; DeepSpeed needs >= 2)."""
REQUIRED_MODULES = [
    "torch",
    "deepspeed",
    "pydantic",
    "hjson",
    "yaml",
    "zstandard",
    "pyarrow",
    "sentencepiece",
    "tensorboard",
    "safetensors",
    "matplotlib",
    "psutil",
    "tqdm",
    "numpy",
    "pytest",
]
"""What the project and its GPU tests import: each must be importable after the install."""
IMPORT_CHECK = (
    "import importlib, json, sys\n"
    "out = {}\n"
    "for m in sys.argv[1:]:\n"
    "    try:\n"
    "        mod = importlib.import_module(m)\n"
    "        out[m] = [getattr(mod, '__version__', '?'), getattr(mod, '__file__', '?')]\n"
    "    except Exception as e:\n"
    "        out[m] = [None, f'{type(e).__name__}: {e}']\n"
    "print('IMPORTS ' + json.dumps(out))\n"
)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` this Python has (without the target folder)."""
    for dist in metadata.distributions():
        if norm(dist.metadata["Name"] or "") == name:
            return dist.version
    return None


def choose_wheels(wheels_dir: Path, log) -> list[Path]:
    """The wheels of ``wheels_dir`` whose package this Python lacks (the pydantic family as one),
    never torch, triton or a CUDA library; each decision is written to ``log``."""
    wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
    log.write(f"wheel folder: {wheels_dir} ({len(wheels)} wheels)\n")
    if not wheels:
        log.write(
            "no wheel folder: using only what this Python has "
            "(benchmarks/gpu_wheels.sh builds the folder)\n"
        )
    by_name = {norm(w.name.split("-")[0]): w for w in wheels}
    refused = [w.name for n, w in by_name.items() if NEVER_SHADOWED.match(n)]
    if refused:
        log.write(f"refused (the machine's own torch stack): {refused}\n")
    pydantic = installed_version("pydantic")
    family_needed = pydantic is None or not pydantic.startswith(("2.", "3."))
    chosen = []
    for name, wheel in sorted(by_name.items()):
        if NEVER_SHADOWED.match(name):
            continue
        have = installed_version(name)
        take = family_needed if name in PYDANTIC_FAMILY else have is None
        log.write(f"  {wheel.name:<90} {'install' if take else 'present ' + str(have)}\n")
        if take:
            chosen.append(wheel)
    return chosen


def install_wheels(
    python: str, site: Path, wheels: list[Path], log, run: Callable[[list[str], dict], int | None]
) -> int | None:
    """``pip install --no-index --no-deps --target site`` (``run(cmd, env)`` runs it and returns
    its exit status, None when out of time); without pip, the wheels are unpacked by hand."""
    site.mkdir(parents=True, exist_ok=True)
    if not wheels:
        return 0
    pip_ok = (
        subprocess.run(
            [python, "-m", "pip", "--version"], capture_output=True, timeout=60
        ).returncode
        == 0
    )
    if not pip_ok:  # no pip at all: a wheel is a zip file; lay it out as pip would
        log.write("no pip in this Python: unpacking the wheels into the target\n")
        for w in wheels:
            unpack_wheel(w, site)
        return 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no index, constraint or find-links from config
    cmd = [
        python,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-warn-script-location",
        "--upgrade",
        "--target",
        str(site),
        *map(str, wheels),
    ]
    return run(cmd, env)


def import_check(
    python: str, env: dict, cwd: Path, timeout: float, modules: list[str] = REQUIRED_MODULES
) -> tuple[dict | None, str]:
    """{module: [version, file]} as ``python`` with ``env`` imports them ([None, error] for
    one that fails), and the check's output; None when the check itself did not run."""
    proc = subprocess.run(
        [python, "-c", IMPORT_CHECK, *modules],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout[-20000:] + proc.stderr[-5000:]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("IMPORTS ")), None)
    return (json.loads(line[len("IMPORTS ") :]) if line else None), output


ENV_PROBE = (
    "import json, platform, sys, torch\n"
    "d = {'python': sys.version.split()[0], 'platform': platform.platform(),\n"
    "     'torch': torch.__version__, 'torch_file': torch.__file__,\n"
    "     'cuda': torch.version.cuda, 'cuda_available': torch.cuda.is_available(),\n"
    "     'cudnn': torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}\n"
    "try:\n"
    "    d['nccl'] = '.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None\n"
    "except Exception as e:\n"
    "    d['nccl'] = f'n/a ({e})'\n"
    "if torch.cuda.is_available():\n"
    "    from moe.model.experts import grouped_mm_supported\n"
    "    from moe.training.device import peak_bf16_flops\n"
    "    dev = torch.device('cuda', 0)\n"
    "    p = torch.cuda.get_device_properties(dev)\n"
    "    d.update(gpu=p.name, gpus=torch.cuda.device_count(),\n"
    "             capability='.'.join(map(str, torch.cuda.get_device_capability(dev))),\n"
    "             gpu_memory_gib=round(p.total_memory / 2**30, 1),\n"
    "             peak_bf16_tflops=(peak_bf16_flops(dev) or 0) / 1e12,\n"
    "             grouped_mm_bf16=grouped_mm_supported(torch.bfloat16, dev))\n"
    "try:\n"
    "    import triton\n"
    "    d['triton'] = triton.__version__\n"
    "except Exception:\n"
    "    d['triton'] = None\n"
    "import deepspeed\n"
    "from deepspeed.accelerator import get_accelerator\n"
    "d.update(deepspeed=deepspeed.__version__, deepspeed_file=deepspeed.__file__,\n"
    "         deepspeed_accelerator=get_accelerator()._name)\n"
    "print('ENV ' + json.dumps(d))\n"
)
"""Prints ``ENV {json}``: Python, torch, CUDA, cuDNN, NCCL, the GPU, triton and DeepSpeed with
the accelerator it chose, as the commands of the proof will see them."""


def probe_environment(python: str, env: dict, cwd: Path, timeout: float) -> tuple[dict | None, str]:
    """What ``python`` with ``env`` runs on (ENV_PROBE's record), and the probe's output; None
    when the probe failed."""
    proc = subprocess.run(
        [python, "-c", ENV_PROBE], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    output = proc.stdout[-20000:] + proc.stderr[-10000:]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ENV ")), None)
    if proc.returncode != 0 or line is None:
        return None, output
    return json.loads(line[len("ENV ") :]), output


def unpack_wheel(wheel: Path, target: Path) -> None:
    """Install a wheel without pip: its files into ``target``, ``*.data/purelib|platlib`` into
    ``target`` too and ``*.data/scripts`` into ``target/bin`` (what ``pip --target`` does)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data") and len(parts) > 2:
                kind, rest = parts[1], parts[2:]
                dest = (
                    target / "bin" / "/".join(rest)
                    if kind == "scripts"
                    else target / "/".join(rest)
                )
            else:
                dest = target / info.filename
            if info.is_dir():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(z.read(info))
            if parts[0].endswith(".data") and parts[1] == "scripts":
                dest.chmod(0o755)
