"""Streaming reader of packed sequences over tokenized Arrow shards.

Shape legend: ``B`` sequences in a micro-batch, ``S = seq_len + 1`` tokens per sequence.

Where a sample comes from, for global sample position ``g`` (counted over the whole job):

1. the mixture schedule picks the source ``s`` of ``g`` and the index ``k`` of that sample within
   the source's own sample sequence (:mod:`data_pipeline.mixture`);
2. ``k`` falls in the source's epoch ``e = k // n_s`` (``n_s`` windows of ``S`` tokens fit in
   its token stream); in epoch ``e`` the source's shards are concatenated in a seeded shuffled
   order (so window boundaries move from epoch to epoch) and window ``perm_e(k % n_s)`` of that
   stream is the sample, ``perm_e`` being a seeded Feistel permutation computed on the fly
   (:mod:`data_pipeline.permutation`).

So the order is a pure function of (data fingerprint, seed, epoch, global position): nothing is
built over tokens or samples at start-up (one open per shard), the state is one cursor plus
counters, and any layout can resume any other. Data-parallel rank ``r`` of ``W`` with micro-batch
``B`` and ``A`` accumulation steps reads, in optimizer step ``t`` after the cursor ``c``, the
positions ``c + t * G + (m * W + r) * B + [0, B)`` for its micro-batch ``m`` (``G = A * W * B``);
DataLoader workers take a rank's micro-batches round-robin, which is the order the DataLoader
yields them in. Positions are disjoint across ranks and workers and contiguous over the job.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline.cache import ReadAhead
from data_pipeline.errors import DataError
from data_pipeline.mixture import MixtureSchedule
from data_pipeline.permutation import FeistelPermutation, round_keys
from data_pipeline.prepared import PreparedData
from data_pipeline.shards import Manifest, ShardInfo

Pieces = list[tuple[int, int, int]]
"""A row that crosses shards: (shard, first token, end token) of each of its parts, in order."""

STATE_VERSION = 1
PLAN_TOKENS, PLAN_ROWS = 1 << 24, 1 << 14
"""Tokens (and at most rows) located per plan: amortizes the permutation's numpy calls. The
tokens bound also bounds the rows that cross shards, which are assembled when located."""
GROUP_ROWS, GROUP_TOKENS = 32, 1 << 18
"""Rows (and at most tokens) copied and converted at a time: amortizes the per-call cost of
numpy over a few short micro-batches."""


@dataclass
class PackedBatch:
    tokens_BS: torch.Tensor
    """Token ids, int64: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    doc_ids_BS: torch.Tensor | None = None
    """Per token, the index of its document within the sequence (0, 1, ...; a document's EOS
    belongs to it): attention can be restricted to equal ids and positions restarted where the
    id changes. None unless the reader was asked for document ids."""
    targets_BS: torch.Tensor | None = None
    """(B, S - 1) int64 next-token targets, ``IGNORE_INDEX`` where the loss mask of the token
    is 0 (prompt tokens of instruction data); None: data without a loss mask, every target is
    trained (``tokens_BS[:, 1:]``)."""

    def targets(self) -> torch.Tensor:
        return self.tokens_BS[:, 1:] if self.targets_BS is None else self.targets_BS


IGNORE_INDEX = -100
"""The target the model's loss ignores (``ignore_index`` of moe/model/transformer.py)."""


