"""Preparation throughput (not a test): megabytes of raw text per second per worker, against
SentencePiece's own ``encode`` of the same text in the same run, and the speed-up from 1 to 2
workers.

    python benchmarks/prepare_bench.py --mb 40 --rounds 3 --work-dir /tmp/prepare_bench
    python benchmarks/prepare_bench.py --mb 8 --profile   # cProfile of the encode path, in-process
    python benchmarks/prepare_bench.py --mb 20 --format parquet   # one file, one row group
    python benchmarks/prepare_bench.py --mb 20 --dedup exact   # with exact deduplication

1. Writes a JSONL corpus of about ``--mb`` MB (docstrings and comments of the standard library,
   repeated with a counter so no two documents are equal) and trains one tokenizer on it, which
   every preparation reuses (``tokenizer.model_file``): the figures are the read, tokenize and
   write path alone.
2. Rounds, interleaved so that machine load hits every variant alike: SentencePiece
   ``Encode(texts, num_threads=1)`` over all documents held in memory (the ceiling of one
   worker); ``prepare`` with 1 worker; ``prepare`` with 2 workers. Each prepare figure is its
   encode phase (read, tokenize, write shards) over the corpus's raw bytes.
3. Prints medians and spreads (min-max) as JSON: prepare MB/s per worker / SentencePiece MB/s
   (goal >= 0.8) and 2-worker / 1-worker MB/s (goal >= 1.7 on 2 free cores).
   With ``--format parquet`` the corpus is one Parquet file of one row group, and a fourth
   variant prepares it with 2 workers and the row group left whole (one work item, as before
   row groups were cut into row ranges): ``speedup_2_cut_over_2_uncut``.
4. And where the CPU time of each prepare went, which a busy machine does not blur: the main
   process's share of all CPU seconds of the encode phase (it competes with the workers for the
   cores), each worker's CPU seconds (read from /proc while it runs; Linux only), and from them
   the speed-up the 2-worker split allows on 2 free cores (a run takes at least its busiest
   process's CPU seconds, and half of all of them).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa
import pyarrow.parquet as pq

from data_pipeline import sources
from data_pipeline.config import DataConfig, SourceConfig, TokenizerConfig
from data_pipeline.prepare import prepare
from data_pipeline.sources import read_item, stdlib_document, stdlib_files, work_items
from data_pipeline.tokenizer import Tokenizer, train_tokenizer
from data_pipeline.workers import encode_item, init_worker


def write_corpus(path: Path, megabytes: float) -> list[str]:
    """Standard-library text as JSONL documents until ``megabytes``; returns the documents."""
    base = [d for d in (stdlib_document(p) for p in stdlib_files()[:600]) if d.strip()]
    texts, size, i = [], 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            text = f"[{i}] {base[i % len(base)]}"
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            texts.append(text)
            size, i = size + len(text.encode()), i + 1
    return texts


def sp_encode(tok: Tokenizer, texts: list[str], mb: float) -> float:
    t = time.perf_counter()
    tok.sp.Encode(texts, num_threads=1)
    return mb / (time.perf_counter() - t)


class ChildCpu(threading.Thread):
    """CPU seconds of each child process, read from /proc every ``interval`` seconds until
    stopped (a pool worker's last reading is at most that long before its end). Empty where
    /proc has no ``children`` files."""

    def __init__(self, interval: float = 0.1):
        super().__init__(daemon=True)
        self.interval, self.seconds, self._done = interval, {}, threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        tasks = Path(f"/proc/{os.getpid()}/task")
        while not self._done.wait(self.interval):
            try:
                pids = {
                    int(p) for t in tasks.iterdir() for p in (t / "children").read_text().split()
                }
            except OSError:
                return
            for pid in pids:
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # ended since the listing
                self.seconds[pid] = (int(fields[11]) + int(fields[12])) / self._tick

    def stop(self) -> list[float]:
        """Each child's CPU seconds, largest first (the resource tracker's near 0 left out)."""
        self._done.set()
        self.join()
        return sorted((s for s in self.seconds.values() if s >= 0.05), reverse=True)


def prepare_rate(
    cfg: DataConfig, workers: int, mb: float, out: Path, uncut: bool = False
) -> tuple[float, dict]:
    """MB/s of the encode phase, and its CPU seconds: main process, each worker. ``uncut``:
    Parquet row groups stay one work item each (the work items are made in this process)."""
    shutil.rmtree(out, ignore_errors=True)
    children = ChildCpu()
    children.start()
    saved = sources.JSONL_MIN_CHUNK_BYTES
    if uncut:
        sources.JSONL_MIN_CHUNK_BYTES = 1 << 62
    try:
        report = prepare(
            dataclasses.replace(cfg, dir=str(out), prepare_workers=workers), progress=False
        )
    finally:
        sources.JSONL_MIN_CHUNK_BYTES = saved
        per_worker = children.stop()
    main = report.timings["encode_cpu_main"]
    return mb / report.timings["encode"], {
        "main": main,
        "all": report.timings["encode_cpu"],
        "workers": per_worker,
    }


def _cpu_bound(seconds: dict) -> float:
    return max(seconds["main"], *seconds["workers"], seconds["all"] / 2)


def spread(xs: list[float]) -> dict:
    return {
        "median": round(statistics.median(xs), 3),
        "min": round(min(xs), 3),
        "max": round(max(xs), 3),
    }


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mb", type=float, default=40.0, help="raw text, megabytes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--profile", action="store_true", help="cProfile the encode path instead")
    p.add_argument(
        "--format",
        choices=["jsonl", "parquet"],
        default="jsonl",
        help="parquet: the corpus as one file of one row group",
    )
    p.add_argument(
        "--dedup",
        choices=["none", "exact"],
        default="none",
        help="data.dedup of every prepare (exact: each document's key looked up)",
    )
    return p.parse_args()


def _setup(args: argparse.Namespace, work: Path) -> tuple[list[str], float, Tokenizer, DataConfig]:
    """The corpus (in ``--format``), its tokenizer and the data config every prepare reads."""
    texts = write_corpus(work / "corpus.jsonl", args.mb)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    tok_cfg = TokenizerConfig(vocab_size=args.vocab)
    tok = train_tokenizer(
        [line for t in texts[:3000] for line in t.splitlines() if line.strip()],
        tok_cfg,
        work / "tok.model",
    )
    corpus = work / "corpus.jsonl"
    if args.format == "parquet":
        corpus = work / "corpus.parquet"
        pq.write_table(pa.table({"text": texts}), corpus, row_group_size=len(texts))
    cfg = DataConfig(
        sources=[SourceConfig(name="web", type=args.format, paths=[str(corpus)])],
        tokenizer=dataclasses.replace(tok_cfg, model_file=str(tok.path)),
        shard_tokens=4_000_000,
        dedup=args.dedup,
    )
    return texts, mb, tok, cfg


def _profile(cfg: DataConfig, tok: Tokenizer, work: Path, mb: float) -> None:
    """cProfile of the encode path in this process, then the reading alone."""
    source = cfg.sources[0]
    init_worker(str(tok.path))
    prof = cProfile.Profile()
    prof.enable()
    for i, item in enumerate(work_items(source)):
        encode_item((source, cfg.valid_fraction, item, None, str(work / f"e{i}.bin")))
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    read = time.perf_counter()
    for item in work_items(source):
        read_item(source, item)
    print(f"read_item alone: {mb / (time.perf_counter() - read):.2f} MB/s")


def _measure(
    args, cfg: DataConfig, tok: Tokenizer, texts: list[str], mb: float, work: Path
) -> tuple[dict[str, list[float]], dict[str, list[dict]]]:
    """Interleaved rounds of SentencePiece alone and each prepare variant: MB/s and CPU seconds."""
    variants = [("prepare_1", 1, False), ("prepare_2", 2, False)]
    if args.format == "parquet":
        variants.append(("prepare_2_uncut", 2, True))
    rates: dict[str, list[float]] = {"sentencepiece": [], **{v[0]: [] for v in variants}}
    cpu: dict[str, list[dict]] = {v[0]: [] for v in variants}
    for _ in range(args.rounds):
        rates["sentencepiece"].append(sp_encode(tok, texts, mb))
        for name, workers, uncut in variants:
            rate, seconds = prepare_rate(cfg, workers, mb, work / "out", uncut)
            rates[name].append(rate)
            cpu[name].append(seconds)
            print(
                f"{name}: {rate:.2f} MB/s; CPU s: main "
                f"{seconds['main']:.2f} of {seconds['all']:.2f}, workers "
                f"{[round(w, 2) for w in seconds['workers']]}",
                file=sys.stderr,
                flush=True,
            )
    return rates, cpu


def _summary(
    args, rates: dict[str, list[float]], cpu: dict[str, list[dict]], mb: float, documents: int
) -> dict:
    """The ratios against SentencePiece and between worker counts, with their spread."""
    per_worker = [a / b for a, b in zip(rates["prepare_1"], rates["sentencepiece"])]
    per_worker_2 = [a / 2 / b for a, b in zip(rates["prepare_2"], rates["sentencepiece"])]
    scaling = [b / a for a, b in zip(rates["prepare_1"], rates["prepare_2"])]
    # On 2 free cores a run takes at least as long as its busiest process and as half its
    # CPU seconds: what the split of the work allows, whatever the machine's load.
    allowed = [
        _cpu_bound(one) / _cpu_bound(two)
        for one, two in zip(cpu["prepare_1"], cpu["prepare_2"])
        if two["workers"]
    ]
    extra = {}
    if args.format == "parquet":
        extra["speedup_2_cut_over_2_uncut"] = spread(
            [a / b for a, b in zip(rates["prepare_2"], rates["prepare_2_uncut"])]
        )
    return {
        **extra,
        "format": args.format,
        "raw_text_mb": round(mb, 1),
        "documents": documents,
        "rounds": args.rounds,
        "load_average": os.getloadavg(),
        "mb_per_s": {k: spread(v) for k, v in rates.items()},
        "prepare_1_worker_over_sentencepiece": spread(per_worker),
        "prepare_2_workers_per_worker_over_sentencepiece": spread(per_worker_2),
        "speedup_2_over_1_workers": spread(scaling),
        "main_process_cpu_share": {
            k: spread([c["main"] / c["all"] for c in v]) for k, v in cpu.items()
        },
        "cpu_seconds": {k: spread([c["all"] for c in v]) for k, v in cpu.items()},
        "speedup_2_over_1_on_free_cores_from_cpu_split": spread(allowed) if allowed else None,
    }


def main() -> None:
    args = _args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="prepare_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        texts, mb, tok, cfg = _setup(args, work)
        if args.profile:
            _profile(cfg, tok, work, mb)
            return
        rates, cpu = _measure(args, cfg, tok, texts, mb, work)
        print(json.dumps(_summary(args, rates, cpu, mb, len(texts)), indent=2))
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
