"""``moe-import``: a Hugging Face ``transformers`` model directory written as one of our
checkpoints, which ``model.init_from``, ``moe-export`` and ``moe-eval`` accept like any other.

The weights are read and checked by :func:`moe.weights.hf.read_hf_model` (every refusal before
anything is written), and for NaN or infinite values just before each group is written (an error
then removes what was written). The checkpoint holds them in the layout training saves (the main model
states and one file per expert, with expert fingerprints and the completion marker) at step 0,
with a run config whose ``model`` section describes the imported model and whose ``parallel``
section has ``expert_parallel_size`` N on N ranks. It holds no optimizer state: a run starts
from it with ``model.init_from``, not by resuming it. The tokenizer files of the directory
(``tokenizer.json``, ``tokenizer.model``, ``tokenizer_config.json``,
``special_tokens_map.json``) are copied into ``hf_tokenizer/``; the marker records the sha256 of
the tokenizer (``tokenizer.json``, else ``tokenizer.model``).

Everything is written into a temporary directory next to the destination and renamed into place
at the end; an existing destination is never overwritten.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from moe.checkpoint.consolidate import EXPERT_KEY
from moe.checkpoint.files import EXPERT_DIR, FORMAT_VERSION, MAIN_STATES, MARKER, RUN_CONFIG
from moe.checkpoint.fingerprints import expert_fingerprints
from moe.config.run import RunConfig, dump_config
from moe.core.config_schema import from_dict, to_dict
from moe.tools.export import HF_TOKENIZER_DIR, _publish
from moe.weights.hf import read_hf_model, refuse_nonfinite, tokenizer_record

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
_EXPERT_PARAMS = ("w_in", "w_out")


def import_hf(hf_dir: str | Path, out_dir: str | Path, expert_parallel_size: int = 1) -> Path:
    hf_dir = Path(hf_dir)
    arch, model_cfg, state = read_hf_model(hf_dir)
    run = to_dict(RunConfig())
    run.update(name=f"imported-{arch}", model=to_dict(model_cfg))
    run["data"]["seq_len"] = min(run["data"]["seq_len"], model_cfg.max_seq_len)  # a placeholder
    run["parallel"].update(
        world_size=expert_parallel_size, expert_parallel_size=expert_parallel_size
    )
    cfg = from_dict(
        RunConfig, run, f"{hf_dir} imported with --expert-parallel-size {expert_parallel_size}"
    )
    moe_layers = [i for i in range(cfg.model.n_layers) if cfg.model.is_moe_layer(i)]

    def write(tmp: Path) -> None:
        main, ours, fingerprints = {}, {}, {}
        (tmp / EXPERT_DIR).mkdir()
        moe_prefixes = tuple(f"blocks.{b}.ffn." for b in moe_layers)
        for key in list(state):
            if not key.startswith(moe_prefixes):
                main[key] = ours[key] = state.pop(key)
                continue
            prefix = key[: key.index(".ffn.") + len(".ffn.")]
            name = key[len(prefix) :]
            if name.startswith("experts.") and name[len("experts.") :] in _EXPERT_PARAMS:
                continue  # written per expert below
            main[f"{prefix}deepspeed_moe.{name}"] = ours[key] = state.pop(key)
        for layer_id, block in enumerate(moe_layers):
            prefix = f"blocks.{block}.ffn."
            stacked = {p: state.pop(f"{prefix}experts.{p}") for p in _EXPERT_PARAMS}
            refuse_nonfinite(
                {f"{prefix}experts.{p}": w for p, w in stacked.items()}, hf_dir, arch, model_cfg
            )
            for p, w in stacked.items():
                fingerprints[f"{prefix}experts.{p}"] = expert_fingerprints(w)
            for e in range(cfg.model.moe.num_experts):
                _save(
                    {
                        f"{prefix}deepspeed_moe.experts.{EXPERT_KEY}.{e}.{p}": w[e].clone()
                        for p, w in stacked.items()
                    },
                    tmp / EXPERT_DIR / f"layer_{layer_id}_expert_{e}_mp_rank_00_model_states.pt",
                )
        refuse_nonfinite(ours, hf_dir, arch, model_cfg)  # now, as the save reads them anyway
        _save({"module": main}, tmp / MAIN_STATES)
        (tmp / RUN_CONFIG).write_text(dump_config(cfg))
        copied = [n for n in TOKENIZER_FILES if (hf_dir / n).is_file()]
        if copied:
            (tmp / HF_TOKENIZER_DIR).mkdir()
            for n in copied:
                shutil.copy(hf_dir / n, tmp / HF_TOKENIZER_DIR / n)
        files = {
            p.relative_to(tmp).as_posix(): p.stat().st_size
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        marker = {
            "format": FORMAT_VERSION,
            "tag": Path(out_dir).name,
            "step": 0,
            "tokens": 0,
            "world_size": expert_parallel_size,
            "expert_parallel_size": expert_parallel_size,
            "num_moe_layers": len(moe_layers),
            "num_experts": cfg.model.moe.num_experts,
            "tokenizer": tokenizer_record(hf_dir),
            "expert_fingerprints": fingerprints,
            "files": files,
            "imported_from": {
                "architecture": arch,
                "dir": str(hf_dir),
                "token_ids": token_ids(hf_dir),
            },
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))

    return _publish(Path(out_dir), write)


def token_ids(hf_dir: Path) -> dict:
    """The special token ids of config.json (bos_token_id, eos_token_id, pad_token_id: an id,
    or a list of them for eos), which a Hugging Face export of the checkpoint writes back:
    generation stops at the model's own end-of-sequence tokens."""
    hf = json.loads((hf_dir / "config.json").read_text())  # read and checked before
    out = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = hf.get(key)
        ids = value if isinstance(value, list) else [value]
        if ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            out[key] = value
    return out


def _save(obj: dict, path: Path) -> None:
    """torch.save through a file object: a full disk is then an OSError underneath torch's
    RuntimeError (to a path it is a RuntimeError alone), which _publish reports as such."""
    with open(path, "wb") as f:
        torch.save(obj, f)
