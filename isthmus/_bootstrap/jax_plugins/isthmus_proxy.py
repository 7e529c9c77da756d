"""Registers jax's `proxy` backend (the IFRT proxy client) when JAX_PLATFORMS asks for it.

jax imports every module of the `jax_plugins` namespace package (and every `jax_plugins`
entry point) before it creates backends, and calls its `initialize()`. isthmus installs this
module as such an entry point, and `isthmus run` also puts its folder on the child's
PYTHONPATH, so that a script that only does `import jax` reaches the server named by
JAX_BACKEND_TARGET. It imports nothing from isthmus, so it works in any Python with jax: the
one jax internal it reads comes from isthmus/compat/jax.py, loaded from its file (`_jax_compat`).

This folder has no __init__.py on purpose: `jax_plugins` must stay a namespace package, or
it would hide other plugins (CUDA, TPU) installed beside it.

The stock client's batcher thread (the one that sends batched array destructions) wakes every
50 µs for as long as the client lives: on a 2-core machine an idle client took a fifth of a
core, and a busy one's share came off the server's. Threads inherit their timer slack from
the thread that creates them, so the client is created with a timer slack of
ISTHMUS_CLIENT_TIMER_SLACK_US (default 1000; 0 leaves it alone) on the creating thread, which
gets its own back at once: the client's own threads may wake up to that much later from a
timed sleep (a batched destruction goes out up to 1 ms later; every request still sends the
batch before it); nothing woken by an event waits longer, and the user's threads keep theirs.

The client is kept alive at interpreter exit (ISTHMUS_CLIENT_KEEP_AT_EXIT=0 destroys it, as
jax does). Its destructor cancels its session with destructions still unanswered, and the
session's last reference can then be dropped on a thread of the session's own work queue,
which the session's destructor frees while that thread still runs: jaxlib 0.10.2 aborted at
exit ("Mutex corrupt" after "Failed to destroy LoadedExecutable") once in some hundreds of
runs, and more often on a loaded machine. At exit nothing is left to destroy on the server's
side that its end of the session does not free; the process's exit closes the connection.
"""

import contextlib
import importlib.util
import os
import sys
from types import ModuleType

SLACK_ENV = "ISTHMUS_CLIENT_TIMER_SLACK_US"
KEEP_ENV = "ISTHMUS_CLIENT_KEEP_AT_EXIT"  # 0: the client is destroyed at exit (module doc)
_made: list = []  # weak references to the clients made through `get_client`
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30  # prctl(2), Linux


def initialize() -> None:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if "proxy" not in [p.strip() for p in platforms.split(",")]:
        return
    _wrap_get_client()
    try:  # jax itself (0.12 on) or pathwaysutils.initialize registered it: leave theirs
        if "proxy" in _jax_compat().registered_backends():
            return
    except (ImportError, OSError):  # this jax lacks the internal, or the file is not there
        pass
    register()


def _jax_compat() -> ModuleType:
    """isthmus/compat/jax.py, where isthmus reaches jax's internals: loaded from its file,
    two folders up, unless isthmus imported it already. This module must work where isthmus
    is not importable (a Python that only has this folder on its path); that one imports
    nothing of isthmus, and no jax, when loaded."""
    module = sys.modules.get("isthmus.compat.jax")
    if module is None:
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.path.join(here, os.pardir, os.pardir, "compat", "jax.py")
        spec = importlib.util.spec_from_file_location("_isthmus_jax_compat", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def register() -> None:
    """Registers the `proxy` backend factory, reading the target when jax creates it."""
    import jax
    from jax.extend import backend
    from jax.extend.backend import ifrt_proxy

    _wrap_get_client()

    def make_client():
        target = jax.config.read("jax_backend_target") or os.environ.get(
            "JAX_BACKEND_TARGET", "")
        if not target:
            raise RuntimeError(
                "JAX_PLATFORMS includes 'proxy' but no server is named: set "
                "JAX_BACKEND_TARGET=grpc://HOST:PORT (isthmus up prints it).")
        return ifrt_proxy.get_client(target, ifrt_proxy.ClientConnectionOptions())

    backend.register_backend_factory("proxy", make_client, priority=-1)


def _connection_timeout() -> int | None:
    """ISTHMUS_CONNECT_TIMEOUT (or pathwaysutils' PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS) in
    whole seconds; None when neither is set or it does not parse."""
    timeout = os.environ.get("ISTHMUS_CONNECT_TIMEOUT") or os.environ.get(
        "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS")
    try:
        return max(1, int(float(timeout))) if timeout else None
    except ValueError:
        return None


def _wrap_get_client() -> None:
    """Wraps jax's `ifrt_proxy.get_client`, which every proxy factory calls (ours, jax's own
    since 0.12, pathwaysutils'), so that whoever registered the backend: the connection
    timeout of the environment applies when the caller left the default (jax's own factory
    passes default options, and the client then retries a refused connection for minutes),
    and the client's threads are created with the timer slack of SLACK_ENV (module
    docstring)."""
    try:
        from jax.extend.backend import ifrt_proxy
    except ImportError:
        return
    original = ifrt_proxy.get_client
    if getattr(original, "isthmus_wrapped", False):
        return
    slack = _timer_slack()

    def get_client(target, options=None, *args, **kwargs):
        if options is None:
            options = ifrt_proxy.ClientConnectionOptions()
        timeout = _connection_timeout()
        if timeout is not None:
            with contextlib.suppress(AttributeError, TypeError):
                options.connection_timeout_in_seconds = timeout
        if slack is None:
            return _kept_at_exit(original(target, options, *args, **kwargs))
        before = slack(_PR_GET_TIMERSLACK)
        slack(_PR_SET_TIMERSLACK, _slack_micros() * 1000)
        try:
            return _kept_at_exit(original(target, options, *args, **kwargs))
        finally:  # 0 restores the thread's default
            slack(_PR_SET_TIMERSLACK, max(before, 0))

    get_client.isthmus_wrapped = True  # type: ignore[attr-defined]
    ifrt_proxy.get_client = get_client


def _kept_at_exit(client):
    """Notes `client`, so that it outlives the interpreter's exit (module docstring); the
    first one registers the hook, after jax's own: hooks run last first, so it runs before
    jax's clean-up drops its clients."""
    if os.environ.get(KEEP_ENV, "1").strip() in ("0", ""):
        return client
    import weakref

    try:
        reference = weakref.ref(client)
    except TypeError:
        return client
    if not _made:
        import atexit

        atexit.register(_keep_clients)
    _made.append(reference)
    return client


def _keep_clients() -> None:
    """At exit: one more reference to each client still alive, which nothing drops."""
    try:
        import jax

        if jax.config.read("jax_debug_leaked_clients_on_clear_backends"):
            return  # jax then checks that its clients go, and exits -1 if one stays
    except Exception:  # noqa: BLE001 - a jax without that option
        pass
    import ctypes

    for reference in _made:
        client = reference()
        if client is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))


def _slack_micros() -> int:
    try:
        return int(float(os.environ.get(SLACK_ENV) or 1000))
    except ValueError:
        return 1000


def _timer_slack():
    """prctl's timer slack as `slack(option, value=0)`, or None where it is off or absent."""
    if _slack_micros() <= 0 or not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None
    prctl.restype = ctypes.c_int

    def timer_slack(option: int, value: int = 0) -> int:
        return prctl(option, *(ctypes.c_ulong(v) for v in (value, 0, 0, 0)))
    return timer_slack
