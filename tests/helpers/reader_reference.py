"""The packed reader's rows computed straight from their definition (the module doc of
data_pipeline.reader), one global position at a time, without the reader's plans and copies."""

import numpy as np

from data_pipeline.reader import PackedReader


class ReferenceRows:
    """``rows(g)``: the stored token ids (no range check) of global position ``g``."""

    def __init__(self, reader: PackedReader):
        self.reader = reader
        self._tokens: dict[tuple[int, int], np.ndarray] = {}

    def __call__(self, g: int) -> np.ndarray:
        source, k = (int(x[0]) for x in self.reader.schedule.locate(np.array([g])))
        stream = self.reader.streams[source]
        epoch, index = divmod(k, stream.num_samples)
        order, _, perm = stream._epoch(epoch)
        if (source, epoch) not in self._tokens:
            self._tokens[source, epoch] = np.concatenate([stream.arrays[i] for i in order])
        begin = int(perm(np.array([index]))[0]) * stream.window
        return self._tokens[source, epoch][begin : begin + stream.window]


def reference_doc_ids(row: np.ndarray, eos_id: int) -> list[int]:
    """Per token, how many documents ended before it in the row."""
    out, doc = [], 0
    for t in row.tolist():
        out.append(doc)
        doc += t == eos_id
    return out
