"""moe-import time and peak resident memory for a locally generated random Mixtral-shaped model
(fp32 safetensors shards, one tensor per expert as transformers saves them), against the size of
its files. Each import runs in a fresh process; its peak RSS is the child's ru_maxrss.

    python benchmarks/import_bench.py --out /tmp/import_bench [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = dict(
    architectures=["MixtralForCausalLM"],
    model_type="mixtral",
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    sliding_window=None,
    hidden_act="silu",
    tie_word_embeddings=False,
    router_aux_loss_coef=0.01,
    router_jitter_noise=0.0,
    initializer_range=0.02,
    attention_dropout=0.0,
)


def generate(out: Path) -> int:
    """Write the random model, one shard per layer (plus one for embeddings and head); returns
    the bytes of its safetensors files."""
    c = CONFIG
    D, H, E, V = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["vocab_size"]
    hd = D // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    weight_map = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(out / name),
            metadata={"format": "pt"},
        )
        weight_map.update(dict.fromkeys(tensors, name))

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    shard(
        "model-embed.safetensors",
        {
            "model.embed_tokens.weight": rand(V, D),
            "lm_head.weight": rand(V, D),
            "model.norm.weight": torch.ones(D),
        },
    )
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t = {
            f"{p}self_attn.q_proj.weight": rand(D, D),
            f"{p}self_attn.k_proj.weight": rand(kv, D),
            f"{p}self_attn.v_proj.weight": rand(kv, D),
            f"{p}self_attn.o_proj.weight": rand(D, D),
            f"{p}input_layernorm.weight": torch.ones(D),
            f"{p}post_attention_layernorm.weight": torch.ones(D),
            f"{p}block_sparse_moe.gate.weight": rand(E, D),
        }
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            t.update(
                {
                    f"{q}w1.weight": rand(H, D),
                    f"{q}w3.weight": rand(H, D),
                    f"{q}w2.weight": rand(D, H),
                }
            )
        shard(f"model-layer{i:02d}.safetensors", t)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(CONFIG))
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def import_once(hf_dir: Path, dest: Path) -> tuple[float, float]:
    """(seconds, peak RSS in GiB) of one moe-import in a fresh process."""
    code = (
        "import resource, sys, time; from moe.tools.hf_import import import_hf; "
        "t = time.perf_counter(); import_hf(sys.argv[1], sys.argv[2]); "
        "print(time.perf_counter() - t); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(hf_dir), str(dest)],
        check=True,
        capture_output=True,
        text=True,
    )
    seconds, rss_kib = res.stdout.split()[-2:]
    shutil.rmtree(dest)
    return float(seconds), int(rss_kib) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, type=Path, help="a new scratch directory")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    t = time.perf_counter()
    size = generate(args.out / "hf")
    print(f"generated {size / 2**30:.2f} GiB of safetensors in {time.perf_counter() - t:.0f} s")
    largest = (
        4 * CONFIG["num_local_experts"] * 2 * CONFIG["intermediate_size"] * CONFIG["hidden_size"]
    )
    runs = [import_once(args.out / "hf", args.out / f"ckpt{r}") for r in range(args.rounds)]
    secs, rss = [r[0] for r in runs], [r[1] for r in runs]
    print(
        f"import: median {statistics.median(secs):.1f} s (min {min(secs):.1f}, max "
        f"{max(secs):.1f}); peak RSS median {statistics.median(rss):.2f} GiB (min "
        f"{min(rss):.2f}, max {max(rss):.2f}); files {size / 2**30:.2f} GiB; largest of our "
        f"tensors {largest / 2**30:.2f} GiB; rounds {args.rounds}"
    )
    base = subprocess.run(
        [
            sys.executable,
            "-c",
            "import resource, moe.tools.hf_import; print("
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[-1]
    print(
        f"baseline: a process that only imports the importer peaks at {int(base) / 2**20:.2f} GiB"
    )
    shutil.rmtree(args.out)


if __name__ == "__main__":
    main()
