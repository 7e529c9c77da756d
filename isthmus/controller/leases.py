"""The resource manager of a shared service: leases of whole slices, a queue, quotas.

`LeaseBook` is a state object without a network or an event loop: `ask`, `hold`, `let_go`,
`revoke`, `tick` and `scrubbed` change it, and it calls back (`Hooks`) when a lease is
granted, when one ends (its slices are to be scrubbed) and when one of its slices is taken
or given back. Time comes from its `clock`, so tests drive expiry
and grace periods without sleeping.

Invariants:
- a slice is in at most one of: a lease's `slices`, `scrubbing`, free;
- a lease's `reclaimed` slices are held by other leases (or scrubbing, or free but owed):
  its session still lists their devices, whose work fails with DATA_LOSS until they return;
- the queue is served strictly by (priority descending, arrival): a request that does not
  fit blocks those behind it, so a large high-priority request is not starved by small ones.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypedDict

from isthmus import errors
from isthmus.controller.tenants import NAME_CHARACTERS, Tenant, Tenants
from isthmus.ids import SliceId
from isthmus.logs import event

if TYPE_CHECKING:
    from isthmus.controller.session_kept import KeptArrays

logger = logging.getLogger(__name__)

MAX_NAME = 64  # characters of a lease's name (letters, digits, '_', '.', '-')


def name_refusal(name: str) -> str | None:
    """Why `name` cannot name a lease (it is shown on every page and listing), or None."""
    if len(name) <= MAX_NAME and set(name) <= NAME_CHARACTERS:
        return None
    shown = name if len(name) <= MAX_NAME else f"{name[:24]}... ({len(name)} characters)"
    return (f"a lease name is at most {MAX_NAME} letters, digits, '_', '.' and '-', not "
            f"{shown!r}; pick such a name.")


def _shown(lease_id: str) -> str:
    """A lease id a client sent, for a message (ids are short: a long one is cut)."""
    return lease_id if len(lease_id) <= 24 else f"{lease_id[:24]}..."


class LeaseState(enum.Enum):
    QUEUED = "queued"
    ACTIVE = "active"
    ENDED = "ended"


class LeaseSession(Protocol):
    """A client's session opened under a lease, as the service ends it."""

    def end(self, error: errors.IsthmusError) -> None: ...

    async def close(self) -> None: ...


@dataclasses.dataclass(eq=False, slots=True)
class Attachments:
    """What the service hangs on a lease; the book never looks inside."""

    sessions: set[LeaseSession] = dataclasses.field(default_factory=set)  # the open ones
    kept: KeptArrays | None = None  # arrays kept for its next client (made on first use)
    released: bool = False  # its client released it: the end of its stream is clean


class LeaseFigures(TypedDict):
    """The six quantities of Shared Pathways Service's metrics, and a few more."""

    active_users: int
    capacity_in_use: int
    capacity_total: int
    capacity_free: int  # healthy, scrubbed and held by no lease
    requested_capacity: int
    assignment_seconds_median: float | None
    successful_requests: int
    users_waiting: int
    refused_requests: int
    leases_ended: int


class Listing(TypedDict):
    """Every live lease and the queue (for admins, and the live page)."""

    leases: list[dict[str, object]]  # `Lease.describe` of each active lease
    queue: list[dict[str, object]]  # ... of each queued one, with its position and wait
    free: list[SliceId]
    scrubbing: list[SliceId]
    figures: LeaseFigures


@dataclasses.dataclass(eq=False, slots=True)
class Lease:
    """One job's claim on slices, from its request to its end."""

    id: str
    tenant: Tenant
    wanted: int  # slices asked for
    name: str  # the client's name for it ("" none): a restarted client resumes it by name
    elastic: bool  # higher priorities may take slices of it while it runs
    asked_at: float
    order: int  # arrival, for the queue
    state: LeaseState = LeaseState.QUEUED
    slices: list[SliceId] = dataclasses.field(default_factory=list)  # held now
    reclaimed: list[SliceId] = dataclasses.field(default_factory=list)  # taken, to come back
    granted_at: float | None = None
    end_reason: errors.IsthmusError | None = None  # why it ended (state ENDED)
    holders: int = 0  # clients attached to it (lease streams)
    away_since: float | None = None  # when its last client left uncleanly
    attached: Attachments = dataclasses.field(default_factory=Attachments)
    # Called after every change of this lease (its stream tells the client).
    watchers: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    @property
    def seen_slices(self) -> tuple[SliceId, ...]:
        """Every slice whose devices its sessions list: held, and reclaimed ones."""
        return tuple(sorted(self.slices + self.reclaimed))

    def changed(self) -> None:
        for watcher in list(self.watchers):
            watcher()

    def describe(self) -> dict[str, object]:
        return {"id": self.id, "tenant": self.tenant.name, "name": self.name,
                "state": self.state.value, "slices": list(self.slices),
                "reclaimed": list(self.reclaimed), "wanted": self.wanted,
                "elastic": self.elastic, "priority": self.tenant.priority,
                "holders": self.holders,
                "ended": self.end_reason.message if self.end_reason else None}


