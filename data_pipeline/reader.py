"""Streaming reader of packed sequences over tokenized Arrow shards.

The token stream of a split is the concatenation of its shards (documents separated by EOS).
Sample ``i`` is the window ``stream[i * (L + 1) : (i + 1) * (L + 1)]``. The order in which samples
are consumed is a pure function of (data fingerprint, seed, epoch, global sample index), and the
only state is a global cursor, so a run can resume on any number of ranks or micro-batch size and
continue the same global sequence order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from data_pipeline.shards import Manifest, open_shard, read_manifest
from moe.errors import DataError


class TokenStream:
    """Random access to a split's concatenated tokens, memory-mapped shard by shard. Start-up
    cost is one open per shard; no index over tokens is built."""

    def __init__(self, data_dir: str | Path, split: str, manifest: Manifest | None = None):
        self.data_dir = Path(data_dir)
        self.manifest = manifest or read_manifest(self.data_dir)
        if split not in self.manifest.splits:
            raise DataError(f"{self.data_dir}: no split {split!r} in the manifest")
        infos = self.manifest.splits[split].shards
        self.shards = [open_shard(self.data_dir / s.file, s) for s in infos]
        self.starts = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in self.shards], out=self.starts[1:])
        self.vocab_size = int(self.manifest.tokenizer["vocab_size"])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        pos, filled = start, 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            local = pos - self.starts[shard]
            take = min(length - filled, len(self.shards[shard]) - local)
            out[filled:filled + take] = self.shards[shard][local:local + take]
            filled, pos, shard = filled + take, pos + take, shard + 1
        if out.size and out.max() >= self.vocab_size:
            raise DataError(f"{self.data_dir}: token id {int(out.max())} out of range for the "
                            f"tokenizer's vocabulary of {self.vocab_size}")
        return out


class PackedReader:
    """Micro-batches of packed training sequences for one data-parallel rank.

    A global batch of step s is the samples at order positions [s * G, (s + 1) * G) with
    G = micro_batch * accum * world; rank r's m-th micro-batch of that step is the slice starting
    at s * G + (m * world + r) * micro_batch. Every rank reads disjoint samples."""

    def __init__(self, data_dir: str | Path, seq_len: int, seed: int, rank: int, world: int,
                 micro_batch: int):
        self.stream = TokenStream(data_dir, "train")
        self.seq_len, self.seed = seq_len, seed
        self.rank, self.world, self.micro_batch = rank, world, micro_batch
        self.num_samples = len(self.stream) // (seq_len + 1)
        if self.num_samples < world * micro_batch:
            raise DataError(f"{data_dir}: only {self.num_samples} training sequences of "
                            f"{seq_len + 1} tokens; need at least {world * micro_batch}")
        self.fingerprint = self.stream.manifest.fingerprint
        self.consumed = 0  # global samples consumed at step boundaries: the whole state
        self._perm_epoch, self._perm = -1, None

    def _sample_id(self, position: int) -> int:
        epoch, index = divmod(position, self.num_samples)
        if epoch != self._perm_epoch:
            key = int(self.fingerprint, 16) % 2**63
            self._perm = np.random.default_rng([self.seed, key, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return int(self._perm[index])

    def sample(self, position: int) -> np.ndarray:
        i = self._sample_id(position)
        return self.stream.read(i * (self.seq_len + 1), self.seq_len + 1)

    def micro_batches(self, accum: int) -> list[torch.Tensor]:
        """The micro-batches of the next optimizer step for this rank; advances the cursor."""
        out = []
        for m in range(accum):
            base = self.consumed + (m * self.world + self.rank) * self.micro_batch
            rows = [self.sample(base + j) for j in range(self.micro_batch)]
            out.append(torch.from_numpy(np.stack(rows)))
        self.consumed += accum * self.world * self.micro_batch
        return out

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed, "seed": self.seed,
                "fingerprint": self.fingerprint, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict, allow_other_data: bool = False) -> None:
        if state["fingerprint"] != self.fingerprint and not allow_other_data:
            raise DataError(f"the checkpoint's data fingerprint {state['fingerprint']} differs from "
                            f"this data's {self.fingerprint}; pass allow_other_data to resume anyway")
        if state["seq_len"] != self.seq_len or state["seed"] != self.seed:
            raise DataError("the checkpoint's data stream used seq_len/seed "
                            f"{state['seq_len']}/{state['seed']}, this run {self.seq_len}/{self.seed}")
        self.consumed = int(state["consumed_samples"])


def validation_windows(data_dir: str | Path, seq_len: int, max_tokens: int | None = None):
    """A fixed pass over the validation split: consecutive windows of seq_len + 1 tokens that
    overlap by one token, so every token after the first is predicted exactly once."""
    stream = TokenStream(data_dir, "valid")
    total = len(stream) if max_tokens is None else min(len(stream), max_tokens + 1)
    start = 0
    while start + 1 < total:
        length = min(seq_len + 1, total - start)
        yield torch.from_numpy(stream.read(start, length))
        start += length - 1