def next_token_targets(tokens: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """int64 targets of windows of tokens (``(..., S)`` -> ``(..., S - 1)``): each next token,
    or IGNORE_INDEX where its loss mask is 0."""
    targets = tokens[..., 1:].astype(np.int64)
    if mask is not None:
        targets[mask[..., 1:] == 0] = IGNORE_INDEX
    return targets


def document_ids(tokens_BS: np.ndarray, eos_id: int) -> np.ndarray:
    """(B, S) int32: the number of EOS tokens strictly before each position of its row."""
    doc_BS = np.empty(tokens_BS.shape, dtype=np.int32)
    doc_BS[:, 0] = 0
    np.equal(tokens_BS[:, :-1], eos_id, out=doc_BS[:, 1:])
    # In place on int32: a cumulative sum straight from bool casts through a buffer, which
    # measured up to five times slower.
    np.cumsum(doc_BS, axis=1, out=doc_BS)
    return doc_BS


def prepared(data: str | Path | PreparedData) -> PreparedData:
    return data if isinstance(data, PreparedData) else PreparedData(data)


class SourceStream:
    """One source's shards of one split, as windows of ``window`` tokens (see module doc).
    Local shards are memory-mapped (and checked) at once, remote ones when they are read."""

    def __init__(
        self, data: PreparedData, name: str, shards: list[ShardInfo], window: int, key: tuple
    ):
        if not shards:
            raise DataError(f"{data}: source {name!r} has no shards in this split")
        self.name, self.window, self.key = name, window, key
        self.infos = shards
        self.files = [data.location(s.file) for s in shards]
        opened = [] if data.remote else [data.open_local_data(s) for s in shards]
        self.arrays = None if data.remote else [o.tokens for o in opened]
        self.masks = None if data.remote or not data.masked else [o.mask for o in opened]
        self.lengths = np.array([s.tokens for s in shards], dtype=np.int64)
        self.num_samples = int(self.lengths.sum()) // window
        if self.num_samples < 1:
            raise DataError(
                f"{data}: source {name!r} has {int(self.lengths.sum())} tokens, "
                f"fewer than one sequence of {window}"
            )
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, FeistelPermutation]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, FeistelPermutation]:
        if epoch not in self._epochs:
            if len(self._epochs) >= 4:
                self._epochs.pop(next(iter(self._epochs)))
            seed = np.frombuffer(round_keys(*self.key, "shards", epoch).tobytes(), np.uint32)
            order = np.random.default_rng(seed).permutation(len(self.infos))
            starts = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(self.lengths[order], out=starts[1:])
            perm = FeistelPermutation(self.num_samples, round_keys(*self.key, "samples", epoch))
            self._epochs[epoch] = (order, starts, perm)
        return self._epochs[epoch]

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, Pieces]]:
        """For source sample indices ``k``: the shard and offset of each window, and the parts
        of the windows that cross a shard boundary (their shard set to -1)."""
        epoch, index = np.divmod(k, self.num_samples)
        shard, offset = np.empty_like(k), np.empty_like(k)
        crossing: dict[int, np.ndarray] = {}
        for e in range(int(epoch.min()), int(epoch.max()) + 1):  # np.unique: a fifth of locate
            sel = np.flatnonzero(epoch == e)
            if not sel.size:
                continue
            order, starts, perm = self._epoch(e)
            begin = perm(index[sel]) * self.window
            pos = np.searchsorted(starts, begin, side="right") - 1
            shard[sel], offset[sel] = order[pos], begin - starts[pos]
            for i in np.flatnonzero(begin + self.window > starts[pos + 1]).tolist():
                crossing[int(sel[i])] = self._pieces(order, starts, int(pos[i]), int(begin[i]))
                shard[sel[i]] = -1
        return shard, offset, crossing

    def _pieces(self, order: np.ndarray, starts: np.ndarray, pos: int, begin: int) -> Pieces:
        parts, need, local = [], self.window, begin - int(starts[pos])
        while need:
            g = int(order[pos])
            take = min(need, int(self.lengths[g]) - local)
            parts.append((g, local, local + take))
            need, pos, local = need - take, pos + 1, 0
        return parts

    def where(self, k: int) -> str:
        """The file and offset a sample starts at (for error messages)."""
        epoch, index = divmod(k, self.num_samples)
        order, starts, perm = self._epoch(epoch)
        begin = int(perm(np.array([index]))[0]) * self.window
        pos = int(np.searchsorted(starts, begin, side="right")) - 1
        return f"{self.files[order[pos]]} at token {begin - int(starts[pos])}"


