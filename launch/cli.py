"""Shared command-line plumbing: logging setup and turning our errors into a clear exit."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Iterator

from data_pipeline.errors import DataError
from moe.core.errors import MoEError
from moe.core.fileio import STORAGE_CAUSES


def setup_logging(rank: int = 0, log_file: str | None = None) -> None:
    """Rank 0 logs to the console; every rank logs to its own file when one is given."""
    handlers: list[logging.Handler] = []
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s", "%H:%M:%S")
    root = logging.getLogger("moe")
    root.handlers.clear()
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(logging.INFO)
    root.propagate = False
    # Python warnings (DeprecationWarning, FutureWarning, ...) go to the rank's log as well as
    # its console, so that a rank's log holds everything it reported.
    logging.captureWarnings(True)
    warnings_log = logging.getLogger("py.warnings")
    warnings_log.handlers.clear()
    warnings_log.addHandler(logging.StreamHandler(sys.stderr))
    for h in handlers:
        if isinstance(h, logging.FileHandler):
            warnings_log.addHandler(h)
    warnings_log.propagate = False


STORAGE_ERRNOS = tuple(STORAGE_CAUSES)


def storage_problem(e: OSError, what: str = "", where: object = None) -> str:
    """``e`` (an errno of STORAGE_ERRNOS) as one line: the path (``where`` when the error names
    none: a buffered write's), what failed, why."""
    path = next((p for p in (e.filename, where) if p is not None), "a file")
    return f"{path}: could not write{' ' + what if what else ''}: {STORAGE_CAUSES[e.errno]}"


class Terminated(BaseException):
    """SIGTERM to a command outside the ranks' training, raised in its main thread (as Ctrl-C's
    KeyboardInterrupt is) so that what it runs cleans up on the way out: a preparation's worker
    pools are stopped and its staging removed, with no worker left to print a broken pipe."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def terminated_cleanly() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the block (a handler of its own inside it, such as
    moe-launch's for the ranks, takes precedence while installed)."""

    def on_term(signum, frame):
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stops_cleanly(prog: str):
    """Wrap an entry point that writes files: Ctrl-C or SIGTERM stops it with one line
    (``PROG: interrupted (Ctrl-C)``, ``PROG: stopped by SIGTERM``) and exit code 130 or 143,
    after what it runs has cleaned up on the way out (a staging directory removed, worker pools
    stopped). The signal is recorded as it arrives: a library that calls back into Python
    (safetensors' writer) may turn the exception raised there into an error of its own. A
    signal already ignored (nohup, a background job) stays ignored."""

    def wrap(main):
        @functools.wraps(main)
        def wrapper(argv=None):
            received: list[int] = []

            def on_signal(signum, frame):
                received.append(signum)
                raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

            handled = [
                s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) != signal.SIG_IGN
            ]
            previous = {s: signal.signal(s, on_signal) for s in handled}
            try:
                return main(argv)
            except BaseException as e:
                signum = received[0] if received else _signal_of(e)
                if signum is None:
                    raise
                why = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "stopped by SIGTERM"
                print(f"{prog}: {why}", file=sys.stderr, flush=True)
                raise SystemExit(128 + signum) from None
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        return wrapper

    return wrap


def _signal_of(e: BaseException) -> int | None:
    """The signal behind ``e``: Ctrl-C's KeyboardInterrupt (raised by Python's own handler where
    SIGINT was not ours to handle), :class:`Terminated`; None for anything else."""
    if isinstance(e, KeyboardInterrupt):
        return signal.SIGINT
    return e.signum if isinstance(e, Terminated) else None


def exits_cleanly(main):
    """Wrap an entry point: a user-facing error prints one clear message and exits 2."""

    @functools.wraps(main)
    def wrapper(argv=None):
        try:
            return main(argv)
        except (MoEError, DataError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except BrokenPipeError:
            # The reader went away (``moe-launch ... | head``): stop quietly. Python would flush
            # stdout again at exit and fail the same way, so point it at /dev/null first.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except OSError as e:
            if e.errno in STORAGE_ERRNOS:
                # A full, read-only or over-quota disk, or no permission: the path and the cause.
                print(f"error: {storage_problem(e)}", file=sys.stderr)
            elif e.filename is not None:  # a path that does not exist, is a directory, ...
                print(f"error: {e.filename}: {e.strerror or e}", file=sys.stderr)
            else:
                raise
            sys.exit(2)

    return wrapper
