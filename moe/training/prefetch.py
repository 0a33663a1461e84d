"""Reading the next step's batches while the current step runs."""

from __future__ import annotations

import queue
import threading

from data_pipeline.reader import PackedBatch, PackedReader
from moe.training.device import pin


class PrefetchingReader:
    """One optimizer step's micro-batches read ahead in a background thread, in data order.

    The thread reads step t+1 (and pins it when CUDA is present) while step t computes, and no
    further: it waits until step t+1 is handed out before reading step t+2. The data order is
    the wrapped reader's. :meth:`state_dict` is the reader's state after the steps handed out
    so far, captured by the thread right after reading each step, never the state after the
    step read ahead: a checkpoint resumes with the first step not yet trained on.
    """

    def __init__(self, reader: PackedReader, accum: int):
        self.reader, self.accum = reader, accum
        self._ready: queue.Queue = queue.Queue()
        self._wanted = threading.Semaphore(1)  # steps the thread may read before the next hand-out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state: dict | None = None  # the reader's state after the last step handed out

    def _read_ahead(self) -> None:
        while True:
            self._wanted.acquire()
            if self._stop.is_set():
                return
            try:
                batches = [pin(b) for b in self.reader.next_step(self.accum)]
                self._ready.put((batches, self.reader.state_dict()))
            except BaseException as e:  # handed to the training thread, which raises it
                self._ready.put(e)
                return

    def next_step(self) -> list[PackedBatch]:
        """The next step's ``accum`` micro-batches (pinned host tensors when CUDA is present)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._read_ahead, name="batch-prefetch", daemon=True
            )
            self._thread.start()
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        batches, self._state = item
        self._wanted.release()
        return batches

    def state_dict(self) -> dict:
        return self.reader.state_dict() if self._state is None else self._state

    def load_state_dict(self, state: dict, allow_other_data: bool | None = None) -> None:
        """Drop what was read ahead and continue from ``state``."""
        self.close()
        self.reader.load_state_dict(state, allow_other_data)
        self._state = None

    def skip(self, ranges) -> None:
        """Never read the global sample ranges ``ranges`` (:meth:`PackedReader.skip`); what was
        read ahead is dropped first, as it may lie in one."""
        self.close()
        self.reader.skip(ranges)

    def close(self) -> None:
        """Stop the thread (after the step it is reading, if any) and drop what it read: the
        reader is put back to the state after the last step handed out."""
        if self._thread is None:
            return
        self._stop.set()
        self._wanted.release()
        self._thread.join()
        self._thread = None
        self._ready = queue.Queue()
        self._wanted = threading.Semaphore(1)
        if self._state is not None:
            self.reader.load_state_dict(self._state)
