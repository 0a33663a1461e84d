"""What recording and checking hashes costs preparation on many machines (not a test).

A part (``moe-prepare --part``): a worker's work per item with the SHA-256 of what it read and
of the file it wrote (``encode_part_task``) against without (``encode_task``, one-machine
preparation), in one process, rounds interleaved.

The merge (``--merge``): part files of a JSONL corpus of ``--merge-mb`` MB (the same documents,
repeated), cut into the pipeline's own work items of 1 MB and more as a part cuts them, through
the main process's shard writer (``write_shards``): each file checked as it is read (its
SHA-256 against the part's record, its token ids against the vocabulary: ``_load_part_file``)
against read unchecked, rounds interleaved.

    python benchmarks/part_hash_bench.py --files 600 --rounds 3 --merge-mb 16 --merge-rounds 7

Times are CPU seconds of this one process, all its threads (a busy machine blurs them far less
than wall time), CPU seconds of its main thread, and wall seconds. The merge reads and hashes
part files in a thread of its own while its main thread writes shards: with a second core
free, the main thread's time is what the merge takes. The corpus is the standard library's docstrings and comments
(the built-in ``stdlib`` source), its first ``--files`` files as work items; the tokenizer is
trained once on them. Prints the medians and spreads (min-max) and each cost as a fraction.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from data_pipeline import workers
from data_pipeline.assemble import write_shards
from data_pipeline.config import DataConfig, SourceConfig, TokenizerConfig
from data_pipeline.parts import part_reader
from data_pipeline.sources import read_item, work_items
from data_pipeline.tokenizer import LineSample, train_tokenizer

CLOCKS = {"cpu": time.process_time, "main_thread_cpu": time.thread_time, "wall": time.perf_counter}


def _timed(rounds: int, variants: dict) -> dict[str, dict[str, list[float]]]:
    """Seconds of each variant by each of CLOCKS, ``rounds`` times, interleaved."""
    times = {clock: {name: [] for name in variants} for clock in CLOCKS}
    for _ in range(rounds):
        for name, run in variants.items():
            start = {clock: read() for clock, read in CLOCKS.items()}
            run()
            for clock, read in CLOCKS.items():
                times[clock][name].append(read() - start[clock])
    return times


def _summary(times: dict[str, dict[str, list[float]]], base: str, other: str) -> dict:
    out = {}
    for clock, runs in times.items():
        med = {k: statistics.median(v) for k, v in runs.items()}
        out[clock] = {
            **{
                k: {"median_s": round(med[k], 4), "spread_s": [round(min(v), 4), round(max(v), 4)]}
                for k, v in runs.items()
            },
            "cost": round(med[other] / med[base] - 1, 4),
        }
    return out


def _merge_times(tmp: Path, tok, texts: list[str], args) -> tuple[dict, int, int]:
    """The merge's times, checked and unchecked, over part files of a JSONL corpus of about
    ``args.merge_mb`` MB; also the part files' bytes and their count."""
    corpus = tmp / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        while f.tell() < args.merge_mb << 20:
            f.write("".join(json.dumps({"text": t}) + "\n" for t in texts))
    source = SourceConfig(name="big", type="jsonl", paths=[str(corpus)])
    items = work_items(source)
    jobs = [(source, 0.1, it, None, str(tmp / f"big-{i}.bin")) for i, it in enumerate(items)]
    results = workers.encode_part_task(jobs)  # the part files the merge reads
    counts = {job[-1]: c for job, (c, _, _) in zip(jobs, results)}
    sha = {job[-1]: h for job, (_, _, h) in zip(jobs, results)}
    cfg = DataConfig(dir=str(tmp / "data"), sources=[source], valid_fraction=0.1)

    def merge(load) -> None:
        staging = Path(tempfile.mkdtemp(dir=tmp))
        encoded = ((job[-1], counts[job[-1]]) for job in jobs)
        write_shards(
            cfg, staging, tok, lambda src, sizes: encoded, load, False, {source.name: items}
        )
        shutil.rmtree(staging)

    def checked() -> None:
        with part_reader(
            [job[-1] for job in jobs], {p: (h, "") for p, h in sha.items()}, tok.vocab_size
        ) as load:
            merge(load)

    times = _timed(
        args.merge_rounds, {"unchecked": lambda: merge(workers.load_encoded), "checked": checked}
    )
    return times, sum(Path(job[-1]).stat().st_size for job in jobs), len(jobs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--files", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--merge-mb", type=int, default=16)
    p.add_argument("--merge-rounds", type=int, default=7)
    args = p.parse_args()
    source = SourceConfig(name="std", type="stdlib")
    items = work_items(source)[: args.files]
    with tempfile.TemporaryDirectory() as tmp:
        sample = LineSample(20000, 0)
        texts = [text for it in items for _, text in read_item(source, it).docs]
        for text in texts:
            sample.add(text)
        chars = sum(map(len, texts))
        tok = train_tokenizer(sample.lines, TokenizerConfig(vocab_size=2000), Path(tmp) / "t.model")
        workers.init_worker(str(tok.path))
        jobs = [(source, 0.1, it, None, str(Path(tmp) / f"{i}.bin")) for i, it in enumerate(items)]
        part = _timed(
            args.rounds,
            {
                "without": lambda: workers.encode_task(jobs),
                "with_sha256": lambda: workers.encode_part_task(jobs),
            },
        )

        merged, part_bytes, merge_items = _merge_times(Path(tmp), tok, texts, args)
    print(
        json.dumps(
            {
                "files": len(items),
                "mchars": round(chars / 1e6, 2),
                "merge_items": merge_items,
                "part_file_mb": round(part_bytes / 1e6, 2),
                "part": _summary(part, "without", "with_sha256"),
                "merge": _summary(merged, "unchecked", "checked"),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
