"""Using a shared isthmus service: lease slices, and run jax on them.

    with isthmus.shared.connect("service.example:8470", slices=2,
                                token_file="~/.isthmus/token", ca="service-cert.pem"):
        import jax
        print(jax.devices())          # the leased slices' devices, and nothing else

`connect` asks the service for a lease and waits in its queue (a line on stderr every few
seconds with the position and the time waited), then points this process's jax at a
*forwarder*: a Unix socket in a private directory whose connections are tunnelled to the
service over TLS with the tenant's token (or over the service's Unix socket when the address
is `unix:PATH`). The stock jax client needs no credentials of its own and never sends one
in clear. Leaving the block (or the process exiting) releases the lease; a client that dies
keeps its lease for the service's grace period, and `connect` with the same `name` gets it
back. `isthmus run --service` does the same for a command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from isthmus.compat import jax as jax_compat
from isthmus.forwarder import Forwarder, ForwarderProcess, LeaseRefused

__all__ = ["Forwarder", "Grant", "LeaseRefused", "connect", "keep", "lease", "take"]

logger = logging.getLogger(__name__)

CA_ENVIRONMENT = "ISTHMUS_SERVICE_CA"
TOKEN_ENVIRONMENT = "ISTHMUS_SERVICE_TOKEN_FILE"
RESUME_SECONDS = 60.0  # how long a client whose lease stream broke tries to come back


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """A granted lease."""

    lease: str  # its id on the service
    slices: tuple[int, ...]  # the service's slices it holds
    target: str  # JAX_BACKEND_TARGET for jax in this process or a child


# ---- the lease -------------------------------------------------------------------------------


class LeaseClient:
    """Asks for a lease through a forwarder's control tunnel and holds it (a thread reads
    its stream) until `release`."""

    def __init__(self, forwarder: Forwarder | ForwarderProcess,
                 report: Callable[[str], None]) -> None:
        import grpc

        self.forwarder = forwarder
        self.report = report
        control = forwarder.listen("control", "control")
        self.channel = grpc.insecure_channel(f"unix:{control}")
        self._lease = self.channel.unary_stream("/isthmus.Shared/Lease")
        self._release = self.channel.unary_unary("/isthmus.Shared/Release")
        self.call: Any = None
        self.grant: Grant | None = None
        self.end_reason: str | None = None  # why the lease ended, once it did
        self._reader: threading.Thread | None = None
        self._released = False

    def acquire(self, slices: int, wait: float | None = None, name: str = "",
                elastic: bool = False) -> Grant:
        """Blocks until granted; `wait`: seconds in the queue at most (0: fail at once when
        nothing is free; None: no limit). Ctrl-C leaves the queue."""
        import grpc

        ask = {"slices": slices, "name": name, "elastic": elastic, "wait": wait != 0}
        self.call = self._lease(json.dumps(ask).encode())
        updates = iter(self.call)
        timer = None  # cancels the request after `wait` seconds
        if wait:
            timer = threading.Timer(wait, self.call.cancel)
            timer.daemon = True
            timer.start()
        try:
            for raw in updates:
                update = json.loads(raw)
                if "queued" in update:
                    q = update["queued"]
                    self.report(f"isthmus: waiting for {slices} slice(s): position "
                                f"{q['position']} in the queue, {q['waited']:.0f} s waited, "
                                f"{q['free']} free")
                elif "granted" in update:
                    g = update["granted"]
                    path = self.forwarder.listen(f"lease/{g['lease']}", "jax")
                    self.grant = Grant(g["lease"], tuple(g["slices"]), f"grpc://unix:{path}")
                    self._reader = threading.Thread(target=self._hold, args=(updates,),
                                                    name="isthmus-lease", daemon=True)
                    self._reader.start()
                    return self.grant
                elif "ended" in update:
                    raise LeaseRefused(update["ended"]["reason"])
            raise LeaseRefused("the service closed the lease stream before a grant.")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and timer is not None:
                raise LeaseRefused(f"no {slices} slice(s) were granted within {wait:g} s; "
                                   "the request left the queue (wait longer with "
                                   "--wait).") from None
            raise LeaseRefused(e.details() or str(e.code())) from None
        except BaseException:  # Ctrl-C while queued: leave the queue
            self.call.cancel()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _hold(self, updates: Iterator[bytes]) -> None:
        """Reads the lease's stream until it ends; when it breaks (the network, or the
        service restarting), comes back to the lease, or says clearly that it is gone."""
        import grpc

        while True:
            try:
                for raw in updates:
                    update = json.loads(raw)
                    if "ended" in update:
                        self.end_reason = update["ended"]["reason"]
                        if not self.end_reason.endswith("released by its client."):
                            self.report(f"isthmus: {self.end_reason}")
                        return
                return
            except grpc.RpcError as e:
                if self._released or e.code() == grpc.StatusCode.CANCELLED:
                    return
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    self.end_reason = e.details() or str(e.code())
                    self.report(f"isthmus: lease {self.grant.lease if self.grant else ''} is "
                                f"gone: {self.end_reason}")
                    return
                broke = e.details() or str(e.code())
            resumed = self._resume(broke)
            if resumed is None:
                return
            updates = resumed

    def _resume(self, broke: str) -> Iterator[bytes] | None:
        """A new stream to the lease, retried while the service is unreachable."""
        import grpc

        assert self.grant is not None
        self.report(f"isthmus: lost the service ({broke}); coming back to lease "
                    f"{self.grant.lease}")
        deadline = time.monotonic() + RESUME_SECONDS
        held = None  # why the service refused: it still counts the broken stream as a holder
        while not self._released and time.monotonic() < deadline:
            time.sleep(0.5)
            self.call = self._lease(json.dumps({"resume": self.grant.lease}).encode())
            updates = iter(self.call)
            try:
                first = json.loads(next(updates))
            except StopIteration:
                continue
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    continue
                if e.code() == grpc.StatusCode.PERMISSION_DENIED:  # until it sees it end
                    held = e.details()
                    continue
                if not self._released:
                    self.end_reason = e.details() or str(e.code())
                    self.report(f"isthmus: lease {self.grant.lease} is gone: {self.end_reason}")
                return None
            if "granted" in first:
                self.report(f"isthmus: back on lease {self.grant.lease}")
                return updates
        if not self._released:
            self.end_reason = held or f"the service was unreachable for {RESUME_SECONDS:g} s"
            self.report(f"isthmus: lease {self.grant.lease} is gone: {self.end_reason}")
        return None

    def release(self) -> None:
        """Ends the lease on the service (its arrays are freed); then the stream closes."""
        self._released = True
        if self.grant is not None and self.end_reason is None:
            with contextlib.suppress(Exception):
                self._release(json.dumps({"lease": self.grant.lease}).encode(), timeout=10)
        if self.call is not None:
            self.call.cancel()
        if self._reader is not None:
            self._reader.join(5)
        self.channel.close()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def read_token_file(path: str | None) -> str:
    from isthmus.controller.tenants import read_token

    path = path or os.environ.get(TOKEN_ENVIRONMENT)
    if not path:
        raise LeaseRefused(f"no token: give token_file= (or --token-file, or "
                           f"${TOKEN_ENVIRONMENT}) with the secret the service's operator "
                           "gave you.")
    try:
        return read_token(os.path.expanduser(path))
    except ValueError as e:
        raise LeaseRefused(str(e)) from None


@contextlib.contextmanager
def lease(service: str, *, slices: int = 1, token_file: str | None = None,
          ca: str | None = None, tenant: str = "", wait: float | None = None, name: str = "",
          elastic: bool = False, report: Callable[[str], None] = _stderr,
          separate_process: bool = False) -> Iterator[Grant]:
    """A lease held for the block (for jax in a child process: `Grant.target`; with
    `separate_process`, the tunnels run in a process of their own, so that jax may run in
    this one). Raises LeaseRefused with the service's one-line reason."""
    from isthmus.controller.leases import name_refusal

    refusal = name_refusal(name)
    if refusal is not None:  # refused here, before a connection
        raise LeaseRefused(refusal)
    token = read_token_file(token_file)
    ca = ca or os.environ.get(CA_ENVIRONMENT) or None
    if service.startswith("grpc://"):
        service = service.removeprefix("grpc://")
    kind = ForwarderProcess if separate_process else Forwarder
    forwarder = kind(service, token, os.path.expanduser(ca) if ca else None, tenant)
    client = None
    try:
        forwarder.check()
        client = LeaseClient(forwarder, report)
        yield client.acquire(slices, wait, name, elastic)
    finally:
        if client is not None:
            client.release()
        forwarder.close()


