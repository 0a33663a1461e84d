"""A preparation that kills itself with SIGKILL at a chosen point, as an OOM killer, a
preempted node or a power cut would (no handler, no cleanup runs):

    python -m tests.helpers.prepare_kill POINT COUNT CONFIG_PICKLE

runs ``prepare(config, force=True)`` and dies at POINT, COUNT times in:

- ``tokenizer``: once the tokenizer is built;
- ``shard``: after COUNT shards are written;
- ``upload``: after COUNT objects are uploaded;
- ``manifest``: just before the manifest is written (the switch);
- ``remove``: after COUNT files of the earlier data are removed (after the switch).

The hooks wrap the pipeline's own functions in this process only: nothing of them is in the
code a user runs.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys

from data_pipeline import generations, shards, storage
from data_pipeline import prepare as prep
from tests.helpers.s3 import put_object

POINTS = {
    "tokenizer": (prep, "build_tokenizer", "after"),
    "shard": (shards, "write_shard", "after"),
    "upload": (storage, "upload", "after"),
    "manifest": (generations, "write_manifest", "before"),
    "remove": (storage, "delete", "after"),
}


def kill_at(point: str, count: int) -> None:
    module, name, when = POINTS[point]
    real, calls = getattr(module, name), [0]

    def hooked(*args, **kwargs):
        calls[0] += 1
        if when == "before" and calls[0] == count:
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if when == "after" and calls[0] == count:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(module, name, hooked)


def main(argv: list[str]) -> None:
    point, count, config = argv
    with open(config, "rb") as f:
        cfg = pickle.load(f)
    if storage.is_s3(cfg.dir):
        storage.upload = put_object
    kill_at(point, int(count))
    prep.prepare(cfg, force=True, progress=False)
    print("completed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
