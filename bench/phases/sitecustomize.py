"""Where the main thread of an isthmus server or worker spends its time, per phase (issue 49).

Not imported by isthmus. Put this folder first on PYTHONPATH and name a folder in
ISTHMUS_PHASES: every Python that starts then (the server of `isthmus run`, its workers, not
the client, whose JAX_PLATFORMS names the proxy) times its main thread's calls of a few
functions on the hot path (the client connection's reads, the front end's handling and
Execute, the dispatch, the embedded host's commands and runs, the ledger's new groups, the
worker's applying and decoding, frees, readiness), as they are imported, and writes
`ROLE-PID.json` there every ISTHMUS_PHASES_EVERY seconds (1): per function its count, total
and largest time, and a histogram (below 100, 200, 400, 800, 1600, 3200 us, and above).
Also:

- ISTHMUS_PHASES_SERIES=1: each of those snapshots appended to `ROLE-PID.jsonl`, with the
  wall clock, so that a client's timestamps can pick a window out (bench/phases/report.py);
- ISTHMUS_PHASES_EVENTS=1: every timed call as (time, name, microseconds) in
  `ROLE-PID.events.json` (the event loop's waits only when above 2 ms), and garbage
  collections as `gcN`;
- ISTHMUS_PHASES_SAMPLE=1 (with EVENTS): the main thread's stack every 4 ms, from a thread
  (when the process's Python is held up, the samples stop too);
- ISTHMUS_PHASES_REQUESTS=1 (with EVENTS): each client request as it is handled
  (`req:KIND`; a host buffer's lookup, `req:host_buffer_lookup`), each response as the
  session sends it (`sent:KIND`) and each write of the client connection's frames
  (`flush`), for `report.py DIR --requests`: where a round trip
  goes between the server and the client.

    PYTHONPATH=bench/phases:$PYTHONPATH ISTHMUS_PHASES=/tmp/ph isthmus run ... -- python X.py
    python bench/phases/report.py /tmp/ph

Wrapping adds about 1 us per call. The machine's own sitecustomize, if any, still runs.
"""

import os
import sys

