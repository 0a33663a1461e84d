"""One torch thread for small CPU tests: other test processes share the cores, and two threads
spinning on a busy machine made small forwards 10-100x slower here."""

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
