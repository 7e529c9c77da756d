"""What a machine charges for the operations a server's Python is made of, with no isthmus and
no jax: microseconds per operation, best of three, one JSON line.

    python bench/platform_costs.py [LABEL]

- `loop`: one addition in a Python loop (the interpreter's own pace);
- `alloc`, `small`: making and dropping small objects (tuples, lists, dicts; slotted records);
- `monotonic`: `time.monotonic()`;
- `stat`, `mmap_1mib`: a cheap system call (`os.stat`), and mapping, touching and unmapping a
  MiB (what an allocator's arena costs);
- `loop_iteration`: one turn of an asyncio event loop that has a callback ready (the loop
  polls its selector with a zero timeout first: a system call every turn);
- `thread_pingpong`, `socket_pingpong`: a message to another thread and back (a queue), and
  to another process and back (a Unix socket pair);
- `gc_200k`: a full collection with 200,000 young objects.

On a sandboxed kernel (the TPU v5e machine runs under gVisor) the system calls cost several
times what they cost on an ordinary one while the interpreter runs at nearly the same pace
(bench/RESULTS.md, "Issue 49, eleventh round"): what a server spends per request there
depends on how many loop turns and system calls a request takes, not only on its Python.
"""

from __future__ import annotations

import asyncio
import gc
import json
import mmap
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable


def best(fn: Callable[[int], None], n: int) -> float:
    """Microseconds per operation, the best of three runs of `fn(n)`."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn(n)
        times.append(time.perf_counter() - start)
    return round(min(times) / n * 1e6, 4)


def loop(n: int) -> None:
    total = 0
    for i in range(n):
        total += i


def alloc(n: int) -> None:
    for _ in range(n // 20_000):
        kept = [(i, [i], {"k": i}) for i in range(20_000)]
        del kept


class _Record:
    __slots__ = ("a", "b", "c")

    def __init__(self, a: int, b: tuple[int, int], c: str) -> None:
        self.a, self.b, self.c = a, b, c


def small(n: int) -> None:
    kept: dict[int, _Record] = {}
    for i in range(n):
        kept[i & 1023] = _Record(i, (i, i), str(i))


def monotonic(n: int) -> None:
    now = time.monotonic
    for _ in range(n):
        now()


def stat(n: int) -> None:
    for _ in range(n):
        os.stat(".")


def mmap_1mib(n: int) -> None:
    for _ in range(n):
        mapped = mmap.mmap(-1, 1 << 20)
        mapped[0] = 1
        mapped.close()


def loop_iteration(n: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        left = [n]

        def turn() -> None:
            left[0] -= 1
            if left[0]:
                loop.call_soon(turn)
            else:
                done.set_result(None)

        loop.call_soon(turn)
        await done

    asyncio.run(main())


def thread_pingpong(n: int) -> None:
    there: queue.SimpleQueue[int] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        for _ in range(n):
            back.put(there.get())

    thread = threading.Thread(target=echo)
    thread.start()
    for i in range(n):
        there.put(i)
        back.get()
    thread.join()


def socket_pingpong(n: int) -> None:
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        mine.close()
        for _ in range(n):
            theirs.sendall(theirs.recv(64))
        os._exit(0)
    theirs.close()
    for _ in range(n):
        mine.sendall(b"p" * 32)
        mine.recv(64)
    os.waitpid(pid, 0)
    mine.close()


def gc_200k(n: int) -> None:
    young = [[i] for i in range(200_000)]
    for _ in range(n):
        gc.collect()
    del young


def main() -> None:
    print(json.dumps({
        "label": sys.argv[1] if len(sys.argv) > 1 else "",
        "loop": best(loop, 5_000_000), "alloc": best(alloc, 400_000),
        "small": best(small, 400_000), "monotonic": best(monotonic, 500_000),
        "stat": best(stat, 20_000), "mmap_1mib": best(mmap_1mib, 2_000),
        "loop_iteration": best(loop_iteration, 200_000),
        "thread_pingpong": best(thread_pingpong, 5_000),
        "socket_pingpong": best(socket_pingpong, 5_000), "gc_200k": best(gc_200k, 5)}))


if __name__ == "__main__":
    main()
