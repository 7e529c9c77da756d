"""A shared service (`isthmus up --tenants FILE`): identities, leases and their sessions.

Every connection of a shared service's client port carries an `Identity` (the wire layer's
gate establishes it: a tenant's credentials over TLS or a Unix socket). A client first asks
for a lease on a control connection (`lease_updates`: queued, granted, ended); its jax
process then connects through a tunnel bound to that lease, and its sessions see only the
lease's slices (`FleetView`). When a lease ends, its sessions end with the reason, its arrays
are freed, and only then are its slices free for the next tenant (scrubbed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping

from isthmus import errors
from isthmus.controller import session_profiles
from isthmus.controller.controller import Controller
from isthmus.controller.lease_view import FleetView, reclaimed_error
from isthmus.controller.leases import (
    Hooks,
    Lease,
    LeaseBook,
    LeaseFigures,
    LeaseSession,
    LeaseState,
    Listing,
)
from isthmus.controller.session import Session as ControllerSession
from isthmus.controller.session_kept import KeptArrays
from isthmus.controller.storage import TenantFiles
from isthmus.controller.tenants import Tenant, Tenants
from isthmus.frontend.tenant_limits import TenantLimits
from isthmus.ids import SliceId

logger = logging.getLogger(__name__)

TICK_SECONDS = 0.25  # how often expiry, grace periods and returning slices are looked at
QUEUE_REPORT_SECONDS = 2.0  # a queued client hears its position at least this often


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """Who a connection of a shared service's client port is."""

    tenant: Tenant
    lease_id: str | None  # the lease its tunnel is bound to (None: a control connection)