@contextlib.contextmanager
def connect(service: str, *, slices: int = 1, token_file: str | None = None,
            ca: str | None = None, tenant: str = "", wait: float | None = None,
            name: str = "", elastic: bool = False,
            initialize_pathwaysutils: bool = True) -> Iterator[Grant]:
    """Leases `slices` slices of the shared service at `service` and makes this process's
    jax use them, for the block (the shape of pathwaysutils' `isc_pathways.connect`).

    Args:
      service: the service's HOST:PORT (its --port), or unix:PATH (its --unix-socket).
      slices: how many slices to lease.
      token_file: the file with the tenant's secret (default: $ISTHMUS_SERVICE_TOKEN_FILE).
      ca: the service's certificate to trust (default: $ISTHMUS_SERVICE_CA, else the
        system's CAs); not used for unix:PATH.
      tenant: the tenant's name (default: the one the token belongs to).
      wait: seconds to wait in the queue at most (0: fail at once when nothing is free;
        None: as long as it takes).
      name: a name for the lease: a client that restarts within the service's grace period
        gets the same lease back by giving the same name (a notebook's kernel); at most 64
        letters, digits, '_', '.' and '-'.
      elastic: the job tolerates losing slices (pathwaysutils' elastic Manager): a higher
        priority may reclaim some while it runs; they come back when free.
      initialize_pathwaysutils: call `pathwaysutils.initialize()` when it is installed.

    Raises:
      LeaseRefused: with the service's one-line reason (credentials, quota, capacity).
    """
    from isthmus.client import connect as connect_jax

    with lease(service, slices=slices, token_file=token_file, ca=ca, tenant=tenant,
               wait=wait, name=name, elastic=elastic, separate_process=True) as grant:
        connect_jax(grant.target)
        if initialize_pathwaysutils:
            try:
                import pathwaysutils
            except ImportError:
                pass
            else:
                pathwaysutils.initialize()
        yield grant


