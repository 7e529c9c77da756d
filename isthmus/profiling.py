"""Profiles of a process (a worker's, or the controller's own): jax's profiler, its trace
written where XProf looks for it. The worker's profile commands reach it through
`worker/profiler.py`, the controller's sessions through `controller/session_profiles.py`.

A profile run is a directory `LOCATION/plugins/profile/RUN/` with one `HOST.xplane.pb` (a
serialized `XSpace`) per host; TensorBoard's profile plugin and xprof list the hosts of a
run by those file names. Each worker writes its own file there, named by its machine and
place in the fleet (`host_name`), and the controller one for itself; the bytes go through
fsspec, so LOCATION is a local directory or any URL with an installed backend (gs:// needs
gcsfs: `pip install isthmus[gcs]`).

jaxlib's `ProfilerSession` (jax's `start_trace` without its export) is the one use of jax's
internals here (`_session`).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading

from isthmus import errors
from isthmus.compat import jax as jax_compat
from isthmus.compat.jaxlib_types import ProfilerSession
from isthmus.transport.records import TraceOptions

logger = logging.getLogger(__name__)

SUFFIX = ".xplane.pb"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def _session(options: TraceOptions) -> ProfilerSession:
    """A started jaxlib profiler session (`jax_compat.profiler_extension`)."""
    _profiler = jax_compat.profiler_extension()
    profile_options = _profiler.ProfileOptions()
    profile_options.host_tracer_level = options.host_tracer_level
    profile_options.python_tracer_level = options.python_tracer_level
    profile_options.advanced_configuration = dict(options.advanced)
    return _profiler.ProfilerSession(profile_options)


class ProcessProfiler:
    """jax's profiler in this process, for one trace at a time.

    Invariant: jaxlib allows one profiler session per process, so a process has one of these
    (`PROCESS`). An embedded backend's controller and its in-process host share it: the
    trace one of them started is the other's too (`start` answers False)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trace: str | None = None  # the trace being recorded, if any
        self._session: ProfilerSession | None = None

    def start(self, trace: str, options: TraceOptions) -> bool:
        """Starts recording for `trace`; False when this process already records it."""
        with self._lock:
            if self._trace == trace:
                return False
            if self._session is not None:
                # Its controller never stopped it (it went away): its records are dropped.
                logger.warning("dropping profile %s, never stopped, for profile %s",
                               self._trace, trace)
                _stop_quietly(self._session)
            self._session, self._trace = None, None
            try:
                self._session = _session(options)
            except Exception as e:  # noqa: BLE001 - jaxlib raises its own runtime errors
                raise errors.InvalidRequest(
                    f"jax's profiler did not start ({e}); check the profile options (host and "
                    "Python tracer levels, advanced configuration).") from None
            self._trace = trace
            return True

    def stop(self, trace: str) -> bytes | None:
        """Stops recording for `trace`: its XSpace, or None when this process does not
        record it. Blocks while jaxlib gathers the records (run it in a thread)."""
        with self._lock:
            if self._trace != trace:
                return None
            session, self._session, self._trace = self._session, None, None
        try:
            return session.stop()
        except Exception as e:  # noqa: BLE001
            raise errors.InternalError(f"jax's profiler failed to stop ({e}); another "
                                       "profiler in this process may hold it.") from None


def _stop_quietly(session: ProfilerSession) -> None:
    try:
        session.stop()
    except Exception:  # noqa: BLE001 - dropping it anyway
        pass


PROCESS = ProcessProfiler()


def host_name(label: str) -> str:
    """This host's file name in a profile run: its machine's name and `label` (its place in
    the fleet), so that hosts sharing a machine stay apart."""
    machine = _UNSAFE.sub("_", socket.gethostname().split(".")[0]) or "host"
    return f"{machine}-{label}"


def write_trace(data: bytes, directory: str, name: str) -> str:
    """Writes an XSpace as `directory/name.xplane.pb` (fsspec); returns the path."""
    import fsspec

    path = f"{directory.rstrip('/')}/{name}{SUFFIX}"
    try:
        fs, target = fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:
        raise errors.InvalidRequest(f"cannot write the profile to {path!r}: {e} (install the "
                                    "fsspec backend for that URL: gcsfs for gs://)") from None
    except Exception as e:  # noqa: BLE001 - a backend that connects at once (ftp://) fails
        #   in its own ways (EOFError, socket errors): the location is what is wrong
        raise errors.InvalidRequest(
            f"cannot write the profile to {path!r} ({type(e).__name__}: {e}); pick a "
            "location every host can write to.") from None
    try:
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if protocol in ("file", "local"):
            fs.makedirs(os.path.dirname(target), exist_ok=True)
            temporary = f"{target}.{secrets.token_hex(4)}.tmp"
            with fs.open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, target)  # a reader never sees half a file
        else:
            with fs.open(target, "wb") as f:
                f.write(data)
    except (OSError, EOFError) as e:  # EOFError: a remote backend's connection closed
        raise errors.InvalidRequest(f"cannot write the profile to {path!r} ("
                                    f"{type(e).__name__}: {e}); pick a location every host "
                                    "can write to.") from None
    return path


def stop_and_write(trace: str, directory: str, name: str) -> str | None:
    """Stops `trace` here and writes it (`directory` "": drops it); the path written, or
    None when this process did not record it."""
    data = PROCESS.stop(trace)
    if data is None or not directory:
        return None
    return write_trace(data, directory, name)
