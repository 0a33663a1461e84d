"""The collective recorder on a real 2-rank gloo group whose timeout is short: rank 1 never
enters the all-reduce rank 0 waits in; rank 0's error names the collective, the rank and the
setting, and the record says it is still inside it."""

import datetime
import os
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.helpers.distributed import _free_port

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 2


def _worker(rank, port, out_dir):
    import torch
    import torch.distributed as dist

    from moe.training.resilience.collectives import LAST, CollectiveTimeout, record_collectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    record_collectives(rank, TIMEOUT_S)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    dist.barrier()
    assert LAST.name == "barrier" and LAST.returned
    # A collective made of others (all_gather_object calls all_gather) counts once: the
    # sequence numbers that ranks compare in a hang stay in step.
    calls = LAST.calls
    dist.all_gather_object([None, None], rank)
    assert (LAST.name, LAST.calls, LAST.returned) == ("all_gather_object", calls + 1, True)
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
        except CollectiveTimeout as e:
            Path(out_dir, "error").write_text(
                f"{time.monotonic() - t0:.1f}\n{e}\n{LAST.describe()}"
            )
    else:
        time.sleep(TIMEOUT_S * 4)  # never enters the all-reduce
    os._exit(0)  # the group is broken: no orderly teardown


def test_a_timed_out_collective_names_itself_and_the_setting(tmp_path):
    mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    seconds, message, record = (tmp_path / "error").read_text().split("\n", 2)
    assert float(seconds) < TIMEOUT_S * 3
    assert message.startswith(
        f"rank 0: all_reduce did not complete within {TIMEOUT_S}s "
        f"(the process group's timeout: train.hang_timeout_s plus the hang "
        f"watchdog's margin)"
    ), message
    assert record.startswith("last collective entered: all_reduce") and "still inside" in record