class SharedService:
    """The leases of a shared service and what hangs on them."""

    def __init__(self, tenants: Tenants, controller: Controller,
                 pool: Callable[[], list[SliceId]]) -> None:
        self.tenants = tenants
        self.controller = controller
        fleet = controller.fleet
        self.book = LeaseBook(
            tenants, pool, healthy=lambda s: fleet.slice_error(s) is None,
            hooks=Hooks(scrub=self._scrub, reclaimed=self._reclaimed))
        self._tasks: set[asyncio.Task[None]] = set()
        self._limits: dict[str, TenantLimits] = {}  # by tenant (`limits`)
        self._ticker: asyncio.Task[None] | None = None
        # Replaces the workers of slices with fresh processes, and returns once they serve
        # (the head's, when it launched them); None: workers stay.
        self.renew: Callable[[list[SliceId], str], Awaitable[None]] | None = None
        # Why no tenant may run colocated Python here, or None: the head clears it when the
        # workers it launches confine themselves (`worker/sandbox.py`).
        self.python_refusal: str | None = (
            "this service's workers were not started by it (--no-launch), so it cannot tell "
            "that they are confined; colocated Python is off for every tenant")

    def colocated_refusal(self, tenant: Tenant) -> str | None:
        """Why `tenant` may not run colocated Python here, or None when it may."""
        if not tenant.colocated_python:
            return (f"tenant {tenant.name} may not run colocated Python on this service; the "
                    f"operator allows it with colocated_python = true in its "
                    f"[tenants.{tenant.name}] table of the tenants file")
        return self.python_refusal

    def files(self, lease: Lease) -> TenantFiles:
        """Where the sessions of `lease` keep files (its tenant's storage root) and what they
        may profile (its workers, for at most the service's max_profile_seconds)."""
        return TenantFiles(lease.tenant.name, lease.tenant.storage_root, self.tenants.path,
                           lease.id, self.tenants.max_profile_seconds)

    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        for task in list(self._tasks):
            task.cancel()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                self.book.tick()
            except Exception:
                logger.exception("the lease book's tick failed")

    # ---- identities ------------------------------------------------------------------------

    def authenticate(self, name: str, token: str, lease_id: str | None) -> Identity:
        return Identity(self.tenants.authenticate(name, token), lease_id)

    def lease_for(self, identity: Identity) -> Identity:
        """A tunnel that names no lease (the stock client's own grpc_proxy route) is bound to
        the tenant's one active lease."""
        active = [lease for lease in self.book.leases.values()
                  if lease.tenant.name == identity.tenant.name
                  and lease.state is LeaseState.ACTIVE]
        if len(active) != 1:
            raise errors.NotPermitted(
                f"tenant {identity.tenant.name} holds {len(active)} active leases; a tunnel "
                "that names none is bound to the only one. Connect with isthmus run "
                "--service, which names its lease.")
        return Identity(identity.tenant, active[0].id)

    def lease_of(self, identity: object) -> Lease:
        """The active lease a tunnel is bound to; the reason it may not open a session."""
        if not isinstance(identity, Identity):
            raise errors.Unauthenticated(
                "this is a shared isthmus service: connect through `isthmus run --service "
                "HOST:PORT --token-file FILE -- CMD` or isthmus.shared.connect(...), which "
                "lease slices for you.")
        if identity.lease_id is None:
            raise errors.Unauthenticated(
                "this connection holds no lease; jax connects through the tunnel that "
                "isthmus.shared.connect (or isthmus run --service) opens once a lease is "
                "granted.")
        lease = self.book.lease(identity.lease_id)
        if lease.tenant.name != identity.tenant.name:
            raise errors.LeaseEnded(f"lease {identity.lease_id} is not live for tenant "
                                    f"{identity.tenant.name}; ask for a new lease.")
        if lease.state is not LeaseState.ACTIVE:
            raise errors.LeaseEnded(f"lease {lease.id} is {lease.state.value}, not granted; "
                                    "wait for its grant before jax connects.")
        return lease

    def view(self, lease: Lease) -> FleetView:
        return FleetView(self.controller.fleet, lease)

    def kept(self, lease: Lease) -> KeptArrays:
        """The arrays `lease` keeps for its next client (made on first use)."""
        kept = lease.attached.kept
        if kept is None:
            keeper = ControllerSession(self.controller, self.view(lease), lease.tenant.name)
            kept = lease.attached.kept = KeptArrays(keeper)
        return kept

    @staticmethod
    def sessions(lease: Lease) -> set[LeaseSession]:
        """The open sessions of a lease (front-end sessions)."""
        return lease.attached.sessions

    # ---- the lease stream ------------------------------------------------------------------

    async def lease_updates(self, identity: Identity, ask: Mapping[str, object]
                            ) -> AsyncIterator[dict[str, dict[str, object]]]:
        """A client's lease from its request to its end: `{"queued": ...}` while it waits
        (at least every few seconds), `{"granted": ...}`, then `{"ended": reason}`. The
        client holds the lease while it reads this; `release` ends it cleanly."""
        slices = ask.get("slices", 1)
        if not isinstance(slices, int) or isinstance(slices, bool):
            raise errors.InvalidRequest("slices must be a whole number.")
        name, resume = ask.get("name") or "", ask.get("resume") or ""
        if not isinstance(name, str) or not isinstance(resume, str):
            raise errors.InvalidRequest("a lease's name and the lease to resume are strings.")
        if resume:  # a client whose stream broke comes back to its lease
            lease = self.book.resume(identity.tenant, resume)
        else:
            lease = self.book.ask(identity.tenant, slices, name=name,
                                  elastic=bool(ask.get("elastic")),
                                  wait=bool(ask.get("wait", True)))
        changed = asyncio.Event()
        lease.watchers.append(changed.set)
        self.book.hold(lease)
        clean = False
        try:
            reported: tuple[object, ...] = ()
            while True:
                if lease.state is LeaseState.ENDED:
                    assert lease.end_reason is not None
                    yield {"ended": {"lease": lease.id, "reason": lease.end_reason.message,
                                     "code": int(lease.end_reason.code)}}
                    clean = True
                    return
                now = (lease.state, tuple(lease.slices), tuple(lease.reclaimed))
                if lease.state is LeaseState.QUEUED:
                    yield {"queued": {"lease": lease.id, "position": self.book.position(lease),
                                      "waited": round(self.book.clock() - lease.asked_at, 1),
                                      "free": len(self.book.free())}}
                elif now != reported:
                    yield {"granted": {"lease": lease.id, "name": lease.name,
                                       "slices": list(lease.slices),
                                       "reclaimed": list(lease.reclaimed),
                                       "tenant": lease.tenant.name}}
                reported = now
                changed.clear()
                try:
                    await asyncio.wait_for(changed.wait(), QUEUE_REPORT_SECONDS
                                           if lease.state is LeaseState.QUEUED else None)
                except TimeoutError:
                    pass
        finally:
            lease.watchers.remove(changed.set)
            if lease.state is not LeaseState.ENDED:
                self.book.let_go(lease, clean=lease.attached.released or clean)

    def release(self, identity: Identity, lease_id: str) -> dict[str, str]:
        """The client is done with its lease: it ends now (its stream closes after it)."""
        lease = self.book.lease(lease_id)
        if lease.tenant.name != identity.tenant.name and not identity.tenant.admin:
            raise errors.LeaseEnded(f"lease {lease_id} is not live for tenant "
                                    f"{identity.tenant.name}.")
        lease.attached.released = True
        self.book.end(lease, errors.LeaseEnded(f"lease {lease.id} was released by its client."))
        return {"released": lease.id}

    # ---- admins ----------------------------------------------------------------------------

    def _admin(self, identity: object) -> Tenant:
        if not isinstance(identity, Identity):
            raise errors.Unauthenticated("listing or revoking leases needs an admin's token.")
        if not identity.tenant.admin:
            raise errors.NotPermitted(
                f"tenant {identity.tenant.name} is not an admin of this service (admins = "
                f"[...] in {self.tenants.path or 'the tenants file'}).")
        return identity.tenant

    def leases(self, identity: object) -> Listing:
        self._admin(identity)
        return self.book.describe()

    def revoke(self, identity: object, lease_id: str) -> dict[str, str]:
        admin = self._admin(identity)
        lease = self.book.revoke(lease_id, admin.name)
        return {"revoked": lease.id}

    # ---- what the book decides -------------------------------------------------------------

    def _scrub(self, lease: Lease, slices: list[SliceId]) -> None:
        """Scrubs an ended lease's slices: ends its sessions with its reason, frees its
        arrays (and renews the workers when its own code ran there); then the workers hold
        nothing of it, and the book frees the slices."""
        reason = lease.end_reason or errors.LeaseEnded(f"lease {lease.id} ended.")
        sessions = list(self.sessions(lease))
        for session in sessions:
            session.end(reason)
        kept, lease.attached.kept = lease.attached.kept, None

        async def scrub() -> None:
            try:
                for session in sessions:
                    await session.close()
                if kept is not None:
                    await kept.close()
                if self.renew is not None and (lease.tenant.colocated_python or
                                               self.tenants.fresh_workers == "always"):
                    # Its own code ran in those workers: fresh ones serve the next lease.
                    await self.renew(slices, f"lease {lease.id} ended")
            except Exception:
                logger.exception("scrubbing the slices %s of lease %s failed", slices,
                                 lease.id)
            finally:
                self.book.scrubbed(slices)
        self._spawn(scrub())

    def _reclaimed(self, lease: Lease, slice_index: SliceId) -> None:
        session_profiles.leave(self.controller, slice_index)  # its profile ends there now
        self.controller.ledger.evict_slice(slice_index, reclaimed_error(lease, slice_index))

    def _spawn(self, coroutine: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def figures(self) -> LeaseFigures:
        return self.book.figures()

    def limits(self, tenant: Tenant) -> TenantLimits:
        """What `tenant`'s sessions together may hold and ask (made on first use)."""
        limits = self._limits.get(tenant.name)
        if limits is None:
            limits = self._limits[tenant.name] = TenantLimits(tenant, self.tenants.path)
        return limits