# ---- arrays kept for the lease's next client ---------------------------------------------------


def keep(name: str, tree: Any) -> None:
    """Keeps the arrays of `tree` (a pytree of jax arrays) on the service under `name`, for
    as long as the lease lives: a client that comes back to the lease (a restarted notebook
    kernel: `connect(..., name=...)` again within the grace period) gets them with `take`.
    Keeping under a name again replaces what was kept there. Needs pathwaysutils."""
    import jax
    from pathwaysutils.plugin_executable import PluginExecutable

    leaves = jax.tree_util.tree_leaves(tree)
    names = [f"{name}/{i}" for i in range(len(leaves))]
    program = PluginExecutable(json.dumps({"isthmusKeep": {"names": names}}))
    _, done = program.call(in_arr=leaves)
    done.result()


def take(name: str, like: Any) -> Any:
    """The arrays kept under `name`, as a pytree shaped like `like` (a pytree of
    `jax.ShapeDtypeStruct`s with shardings, or arrays): each must match what was kept in
    dtype, shape and sharding (rebuild the same mesh). Raises (NOT_FOUND) when nothing is
    kept under that name."""
    import jax
    from pathwaysutils.persistence import helper
    from pathwaysutils.plugin_executable import PluginExecutable

    leaves, structure = jax.tree_util.tree_flatten(like)
    requests = []
    for i, leaf in enumerate(leaves):
        sharding = leaf.sharding
        requests.append({
            "b64_location": helper.string_to_base64("kept"),
            "b64_name": helper.string_to_base64(f"{name}/{i}"),
            "b64_hlo_sharding_string": helper.get_hlo_sharding_string(sharding, len(leaf.shape)),
            "shape": helper.get_shape_info(leaf.dtype, leaf.shape),
            "devices": {"device_ids": [d.id for d in jax_compat.device_assignment(sharding)]},
        })
    program = PluginExecutable(json.dumps({"isthmusTake": {"read_requests": requests}}))
    arrays, done = program.call(out_shardings=[leaf.sharding for leaf in leaves],
                                out_avals=[jax.core.ShapedArray(leaf.shape, leaf.dtype)
                                           for leaf in leaves])
    done.result()
    return jax.tree_util.tree_unflatten(structure, arrays)