_DIR = os.environ.get("ISTHMUS_PHASES")
if _DIR and "proxy" not in os.environ.get("JAX_PLATFORMS", ""):
    import gc
    import importlib.abc
    import importlib.machinery
    import json
    import threading
    import time

    os.makedirs(_DIR, exist_ok=True)
    _pc = time.perf_counter
    _MAIN = threading.main_thread().ident
    _EDGES = (100, 200, 400, 800, 1600, 3200)
    _EVENTS = bool(os.environ.get("ISTHMUS_PHASES_EVENTS"))
    _TIMES: dict = {}  # name -> [count, seconds, largest]
    _HIST: dict = {}  # name -> counts per bucket of _EDGES
    _LOG: list = []  # (time, name, us or stack) with ISTHMUS_PHASES_EVENTS
    _ROLE = ("worker" if "worker" in sys.argv else
             "vetting" if "vetting" in " ".join(sys.orig_argv) else "server")

    def _add(name, seconds):
        if _EVENTS and (name != "select" or seconds > 0.002) and len(_LOG) < 400_000:
            _LOG.append((round(time.time(), 6), name, round(seconds * 1e6)))
        entry = _TIMES.setdefault(name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] = max(entry[2], seconds)
        us, bucket = seconds * 1e6, 0
        while bucket < len(_EDGES) and us >= _EDGES[bucket]:
            bucket += 1
        _HIST.setdefault(name, [0] * (len(_EDGES) + 1))[bucket] += 1

    def _timed(name, fn):
        def wrapper(*args, **kwargs):
            if threading.get_ident() != _MAIN:
                return fn(*args, **kwargs)
            start = _pc()
            try:
                return fn(*args, **kwargs)
            finally:
                _add(name, _pc() - start)
        return wrapper

    def _atimed(name, fn):
        async def wrapper(*args, **kwargs):
            start = _pc()
            try:
                return await fn(*args, **kwargs)
            finally:
                _add(name, _pc() - start)
        return wrapper

    _gc_start: dict = {}  # thread -> when its collection began

    def _gc(phase, info):
        """A collection holds the GIL wherever it runs: those of other threads count too,
        named `gcN@thread`."""
        ident = threading.get_ident()
        if phase == "start":
            _gc_start[ident] = _pc()
        elif ident in _gc_start:
            name = f"gc{info.get('generation')}"
            if ident != _MAIN:
                name += f"@{threading.current_thread().name}"
            _add(name, _pc() - _gc_start.pop(ident))

    gc.callbacks.append(_gc)

    def _write():
        path = os.path.join(_DIR, f"{_ROLE}-{os.getpid()}")
        began = _pc()
        every = float(os.environ.get("ISTHMUS_PHASES_EVERY", "1"))
        while True:
            time.sleep(every)
            try:
                main_cpu = time.clock_gettime(time.pthread_getcpuclockid(_MAIN))
            except (AttributeError, OSError):
                main_cpu = -1.0
            snapshot = {"role": _ROLE, "t": time.time(), "wall": _pc() - began,
                        "main_cpu": main_cpu, "proc_cpu": time.process_time(),
                        "times": _TIMES, "hist": _HIST}
            with open(path + ".tmp", "w") as f:
                json.dump(snapshot, f)
            os.replace(path + ".tmp", path + ".json")
            if os.environ.get("ISTHMUS_PHASES_SERIES"):
                with open(path + ".jsonl", "a") as f:
                    f.write(json.dumps(snapshot) + "\n")
            if _EVENTS:  # whole or not at all: the process may end in the middle
                with open(path + ".events.tmp", "w") as f:
                    json.dump(_LOG, f)
                os.replace(path + ".events.tmp", path + ".events.json")

    def _sample():
        while True:
            time.sleep(0.004)
            frame, parts = sys._current_frames().get(_MAIN), []
            while frame is not None and len(parts) < 6:
                code = frame.f_code
                parts.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:"
                             f"{code.co_name}")
                frame = frame.f_back
            if len(_LOG) < 400_000:
                _LOG.append((round(time.time(), 6), "stack", " < ".join(parts)))

    threading.Thread(target=_write, daemon=True, name="phases").start()
    if _EVENTS and os.environ.get("ISTHMUS_PHASES_SAMPLE"):
        threading.Thread(target=_sample, daemon=True, name="phases-sampler").start()

    def _patch(name, module):
        if name == "selectors":
            module.EpollSelector.select = _timed("select", module.EpollSelector.select)
        elif name == "isthmus.worker.runs":
            module.run_one = _timed("run_one", module.run_one)
            module.run_sharded = _timed("run_sharded", module.run_sharded)
        elif name == "isthmus.worker.buffers":
            store = module.BufferStore
            for method in ("values", "store_all", "free"):
                setattr(store, method, _timed(method, getattr(store, method)))
        elif name == "isthmus.transport.messages":
            module.decode = _timed("decode", module.decode)
        elif name == "isthmus.transport.frames":
            stream = module.FrameStream
            stream.buffer_updated = _timed("buffer_updated", stream.buffer_updated)
        elif name == "isthmus.worker.reads":
            reads = module.Reads
            reads.ready = _timed("reads_ready_call", reads.ready)
            reads._wait_ready = _atimed("reads_wait_ready", reads._wait_ready)
        elif name == "isthmus.worker.applying":
            applier = module.CommandApplier
            applier.apply_now = _timed("apply_now", applier.apply_now)
        elif name == "isthmus.frontend.execute":
            module.execute = _timed("fe_execute", module.execute)
        elif name == "isthmus.frontend.futures":
            module.check_value_ready = _timed("fe_check_value_ready", module.check_value_ready)
        elif name == "isthmus.frontend.session":
            session = module.FrontendSession
            session.bind_array = _timed("bind_array", session.bind_array)
            session.handle = _timed("fe_handle", session.handle)
            if not _REQUESTS:
                return
            handle, init = session.handle, session.__init__

            def handled(self, request):
                _LOG.append((round(time.time(), 6), "req:" + str(request.WhichOneof("request")),
                             0))
                return handle(self, request)

            def made(self, *args, **kwargs):
                init(self, *args, **kwargs)
                send = self._send

                def sent(response):
                    _LOG.append((round(time.time(), 6),
                                 "sent:" + str(response.WhichOneof("response")), 0))
                    return send(response)
                self._send = sent
            session.handle, session.__init__ = handled, made
        elif name == "isthmus.wire.h2frames":
            module.Wire.buffer_updated = _timed("h2_read", module.Wire.buffer_updated)
        elif name == "isthmus.controller.dispatch":
            dispatcher = module.OrderedDispatcher
            dispatcher.submit = _timed("submit", dispatcher.submit)
        elif name == "isthmus.worker.inline":
            module.InlineOrder._apply = _timed("inline_apply", module.InlineOrder._apply)
        elif name == "isthmus.controller.ledger":
            module.Ledger.new_group = _timed("new_group", module.Ledger.new_group)
        elif name == "isthmus.wire.servicer" and _REQUESTS:
            servicer = module.IfrtProxyServicer
            lookup = servicer.lookup_now

            def looked_up(self, request, context):
                _LOG.append((round(time.time(), 6), "req:host_buffer_lookup", 0))
                return lookup(self, request, context)
            servicer.lookup_now = looked_up
        elif name == "isthmus.wire.h2connection" and _REQUESTS:
            connection = module.Connection
            flush = connection.flush

            def flushed(self):
                _LOG.append((round(time.time(), 6), "flush", 0))
                return flush(self)
            connection.flush = flushed

    _REQUESTS = _EVENTS and bool(os.environ.get("ISTHMUS_PHASES_REQUESTS"))
    _WATCHED = {"isthmus.worker.runs", "isthmus.worker.buffers", "isthmus.transport.messages",
                "isthmus.transport.frames", "isthmus.worker.reads", "isthmus.worker.applying",
                "isthmus.frontend.execute", "isthmus.frontend.futures",
                "isthmus.frontend.session", "isthmus.wire.h2connection",
                "isthmus.wire.servicer", "isthmus.wire.h2frames", "isthmus.controller.dispatch",
                "isthmus.worker.inline", "isthmus.controller.ledger"}

    import selectors

    _patch("selectors", selectors)

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            _patch(self.name, module)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in _WATCHED:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, name)
            return spec

    sys.meta_path.insert(0, _Finder())


def _next_sitecustomize():
    """Runs the next sitecustomize on the path (the machine's own), as Python would have."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != here and os.path.exists(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_next_sitecustomize()