@dataclasses.dataclass(frozen=True, slots=True)
class Hooks:
    """What the service does when the book decides (each may be left out in tests)."""

    # A lease ended: scrub its slices (end its sessions, free its arrays), then call
    # `book.scrubbed(slices)`; until then the slices are not free.
    scrub: Callable[[Lease, list[SliceId]], None] | None = None
    # One of an elastic lease's slices was taken (its work there fails with DATA_LOSS).
    reclaimed: Callable[[Lease, SliceId], None] | None = None
    # A reclaimed slice came back to its lease.
    returned: Callable[[Lease, SliceId], None] | None = None
    # A lease was granted.
    granted: Callable[[Lease], None] | None = None


class LeaseBook:
    """Leases of a fixed pool of slices among the tenants of `tenants`."""

    def __init__(self, tenants: Tenants, pool: Callable[[], Iterable[SliceId]],
                 healthy: Callable[[SliceId], bool] = lambda s: True,
                 hooks: Hooks | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tenants = tenants
        self._pool = pool
        self._healthy = healthy
        self.hooks = hooks or Hooks()
        self.clock = clock
        self.leases: dict[str, Lease] = {}  # live ones (queued or active)
        self.scrubbing: set[SliceId] = set()
        # Why recent leases ended, by id, for the clients that still name them (the last 1024).
        self.history: dict[str, errors.IsthmusError] = {}
        self._order = itertools.count()
        self._ids = itertools.count(1)
        # Figures of the shared service (the six of Shared Pathways Service, and more).
        self.granted_count = 0
        self.refused_count = 0
        self.finished_count = 0  # leases that ended after their grant (not queued ones)
        self.assign_seconds: list[float] = []  # ask -> grant of the last grants

    # ---- asking, holding, letting go -------------------------------------------------------

    def ask(self, tenant: Tenant, slices: int, *, name: str = "", elastic: bool = False,
            wait: bool = True) -> Lease:
        """A lease for `slices` slices: granted now, or queued (when `wait`). A live lease
        of the tenant with this `name` and no client is resumed instead."""
        refusal = name_refusal(name)
        if refusal is not None:
            self.refused_count += 1
            raise errors.InvalidRequest(refusal)
        if name:
            for lease in self.leases.values():
                if lease.tenant.name == tenant.name and lease.name == name:
                    return self._resumed(lease, "pick another name")
        if slices < 1:
            self.refused_count += 1
            raise errors.InvalidRequest(f"a lease is of 1 slice or more, not {slices}.")
        held = sum(len(lease.seen_slices) if lease.state is LeaseState.ACTIVE else lease.wanted
                   for lease in self.leases.values() if lease.tenant.name == tenant.name)
        if held + slices > tenant.max_slices:
            self.refused_count += 1
            raise errors.OverQuota(
                f"tenant {tenant.name} may hold {tenant.max_slices} slices and holds or awaits "
                f"{held}; {slices} more are over its quota: ask for fewer, or end a lease "
                "(isthmus leases lists them).")
        pool = list(self._pool())
        if slices > len(pool):
            self.refused_count += 1
            raise errors.NoCapacity(
                f"this service has {len(pool)} slices; a lease of {slices} can never be "
                "granted: ask for fewer.")
        lease = Lease(f"L{next(self._ids)}", tenant, slices, name, elastic, self.clock(),
                      next(self._order))
        self.leases[lease.id] = lease
        self.schedule()
        if lease.state is LeaseState.QUEUED and not wait:
            position = self.position(lease)
            del self.leases[lease.id]
            self.refused_count += 1
            raise errors.NoCapacity(
                f"no {slices} slices are free now ({len(self.free())} of {len(pool)} free; "
                f"{position - 1} requests ahead); wait for them (--wait SECONDS) or ask for "
                "fewer.")
        return lease

    def resume(self, tenant: Tenant, lease_id: str) -> Lease:
        """The live lease `lease_id` of `tenant` again, for a client whose lease stream broke;
        refused while a client holds it (its stream is live), as a resume by name is."""
        lease = self.lease(lease_id)
        if lease.tenant.name != tenant.name:
            raise errors.LeaseEnded(f"lease {lease.id} is not live for tenant {tenant.name}.")
        return self._resumed(lease, "ask for a lease of its own")

    def _resumed(self, lease: Lease, otherwise: str) -> Lease:
        # Invariant: a live lease stream holds its lease; no second client takes it over.
        if lease.holders:
            self.refused_count += 1
            named = f"{lease.name!r} ({lease.id})" if lease.name else lease.id
            raise errors.NotPermitted(
                f"lease {named} is in use by another client of tenant {lease.tenant.name}; "
                f"end that client or {otherwise}.")
        logger.info("lease %s (%s) of %s resumed", lease.id, lease.name, lease.tenant.name,
                    extra=event("lease_resumed", lease=lease.id, tenant=lease.tenant.name))
        return lease

    def hold(self, lease: Lease) -> None:
        """A client attached to `lease` (its lease stream opened)."""
        lease.holders += 1
        lease.away_since = None

    def let_go(self, lease: Lease, clean: bool) -> None:
        """A client detached: `clean` (it said so) ends the lease once no client is left;
        otherwise an active lease waits the grace period for its client to come back, and a
        queued one leaves the queue."""
        lease.holders = max(0, lease.holders - 1)
        if lease.holders or lease.state is LeaseState.ENDED:
            return
        if clean or lease.state is LeaseState.QUEUED:
            self.end(lease, errors.LeaseEnded(f"lease {lease.id} was released by its client."))
        else:
            lease.away_since = self.clock()
            lease.changed()

    def revoke(self, lease_id: str, by: str) -> Lease:
        lease = self.lease(lease_id)
        self.end(lease, errors.LeaseEnded(
            f"lease {lease.id} of tenant {lease.tenant.name} was revoked by the service's "
            f"admin {by}; ask for a new lease."))
        return lease

    def lease(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            if lease_id in self.history:
                raise self.history[lease_id]
            raise errors.LeaseEnded(
                f"lease {_shown(lease_id)} is not live on this service (it ended, or the "
                "service restarted); ask for a new lease.")
        return lease

    # ---- time ------------------------------------------------------------------------------

    def tick(self) -> None:
        """Ends leases past their `max_lease_seconds` or their grace period; then serves the
        queue (slices may have come back to health)."""
        now = self.clock()
        grace = self.tenants.grace_seconds
        for lease in list(self.leases.values()):
            limit = lease.tenant.max_lease_seconds
            if (lease.state is LeaseState.ACTIVE and limit is not None
                    and lease.granted_at is not None and now - lease.granted_at >= limit):
                self.end(lease, errors.LeaseEnded(
                    f"lease {lease.id} reached its tenant's max_lease_seconds ({limit:g} s); "
                    "ask for a new lease."))
            elif lease.away_since is not None and now - lease.away_since >= grace:
                self.end(lease, errors.LeaseEnded(
                    f"lease {lease.id} ended: its client was away longer than the grace "
                    f"period ({grace:g} s); ask for a new lease."))
        self.schedule()

    # ---- the end of a lease ----------------------------------------------------------------

    def end(self, lease: Lease, reason: errors.IsthmusError) -> None:
        if lease.state is LeaseState.ENDED:
            return
        self.leases.pop(lease.id, None)
        self.history[lease.id] = reason
        while len(self.history) > 1024:
            del self.history[next(iter(self.history))]
        was_active = lease.state is LeaseState.ACTIVE
        lease.state, lease.end_reason = LeaseState.ENDED, reason
        freed, lease.slices = lease.slices, []
        lease.reclaimed = []
        self.finished_count += was_active
        logger.info("lease %s of %s ended: %s", lease.id, lease.tenant.name, reason.message,
                    extra=event("lease_ended", lease=lease.id, tenant=lease.tenant.name))
        self.scrubbing.update(freed)
        if self.hooks.scrub is not None:
            self.hooks.scrub(lease, freed)
        else:
            self.scrubbed(freed)
        lease.changed()
        self.schedule()

    def scrubbed(self, slices: Iterable[SliceId]) -> None:
        """The slices of an ended lease hold nothing of it any more: they are free."""
        self.scrubbing.difference_update(slices)
        self.schedule()

    # ---- the queue -------------------------------------------------------------------------

    def queue(self) -> list[Lease]:
        return sorted((lease for lease in self.leases.values()
                       if lease.state is LeaseState.QUEUED),
                      key=lambda lease: (-lease.tenant.priority, lease.order))

    def position(self, lease: Lease) -> int:
        """1 for the head of the queue (0: not queued)."""
        for i, queued in enumerate(self.queue(), 1):
            if queued is lease:
                return i
        return 0

    def free(self) -> list[SliceId]:
        """Slices no lease holds, that are healthy and scrubbed, lowest first."""
        held = {s for lease in self.leases.values() for s in lease.slices}
        return [s for s in sorted(self._pool())
                if s not in held and s not in self.scrubbing and self._healthy(s)]

    def schedule(self) -> None:
        """Grants what the queue's head can get, in order; then returns reclaimed slices."""
        for lease in self.queue():
            free = self.free()
            if len(free) < lease.wanted:
                victims = self._reclaimable(lease.tenant.priority, lease.wanted - len(free))
                if victims is None:
                    break
                for victim, slice_index in victims:
                    self._reclaim(victim, slice_index)
                free = self.free()
                if len(free) < lease.wanted:  # cannot happen: victims are healthy and held
                    break
            self._grant(lease, free[:lease.wanted])
        # Owed slices go back even while a request waits: one that could take them would
        # have (it reclaims them again once it fits).
        self._return_reclaimed()

    def _grant(self, lease: Lease, slices: list[SliceId]) -> None:
        lease.state, lease.slices = LeaseState.ACTIVE, list(slices)
        lease.granted_at = self.clock()
        self.granted_count += 1
        self.assign_seconds = (self.assign_seconds + [lease.granted_at - lease.asked_at])[-100:]
        logger.info("lease %s of %s granted slices %s", lease.id, lease.tenant.name, slices,
                    extra=event("lease_granted", lease=lease.id, tenant=lease.tenant.name,
                                slices=list(slices)))
        if self.hooks.granted is not None:
            self.hooks.granted(lease)
        lease.changed()

    def _reclaimable(self, priority: int, needed: int) -> list[tuple[Lease, SliceId]] | None:
        """Slices of lower-priority elastic leases (each keeps one) enough for `needed`,
        lowest priority and newest first; None when there are not enough."""
        victims: list[tuple[Lease, SliceId]] = []
        candidates = sorted((lease for lease in self.leases.values()
                             if lease.state is LeaseState.ACTIVE and lease.elastic
                             and lease.tenant.priority < priority),
                            key=lambda lease: (lease.tenant.priority, -lease.order))
        for lease in candidates:
            healthy = [s for s in sorted(lease.slices, reverse=True) if self._healthy(s)]
            for slice_index in healthy[:len(lease.slices) - 1]:
                if len(victims) == needed:
                    return victims
                victims.append((lease, slice_index))
        return victims if len(victims) == needed else None

    def _reclaim(self, lease: Lease, slice_index: SliceId) -> None:
        lease.slices.remove(slice_index)
        lease.reclaimed.append(slice_index)
        logger.info("slice %s of elastic lease %s reclaimed", slice_index, lease.id,
                    extra=event("slice_reclaimed", lease=lease.id, slice=slice_index))
        if self.hooks.reclaimed is not None:
            self.hooks.reclaimed(lease, slice_index)
        lease.changed()

    def _return_reclaimed(self) -> None:
        free = set(self.free())
        for lease in sorted(self.leases.values(), key=lambda lease: -lease.tenant.priority):
            for slice_index in [s for s in lease.reclaimed if s in free]:
                lease.reclaimed.remove(slice_index)
                lease.slices.append(slice_index)
                free.discard(slice_index)
                logger.info("slice %s returned to elastic lease %s", slice_index, lease.id,
                            extra=event("slice_returned", lease=lease.id, slice=slice_index))
                if self.hooks.returned is not None:
                    self.hooks.returned(lease, slice_index)
                lease.changed()

    # ---- figures ---------------------------------------------------------------------------

    def figures(self) -> LeaseFigures:
        """The service's figures, now."""
        active = [lease for lease in self.leases.values() if lease.state is LeaseState.ACTIVE]
        queued = self.queue()
        seconds = self.assign_seconds
        return {
            "active_users": len({lease.tenant.name for lease in active}),
            "capacity_in_use": sum(len(lease.slices) for lease in active),
            "capacity_total": len(list(self._pool())),
            "capacity_free": len(self.free()),
            "requested_capacity": sum(lease.wanted for lease in active + queued),
            "assignment_seconds_median": statistics.median(seconds) if seconds else None,
            "successful_requests": self.granted_count,
            "users_waiting": len({lease.tenant.name for lease in queued}),
            "refused_requests": self.refused_count,
            "leases_ended": self.finished_count,
        }

    def describe(self) -> Listing:
        """Every live lease and the queue (for admins)."""
        return {"leases": [lease.describe() for lease in self.leases.values()
                           if lease.state is LeaseState.ACTIVE],
                "queue": [{**lease.describe(), "position": i,
                           "waited": round(self.clock() - lease.asked_at, 3)}
                          for i, lease in enumerate(self.queue(), 1)],
                "free": list(self.free()), "scrubbing": sorted(self.scrubbing),
                "figures": self.figures()}
