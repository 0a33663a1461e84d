"""Progress of a long command (prepare, verify, evaluate): a tqdm bar on a terminal, periodic log
lines otherwise (a batch job's log gets a line every ``interval`` seconds, not a bar redrawn in
place). It lives here, at the bottom of the layers, so that every command can use it."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import TextIO

from tqdm import tqdm


class Progress:
    """Counts work done (bytes of input by default, or any ``unit``: tokens, tensors) against
    the total expected, and the documents and tokens seen on the way."""

    def __init__(
        self,
        desc: str,
        total_bytes: int,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 30.0,
        unit: str = "B",
    ):
        self.desc, self.total, self.interval = desc, max(int(total_bytes), 1), interval
        self.unit = unit
        self.stream = stream or sys.stderr
        self.bytes = self.documents = self.tokens = 0
        self._start = self._last = time.monotonic()
        self._bar = None
        self._log = False
        if enabled and self.stream.isatty():
            self._bar = tqdm(
                total=self.total,
                desc=desc,
                unit=unit,
                unit_scale=unit == "B",
                dynamic_ncols=True,
                file=self.stream,
            )
        else:
            self._log = enabled

    def update(self, nbytes: int, documents: int = 0, tokens: int = 0) -> None:
        self.bytes += nbytes
        self.documents += documents
        self.tokens += tokens
        seconds = max(time.monotonic() - self._start, 1e-9)
        if self._bar is not None:
            self._bar.update(nbytes)
            self._bar.set_postfix(
                docs_s=f"{self.documents / seconds:,.0f}", tokens_s=f"{self.tokens / seconds:,.0f}"
            )
        elif self._log and time.monotonic() - self._last >= self.interval:
            self._last = time.monotonic()
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        seconds = max(time.monotonic() - self._start, 1e-9)
        rate = self.bytes / seconds
        left = (self.total - self.bytes) / rate if rate > 0 else None
        eta = str(timedelta(seconds=round(left))) if left is not None and left >= 0 else "?"
        share = f"({100 * self.bytes / self.total:.0f}%)"
        if self.unit != "B":
            return (
                f"{self.desc}: {self.bytes:,} of {self.total:,} {self.unit} {share}; "
                f"{rate:,.1f} {self.unit}/s; ETA {eta}"
            )
        return (
            f"{self.desc}: {self.bytes / 1e6:,.1f} of {self.total / 1e6:,.1f} MB {share}, "
            f"{self.documents:,} documents, {self.tokens:,} tokens; {rate / 1e6:.2f} MB/s, "
            f"{self.documents / seconds:,.0f} documents/s, {self.tokens / seconds:,.0f} tokens/s; "
            f"ETA {eta}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._log:
            self.stream.write(self.line() + " (done)\n")
            self.stream.flush()


def item_bar(progress: bool, **kw) -> tqdm:
    """A plain tqdm bar over ``kw['iterable']`` (work items read or encoded), shown where the
    output is a terminal (tqdm's own check) and ``progress`` is true."""
    return tqdm(disable=None if progress else True, dynamic_ncols=True, **kw)
