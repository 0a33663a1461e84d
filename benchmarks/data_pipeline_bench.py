"""Data pipeline benchmark (not a test): reader throughput against a raw memmap read, reader
start-up time, and preparation throughput.

    python benchmarks/data_pipeline_bench.py --tokens 100000000 --work-dir /tmp/bench

1. Synthesizes a data set of ``--tokens`` random token ids (documents of random length, EOS
   between them, vocabulary 32000 -> uint16) through the real shard writer, plus the same
   token bytes as one flat file.
2. Start-up: seconds to construct a PackedReader over it (median of 5).
3. Throughput: tokens/s of packed (B, seq_len + 1) int64 micro-batches over one epoch, as a
   ratio to a raw sequential ``numpy.memmap`` read of the same token bytes into batches of the
   same shape and dtype; interleaved rounds, best round of each.
4. Preparation: the standard-library corpus prepared with ``--workers`` processes; tokens/s per
   core, end to end and for the tokenize + write phase alone.
The synthesized data is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_pipeline.config import DataConfig
from data_pipeline.prepare import prepare
from data_pipeline.reader import PackedReader
from data_pipeline.shards import SCHEMA_VERSION, Manifest, ShardWriter, SplitInfo, write_manifest
from data_pipeline.workers import cpu_seconds

VOCAB, EOS = 32000, 2


def synthesize(data_dir: Path, tokens: int, shard_tokens: int, seed: int = 0) -> Path:
    """Random documents through the real writer; returns the flat file of the same tokens."""
    rng = np.random.default_rng(seed)
    writer = ShardWriter(data_dir, "train", "synthetic", shard_tokens, VOCAB)
    flat = data_dir / "flat.u16"
    written = 0
    with open(flat, "wb") as f:
        while written < tokens:
            n = min(1 << 22, tokens - written)
            lengths = rng.geometric(1 / 800, size=n // 400 + 1)
            lengths = lengths[np.cumsum(lengths) <= n]
            chunk = rng.integers(4, VOCAB, size=int(lengths.sum()), dtype=np.uint16)
            chunk[np.cumsum(lengths) - 1] = EOS
            writer.add(chunk, lengths)
            f.write(chunk.tobytes())
            written += len(chunk)
    writer.flush()
    valid = ShardWriter(data_dir, "valid", "synthetic", shard_tokens, VOCAB)
    valid.add(np.full(1000, EOS, dtype=np.uint16), np.ones(1000, dtype=np.int64))
    valid.flush()
    manifest = Manifest(
        SCHEMA_VERSION,
        "synthetic",
        {"file": None, "sha256": "synthetic", "vocab_size": VOCAB, "eos_id": EOS},
        "uint16",
        {"train": SplitInfo(writer.shards), "valid": SplitInfo(valid.shards)},
        [{"name": "synthetic"}],
    )
    write_manifest(data_dir, manifest)
    return flat


def raw_memmap_pass(flat: Path, batch: int, seq_len: int) -> tuple[int, float]:
    """Sequential memmap read into (batch, seq_len + 1) int64 tensors."""
    t0 = time.perf_counter()
    mm = np.memmap(flat, dtype=np.uint16, mode="r")
    step = batch * (seq_len + 1)
    tokens = 0
    for start in range(0, len(mm) - step + 1, step):
        b = torch.from_numpy(mm[start : start + step].astype(np.int64).reshape(batch, seq_len + 1))
        tokens += b.numel()
    return tokens, time.perf_counter() - t0


def reader_pass(data_dir: Path, batch: int, seq_len: int, doc_ids: bool) -> tuple[int, float]:
    """One epoch of the packed, shuffled reader (construction included)."""
    t0 = time.perf_counter()
    r = PackedReader(data_dir, seq_len, seed=1, micro_batch=batch, document_ids=doc_ids)
    tokens = 0
    for _ in range(r.streams[0].num_samples // batch):
        (b,) = r.next_step(1)
        tokens += b.tokens_BS.numel()
    return tokens, time.perf_counter() - t0


def bench_reader(data_dir: Path, flat: Path, batch: int, seq_len: int, rounds: int) -> dict:
    best = {"raw": 0.0, "reader": 0.0, "reader_doc_ids": 0.0}
    for _ in range(rounds):  # interleaved: machine noise hits both sides alike
        for name, run in (
            ("raw", lambda: raw_memmap_pass(flat, batch, seq_len)),
            ("reader", lambda: reader_pass(data_dir, batch, seq_len, False)),
            ("reader_doc_ids", lambda: reader_pass(data_dir, batch, seq_len, True)),
        ):
            tokens, seconds = run()
            best[name] = max(best[name], tokens / seconds)
    return {
        "batch": batch,
        "seq_len": seq_len,
        **{f"{k}_tokens_per_s": round(v) for k, v in best.items()},
        "ratio": round(best["reader"] / best["raw"], 3),
        "ratio_doc_ids": round(best["reader_doc_ids"] / best["raw"], 3),
    }


def bench_startup(data_dir: Path) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        PackedReader(data_dir, 2048, seed=1, micro_batch=8)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_prepare(work: Path, workers: int) -> dict:
    """Wall-clock figures per core assume the cores were ours; tokens per CPU-second does not
    (it is the per-core throughput on an idle machine, and stays meaningful on a shared one)."""
    cfg = DataConfig(dir=str(work / "stdlib"), prepare_workers=workers)
    cpu0 = cpu_seconds()
    report = prepare(cfg, progress=False)
    cpu = cpu_seconds() - cpu0
    tokens = report.manifest.splits["train"].tokens + report.manifest.splits["valid"].tokens
    return {
        "workers": workers,
        "tokens": tokens,
        "seconds": round(report.seconds, 1),
        "cpu_seconds": round(cpu, 1),
        "phases_s": {k: round(v, 1) for k, v in report.timings.items()},
        "tokens_per_cpu_second": round(tokens / cpu),
        "tokenize_write_tokens_per_cpu_second": round(tokens / report.timings["encode_cpu"]),
        "end_to_end_tokens_per_s_per_core": round(tokens / report.seconds / workers),
        "tokenize_write_tokens_per_s_per_core": round(tokens / report.timings["encode"] / workers),
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=100_000_000)
    p.add_argument("--shard-tokens", type=int, default=4_000_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work-dir", default=None, help="where to synthesize (default: a temp dir)")
    p.add_argument("--skip-prepare", action="store_true")
    p.add_argument(
        "--shapes",
        default="8x2048,64x256",
        help="reader shapes to measure, comma-separated BATCHxSEQ_LEN",
    )
    args = p.parse_args()
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="data-bench-", dir=args.work_dir))
    try:
        data_dir = work / "synthetic"
        data_dir.mkdir()
        t0 = time.perf_counter()
        flat = synthesize(data_dir, args.tokens, args.shard_tokens)
        out = {
            "load_average": os.getloadavg()[0],
            "tokens": args.tokens,
            "shards": len(list(data_dir.glob("train-*.arrow"))),
            "synthesize_s": round(time.perf_counter() - t0, 1),
            "startup_s": round(bench_startup(data_dir), 4),
            "throughput": [
                bench_reader(data_dir, flat, batch, seq_len, args.rounds)
                for batch, seq_len in shapes
            ],
        }
        print(json.dumps(out, indent=2), flush=True)
        shutil.rmtree(data_dir)
        if not args.skip_prepare:
            print(json.dumps({"prepare_stdlib": bench_prepare(work, args.workers)}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
