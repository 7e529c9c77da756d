"""A shared service's workers run confined: tenants' code in them reads no secret.

A worker that a shared service launches (`isthmus up --tenants`) may run a tenant's colocated
Python. Before it imports jax or starts a thread, it confines itself with Landlock (the Linux
security module, through the maintained `landlockpy` binding): from then on the process, and
every thread and child it makes, may

- read and execute Python's installation, the system's libraries and the few files of /etc
  that libraries read (the dynamic linker's cache, time zones, CA certificates, name
  resolution), its own /proc entries, /sys, and the devices it computes on;
- read and write its own temporary directory, the compile cache, the launcher's log
  directory (its crash record), and the tenants' local storage roots (checkpoints, traces);

and nothing else: not the tenants file, tenants' token files, TLS keys, the controller's
/proc (command line, environment, memory), the fleet's shared directory (other leases' large
transfers between workers of one machine pass through it: a confined worker pulls from its
peers instead), other tenants' files elsewhere. Signals and
abstract Unix sockets outside the sandbox are out of reach too (Landlock scopes, where the
kernel has them). Network access is not confined (a worker talks to the controller and to its
peers on ports it cannot know ahead); the fleet credential it holds is single-use and used
up, and its peers serve it only the buffers the controller signed for it (`transport/auth.py`).

Where the kernel has no Landlock, `confine` says why, and the service refuses colocated Python
to every tenant (`Controller.sandboxed`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import sys
import sysconfig
import tempfile

logger = logging.getLogger(__name__)

ENVIRONMENT = "ISTHMUS_WORKER_SANDBOX"  # JSON of `Sandbox`, set by the launcher
# Files and directories of /etc that libraries read (none holds a secret).
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "ssl",
       "ca-certificates", "pki", "nsswitch.conf", "hosts", "host.conf", "resolv.conf",
       "gai.conf", "passwd", "group", "os-release", "mime.types", "protocols", "services",
       "machine-id", "alternatives")
SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/opt", "/sys",
          "/usr/share/zoneinfo")
PROC = ("/proc/self", "/proc/thread-self", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat",
        "/proc/loadavg", "/proc/sys/kernel", "/proc/sys/vm")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom", "/dev/full", "/dev/tty",
           "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/dri")


@dataclasses.dataclass(frozen=True, slots=True)
class Sandbox:
    """What a confined worker may write (it may read those too)."""

    writable: tuple[str, ...] = ()  # directories and files, absolute
    readable: tuple[str, ...] = ()  # more it may read (beyond Python and the system)

    def encode(self) -> str:
        return json.dumps({"writable": list(self.writable), "readable": list(self.readable)})

    @classmethod
    def decode(cls, text: str) -> Sandbox:
        data = json.loads(text)
        return cls(tuple(map(str, data.get("writable", ()))),
                   tuple(map(str, data.get("readable", ()))))


def unavailable() -> str | None:
    """Why this machine cannot confine a worker, or None when it can."""
    try:
        import landlockpy
    except ImportError:
        return "the landlockpy package is not installed (pip install landlockpy)"
    try:
        version = landlockpy.abi_version()
    except OSError as e:  # LandlockError is an OSError
        return f"Landlock does not answer on this kernel ({e})"
    if version < 1:
        return ("this kernel has no Landlock (Linux 5.13 or later with Landlock enabled in "
                "its LSM list)")
    return None


def python_paths() -> list[str]:
    """Where this interpreter, its standard library, its packages and isthmus live (not the
    working directory, nor a source tree on sys.path beyond isthmus's own package)."""
    import isthmus

    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = prefixes | set(sysconfig.get_paths().values()) | {
        os.path.dirname(os.path.realpath(sys.executable)),
        os.path.dirname(os.path.abspath(isthmus.__file__))}
    for entry in sys.path:
        real = os.path.abspath(entry) if entry else ""
        if real and (real.endswith(("site-packages", "dist-packages", ".zip", ".egg"))
                     or any(real.startswith(p + os.sep) for p in prefixes)):
            paths.add(real)
    return sorted(p for p in paths if os.path.exists(p))


def confine(sandbox: Sandbox) -> None:
    """Confines this process for good (call before any thread starts), with a temporary
    directory of its own ($TMPDIR); raises OSError (or ImportError) when the kernel or the
    binding cannot."""
    from landlockpy import AccessFS, AccessNet, RestrictFlag, Ruleset, Scope, fs_for_abi

    read = AccessFS.READ_FILE | AccessFS.READ_DIR | AccessFS.EXECUTE
    scratch = tempfile.mkdtemp(prefix="isthmus-worker-")
    os.environ["TMPDIR"] = tempfile.tempdir = scratch
    with Ruleset(handled_net=AccessNet.NONE,
                 scoped=Scope.ABSTRACT_UNIX_SOCKET | Scope.SIGNAL) as rules:
        everything = fs_for_abi(rules.abi_version)

        def allow(path: str, access: AccessFS) -> None:
            if os.path.exists(path):
                if not os.path.isdir(path):  # rights that apply to a file only
                    access &= (AccessFS.READ_FILE | AccessFS.WRITE_FILE | AccessFS.EXECUTE
                               | AccessFS.TRUNCATE | AccessFS.IOCTL_DEV)
                rules.allow_path(path, access)

        for path in (*SYSTEM, *python_paths(), *(f"/etc/{name}" for name in ETC), *PROC,
                     *sandbox.readable):
            allow(path, read)
        for path in (*DEVICES, *glob.glob("/dev/nvidia[0-9]*"), scratch,
                     *sandbox.writable):
            allow(path, everything)
        rules.restrict(RestrictFlag.TSYNC)
    logger.info("confined with Landlock (ABI %d): writes %s", rules.abi_version,
                ", ".join(sandbox.writable) or "nothing")
