"""What recording its inputs costs a part (not a test): a worker's work per item with the SHA-256
of what it read (``moe-prepare --part``) against without (one-machine preparation), in one
process, rounds interleaved. Times are CPU seconds of that process (the work is single-threaded),
which a busy machine blurs far less than wall time.

    python benchmarks/part_hash_bench.py --files 600 --rounds 3

The corpus is the standard library's docstrings and comments (the built-in ``stdlib`` source),
its first ``--files`` files as work items; the tokenizer is trained once on them. Prints the
medians and spreads (min-max) in CPU seconds and the cost as a fraction of the worker's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from data_pipeline import prepare as prep
from data_pipeline.config import SourceConfig, TokenizerConfig
from data_pipeline.sources import read_item, work_items
from data_pipeline.tokenizer import LineSample, train_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--files", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    source = SourceConfig(name="std", type="stdlib")
    items = work_items(source)[:args.files]
    with tempfile.TemporaryDirectory() as tmp:
        sample = LineSample(20000, 0)
        chars = 0
        for it in items:
            for _, text in read_item(source, it).docs:
                sample.add(text)
                chars += len(text)
        tok = train_tokenizer(sample.lines, TokenizerConfig(vocab_size=2000), Path(tmp) / "t.model")
        prep._init_worker(str(tok.path))
        jobs = [(source, 0.1, it, None, str(Path(tmp) / f"{i}.bin")) for i, it in enumerate(items)]
        times: dict[str, list[float]] = {"without": [], "with_sha256": []}
        for _ in range(args.rounds):
            for name, task in (("without", prep._encode_task), ("with_sha256", prep._encode_part_task)):
                t = time.process_time()
                task(jobs)
                times[name].append(time.process_time() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"files": len(items), "mchars": round(chars / 1e6, 2),
                      **{k: {"median_s": round(med[k], 3), "spread_s": [round(min(v), 3), round(max(v), 3)]}
                         for k, v in times.items()},
                      "cost": round(med["with_sha256"] / med["without"] - 1, 4)}, indent=1))


if __name__ == "__main__":
    main()
