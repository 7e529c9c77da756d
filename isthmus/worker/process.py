"""Process-level care of a worker: imports before registering, dying with a parent, and
stop signals that work while the event loop sits inside jaxlib."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable

from isthmus.compat import jax as jax_compat


def preload() -> None:
    import jax  # noqa: F401
    from jaxlib.mlir.dialects import stablehlo  # noqa: F401

    jax_compat.preload()  # reading program signatures, LAPACK
    from isthmus.worker.programs import warm_up

    warm_up()  # MLIR's first use, before the first program waits for it


def exit_with_parent() -> None:
    """Dies with the parent process (Linux): a local fleet leaves no orphans."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def exit_now(code: int) -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def block_stop_signals() -> None:
    """Call first thing in the worker process, before any thread starts: SIGINT and SIGTERM
    are then taken by `watch_stop_signals`' thread, so they work even while the event loop
    sits inside jaxlib."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def watch_stop_signals(stop_soon: Callable[[str], None], stop: Callable[[], None]) -> None:
    """Routes SIGINT and SIGTERM to a worker: to `stop_soon` from a thread of their own when
    `block_stop_signals` blocked them (so they work while the event loop sits inside jaxlib),
    else to `stop` through the running event loop."""
    if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set()):
        def wait_for_signal() -> None:
            received = signal.sigwait(STOP_SIGNALS)
            stop_soon(f"received {signal.Signals(received).name}")

        threading.Thread(target=wait_for_signal, name="isthmus-signals", daemon=True).start()
    else:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop)
