"""Process-level care of a worker: imports before registering, dying with a parent, and
stop signals that work while the event loop sits inside jaxlib."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from typing import Any


def preload() -> None:
    import jax  # noqa: F401
    import jax._src.interpreters.mlir  # noqa: F401 - reading program signatures
    from jax._src.lax import linalg  # noqa: F401
    from jaxlib.mlir.dialects import stablehlo  # noqa: F401


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
    are then taken by `run_worker`'s signal thread, so they work even while the event loop
    sits inside jaxlib."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


async def run_worker(config: Any) -> int:
    """Runs a worker (`WorkerConfig`) until it stops; stop signals end it gracefully."""
    from isthmus.worker.agent import WorkerAgent

    agent = WorkerAgent(config)
    agent._loop = asyncio.get_running_loop()
    if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set()):
        def wait_for_signal() -> None:
            received = signal.sigwait(STOP_SIGNALS)
            agent.stop_soon(f"received {signal.Signals(received).name}")

        threading.Thread(target=wait_for_signal, name="isthmus-signals", daemon=True).start()
    else:
        for sig in STOP_SIGNALS:
            agent._loop.add_signal_handler(sig, agent.stop)
    return await agent.run()