class PackedReader:
    """Micro-batches of packed training sequences for one data-parallel rank.

    ``weights`` (source name -> weight) mixes the sources; None takes each in proportion to its
    tokens. ``loader_workers`` > 0 packs batches ahead in DataLoader worker processes.
    ``document_ids`` adds per-token document ids to :meth:`next_step`'s batches. ``data_dir``
    is a local directory or a :class:`PreparedData` (which may be on S3)."""

    def __init__(
        self,
        data_dir: str | Path | PreparedData,
        seq_len: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        micro_batch: int = 1,
        *,
        weights: dict[str, float] | None = None,
        loader_workers: int = 0,
        document_ids: bool = False,
        allow_other_data: bool = False,
    ):
        if not 0 <= rank < world or micro_batch < 1 or seq_len < 1:
            raise ValueError(
                f"bad layout: rank {rank}, world {world}, micro_batch {micro_batch}, "
                f"seq_len {seq_len}"
            )
        self.data = prepared(data_dir)
        self._spec = dict(
            data_dir=self.data,
            seq_len=seq_len,
            seed=seed,
            rank=rank,
            world=world,
            micro_batch=micro_batch,
            weights=weights,
            loader_workers=0,
            document_ids=document_ids,
            allow_other_data=allow_other_data,
        )
        self.data_dir = self.data.dir
        self.seq_len, self.seed = seq_len, seed
        self.rank, self.world, self.micro_batch = rank, world, micro_batch
        self.loader_workers, self.document_ids = loader_workers, document_ids
        self.allow_other_data = allow_other_data
        self.manifest: Manifest = self.data.manifest
        self.fingerprint = self.manifest.fingerprint
        self.vocab_size = int(self.manifest.tokenizer["vocab_size"])
        self.eos_id = int(self.manifest.tokenizer["eos_id"])
        names = self.manifest.source_names
        shards = self.manifest.splits["train"]
        self.streams = [
            SourceStream(
                self.data, n, shards.of_source(n), seq_len + 1, (self.fingerprint, seed, n)
            )
            for n in names
        ]
        if weights is None:
            self.weights = [float(s.lengths.sum()) for s in self.streams]
        else:
            if sorted(weights) != sorted(names):
                raise DataError(
                    f"{self.data_dir}: mixture weights name sources {sorted(weights)} "
                    f"but the data holds {sorted(names)}"
                )
            self.weights = [float(weights[n]) for n in names]
        self.schedule = MixtureSchedule(self.weights)
        # Shards of all sources in one list: source s's shards start at _first_shard[s].
        self._first_shard = np.cumsum([0] + [len(s.infos) for s in self.streams[:-1]]).tolist()
        self._infos = [i for s in self.streams for i in s.infos]
        self._read_ahead = (
            ReadAhead(self.data.cache) if self.data.remote and self.data.read_ahead > 0 else None
        )
        self.consumed = 0  # global samples consumed at step boundaries: the cursor
        self.skipped: list[tuple[int, int]] = []  # global sample ranges [start, end) never read
        self._iter: Iterator[PackedBatch] | None = None
        self._iter_key: tuple[int, int] | None = None

    # --- where samples come from ---

    def rank_positions(self, start: int, accum: int, micro: np.ndarray) -> np.ndarray:
        """(len(micro), B) global positions of this rank's micro-batches ``micro`` (counted from
        the cursor ``start``, ``accum`` micro-batches per optimizer step)."""
        step, m = np.divmod(np.asarray(micro, dtype=np.int64), accum)
        base = (
            start
            + step * (accum * self.world * self.micro_batch)
            + (m * self.world + self.rank) * self.micro_batch
        )
        return base[:, None] + np.arange(self.micro_batch)

    def _locate(self, positions: np.ndarray):
        source, k = self.schedule.locate(positions.reshape(-1))
        shard = np.empty_like(k)
        offset = np.empty_like(k)
        pieces: dict[int, Pieces] = {}
        for s, stream in enumerate(self.streams):
            rows = np.flatnonzero(source == s)
            if rows.size:
                sh, off, crossing = stream.locate(k[rows])
                shard[rows], offset[rows] = sh + self._first_shard[s], off
                first = self._first_shard[s]
                pieces.update(
                    (int(rows[i]), [(g + first, a, b) for g, a, b in parts])
                    for i, parts in crossing.items()
                )
                shard[rows[sh < 0]] = -1
        return source, k, shard, offset, pieces

    def _gather(
        self,
        shard: np.ndarray,
        offset: np.ndarray,
        pieces: dict[int, Pieces],
        S: int,
        dtype: np.dtype,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(R, S) stored tokens of a plan's rows, and their loss mask (None: data without one),
        read shard by shard: each shard the plan needs is opened (fetched into the cache if
        needed) once, in shard order, while the next ``read_ahead`` ones are fetched in the
        background."""
        plan_RS = np.empty((len(shard), S), dtype)
        mask_RS = np.empty((len(shard), S), np.uint8) if self.data.masked else None
        by_shard = np.argsort(shard, kind="stable")
        bounds = np.searchsorted(shard[by_shard], np.arange(len(self._infos) + 1))
        parts: dict[int, list[tuple[int, int, int, int]]] = {}
        for r, row_parts in pieces.items():
            col = 0
            for g, a, b in row_parts:
                parts.setdefault(g, []).append((r, col, a, b))
                col += b - a
        needed = sorted(set(np.unique(shard[shard >= 0]).tolist()) | set(parts))
        ahead = self.data.read_ahead
        for j, g in enumerate(needed):
            if self._read_ahead is not None:
                self._read_ahead.want(
                    self.data.fetch_items([self._infos[h] for h in needed[j + 1 : j + 1 + ahead]])
                )
            try:
                with self.data.shard_data(self._infos[g]) as (tokens, mask):
                    rows = by_shard[bounds[g] : bounds[g + 1]]
                    for out, stored in ((plan_RS, tokens), (mask_RS, mask)):
                        if out is None:
                            continue
                        if rows.size:
                            out[rows] = stored[offset[rows, None] + np.arange(S)]
                        for r, col, a, b in parts.get(g, ()):
                            out[r, col : col + b - a] = stored[a:b]
            except BaseException:
                if self._read_ahead is not None:
                    self._read_ahead.stop()  # its fetch under way cleans up before we raise
                raise
        return plan_RS, mask_RS

    def _batches(
        self, start: int, accum: int, worker: int = 0, num_workers: int = 1
    ) -> Iterator[PackedBatch]:
        """This rank's micro-batches ``worker, worker + num_workers, ...`` from cursor ``start``.

        Rows are located a plan (many micro-batches) at a time, which amortizes the numpy calls
        of the permutation, then copied a group (one or a few micro-batches) at a time: one
        C-level copy of the rows, sliced as memoryviews of the memory-mapped shards, into a new
        buffer of the stored type (``bytes.join``), one range check and one int64 conversion
        into a new array whose row ranges are the group's micro-batches (each its own tensor;
        nothing is written after it is yielded). Measured slower: slicing the shards as numpy
        arrays and concatenating (about twice the cost per row); one fancy index per shard
        (wins only while a group holds many rows of each shard, i.e. with few shards); copying
        a whole plan before converting (falls out of cache)."""
        S, B = self.seq_len + 1, self.micro_batch
        per_plan = max(1, min(PLAN_TOKENS // (S * B), PLAN_ROWS // B))
        group = B * max(1, min(GROUP_ROWS // B, GROUP_TOKENS // (B * S)))  # rows
        dtype = np.dtype(getattr(pa, self.manifest.token_type)().to_pandas_dtype())
        remote, masked = self.data.remote, self.data.masked
        # Token arrays, and the loss masks of masked data: copied row by row alike.
        stored = [] if remote else [[a for s in self.streams for a in s.arrays]]
        if masked and not remote:
            stored.append([m for s in self.streams for m in s.masks])
        # Shard -1 (a row that crosses shards) slices the empty view; the row is patched in.
        views = [[memoryview(a) for a in arrays] + [memoryview(b"")] for arrays in stored]
        dtypes = (dtype, np.uint8)
        first = worker
        while True:
            micro = first + num_workers * np.arange(per_plan)
            source, k, shard, offset, pieces = self._locate(
                self.rank_positions(start, accum, micro)
            )
            if remote:
                plan_RS, plan_mask_RS = self._gather(shard, offset, pieces, S, dtype)
            shards, offsets = shard.tolist(), offset.tolist()
            crossing: dict[int, list[tuple[int, list[np.ndarray]]]] = {}
            for r, parts in ({} if remote else pieces).items():
                rows = [np.concatenate([arrays[g][a:b] for g, a, b in parts]) for arrays in stored]
                crossing.setdefault(r - r % group, []).append((r % group, rows))
            for i in range(0, per_plan * B, group):
                n = min(group, per_plan * B - i)
                mask_RS = None
                if remote:
                    stored_RS = plan_RS[i : i + n]
                    mask_RS = None if plan_mask_RS is None else plan_mask_RS[i : i + n]
                else:
                    copied = []
                    for c, view in enumerate(views):
                        rows = [
                            view[g][a : a + S]
                            for g, a in zip(shards[i : i + n], offsets[i : i + n])
                        ]
                        for r, row in crossing.get(i, ()):
                            rows[r] = row[c]
                        copied.append(np.frombuffer(b"".join(rows), dtypes[c]).reshape(n, S))
                    stored_RS, mask_RS = copied[0], copied[1] if masked else None
                # The first row holding an out-of-range id (n if none): the micro-batch that
                # holds it raises, the ones before it are delivered.
                bad = n
                if stored_RS.max() >= self.vocab_size:
                    bad = int(np.flatnonzero(stored_RS.max(axis=1) >= self.vocab_size)[0])
                tokens_RS = stored_RS.astype(np.int64)
                doc_RS = document_ids(stored_RS, self.eos_id) if self.document_ids else None
                targets_RS = None if mask_RS is None else next_token_targets(tokens_RS, mask_RS)
                for j in range(0, n, B):
                    if j + B > bad:
                        self._out_of_range(stored_RS[j : j + B], source[i + j :], k[i + j :])
                    yield PackedBatch(
                        torch.from_numpy(tokens_RS[j : j + B]),
                        None if doc_RS is None else torch.from_numpy(doc_RS[j : j + B]),
                        None if targets_RS is None else torch.from_numpy(targets_RS[j : j + B]),
                    )
            first += num_workers * per_plan

    def _out_of_range(self, tokens_BS: np.ndarray, source: np.ndarray, k: np.ndarray) -> None:
        row = int(np.flatnonzero((tokens_BS >= self.vocab_size).any(axis=1))[0])
        where = self.streams[int(source[row])].where(int(k[row]))
        raise DataError(
            f"token id {int(tokens_BS[row].max())} out of range for the tokenizer's "
            f"vocabulary of {self.vocab_size} in the sample from {where}"
        )

    # --- the training interface ---

    def skip(self, ranges) -> None:
        """Never read the global sample positions ``[start, end)`` of ``ranges``: a step that
        would start inside one starts at its end instead (the order of the other samples does
        not change: it is a function of the position)."""
        self.skipped = sorted({(int(a), int(b)) for a, b in [*self.skipped, *ranges] if b > a})

    def next_step(self, accum: int) -> list[PackedBatch]:
        """The ``accum`` micro-batches of this rank's next optimizer step; advances the cursor
        (past the skipped ranges first)."""
        for a, b in self.skipped:
            if a <= self.consumed < b:
                self.consumed = b
        end = self.consumed + accum * self.world * self.micro_batch
        for a, b in self.skipped:
            if self.consumed < a < end:
                raise DataError(
                    f"the samples [{a}, {b}) that a loss-spike rollback took out (the run "
                    f"directory's skipped_batches.jsonl) begin inside this step's samples "
                    f"[{self.consumed}, {end}): the global batch changed since the rollback. "
                    "Resume with the global batch of the run that rolled back, at least until "
                    "past these samples"
                )
        if self._iter is None or self._iter_key != (self.consumed, accum):
            self._iter = self._open_iter(accum)
        out = [next(self._iter) for _ in range(accum)]
        self.consumed += accum * self.world * self.micro_batch
        self._iter_key = (self.consumed, accum)
        return out

    def micro_batches(self, accum: int) -> list[torch.Tensor]:
        """Token tensors (B, S) of this rank's next optimizer step; advances the cursor."""
        return [b.tokens_BS for b in self.next_step(accum)]

    def _open_iter(self, accum: int) -> Iterator[PackedBatch]:
        if self.loader_workers == 0:
            return self._batches(self.consumed, accum)
        dataset = _RankDataset(self._spec, self._mixture_state(), self.consumed, accum)
        return iter(
            DataLoader(dataset, batch_size=None, num_workers=self.loader_workers, prefetch_factor=2)
        )

    # --- state ---

    def _mixture_state(self) -> dict:
        return {
            "weights": self.weights,
            "base_samples": self.schedule.base_samples,
            "base_counts": self.schedule.base_counts.tolist(),
        }

    def _set_mixture(self, state: dict) -> None:
        self.schedule = MixtureSchedule(
            state["weights"], state["base_samples"], state["base_counts"]
        )

    def state_dict(self) -> dict:
        counts = self.schedule.counts(self.consumed)
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "consumed_samples": self.consumed,
            "sources": {
                s.name: {
                    "samples": int(c),
                    "tokens": int(c) * (self.seq_len + 1),
                    "epoch": int(c) // s.num_samples,
                }
                for s, c in zip(self.streams, counts)
            },
            "mixture": self._mixture_state(),
        }

    def load_state_dict(self, state: dict, allow_other_data: bool | None = None) -> None:
        """Continue where ``state`` left off, on this reader's layout (any world size, micro-batch
        size or worker count). The data must be the same unless ``allow_other_data`` (default:
        the constructor's); seq_len and seed must be the same."""
        allow = self.allow_other_data if allow_other_data is None else allow_other_data
        if state.get("version") != STATE_VERSION:
            raise DataError(
                f"data reader state version {state.get('version')} is not {STATE_VERSION}"
            )
        if state["fingerprint"] != self.fingerprint and not allow:
            raise DataError(
                f"the checkpoint's data fingerprint {state['fingerprint']} differs "
                f"from that of {self.data_dir} ({self.fingerprint}); set "
                "data.allow_other_data_on_resume to resume on other data anyway"
            )
        if state["seq_len"] != self.seq_len or state["seed"] != self.seed:
            raise DataError(
                "the checkpoint's data stream used seq_len/seed "
                f"{state['seq_len']}/{state['seed']}, this run {self.seq_len}/{self.seed}"
            )
        consumed = int(state["consumed_samples"])
        names = [s.name for s in self.streams]
        counts = [int(state["sources"].get(n, {"samples": 0})["samples"]) for n in names]
        same_sources = list(state["sources"]) == names
        if same_sources and state["mixture"]["weights"] == self.weights:
            self._set_mixture(state["mixture"])
            if self.schedule.counts(consumed).tolist() != counts:
                raise DataError(
                    f"inconsistent data reader state: per-source counters {counts} "
                    f"do not match the cursor {consumed}"
                )
        elif same_sources or allow:
            # New weights (or new sources): restart the schedule here from the counters.
            self.schedule = MixtureSchedule(self.weights, consumed, counts)
        else:
            raise DataError(
                f"the checkpoint read sources {list(state['sources'])}, this data holds {names}"
            )
        self.consumed = consumed
        self._iter = None


class _RankDataset(IterableDataset):
    """A rank's micro-batches from a cursor, split round-robin over DataLoader workers; each
    worker memory-maps the shards itself."""

    def __init__(self, spec: dict, mixture: dict, start: int, accum: int):
        self.spec, self.mixture, self.start, self.accum = spec, mixture, start, accum

    def __iter__(self) -> Iterator[PackedBatch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        reader = PackedReader(**self.spec)
        reader._set_mixture(self.mixture)
        return reader._batches(self.start, self.accum, worker, num_workers)
