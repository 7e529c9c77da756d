"""The lease book of a shared service, driven as a state object: a fake clock instead of
sleeping, a list of slice ids as the pool, a `healthy` callable, and hooks that record what
the book decided (grants, ends, reclaimed and returned slices)."""

import pytest

from isthmus import errors
from isthmus.controller import tenants
from isthmus.controller.leases import Hooks, LeaseBook, LeaseState
from isthmus.ids import SliceId

GRACE = 60


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


class Recorder:
    """Hooks that write down every call, in order; `scrub` says whether `scrub` is given."""

    def __init__(self, scrub=False):
        self.calls = []
        self.scrub = scrub

    def hooks(self):
        return Hooks(
            scrub=(lambda lease, slices: self.calls.append(("scrub", lease.id, list(slices))))
            if self.scrub else None,
            reclaimed=lambda lease, s: self.calls.append(("reclaimed", lease.id, s)),
            returned=lambda lease, s: self.calls.append(("returned", lease.id, s)),
            granted=lambda lease: self.calls.append(("granted", lease.id, list(lease.slices))))

    def of(self, kind):
        return [call[1:] for call in self.calls if call[0] == kind]


def make_tenants():
    def table(name, max_slices=8, **more):
        return {"token_sha256": tenants.token_digest(f"{name}-token"), "max_slices": max_slices,
                **more}
    return tenants.parse({
        "grace_seconds": GRACE,
        "admins": ["ops"],
        "tenants": {
            "a": table("a"), "b": table("b"), "c": table("c"),
            "mid": table("mid", priority=5),
            "hi": table("hi", priority=10),
            "small": table("small", max_slices=2),
            "timed": table("timed", max_lease_seconds=100),
            "ops": table("ops"),
        },
    })


TENANTS = make_tenants()
A, B, C, MID, HI, SMALL, TIMED = (TENANTS.by_name[n] for n in
                                  ("a", "b", "c", "mid", "hi", "small", "timed"))


def make_book(slices=4, healthy=None, recorder=None, clock=None):
    pool = [SliceId(i) for i in range(slices)]
    kwargs = {} if healthy is None else {"healthy": healthy}
    return LeaseBook(TENANTS, lambda: pool, hooks=recorder.hooks() if recorder else None,
                     clock=clock or Clock(), **kwargs)


def test_grant_on_a_free_pool():
    recorder, clock = Recorder(), Clock()
    book = make_book(4, recorder=recorder, clock=clock)
    seen = []
    lease = book.ask(A, 2)
    lease.watchers.append(lambda: seen.append(lease.state))
    assert (lease.id, lease.state, lease.slices, lease.wanted) == ("L1", LeaseState.ACTIVE,
                                                                  [0, 1], 2)
    assert lease.granted_at == lease.asked_at == 1000.0
    assert recorder.of("granted") == [("L1", [0, 1])]
    assert book.free() == [2, 3]
    assert book.lease("L1") is lease
    second = book.ask(B, 2)
    assert (second.id, second.slices, book.free()) == ("L2", [2, 3], [])
    book.end(lease, errors.LeaseEnded("done"))
    assert seen == [LeaseState.ENDED]
    assert (lease.state, lease.slices, lease.end_reason.message) == (LeaseState.ENDED, [], "done")
    assert book.free() == [0, 1]


def test_queue_served_by_priority_then_arrival():
    book = make_book(2)
    first = book.ask(A, 2)
    b = book.ask(B, 1)
    hi = book.ask(HI, 1)
    c = book.ask(C, 1)
    assert [lease.id for lease in book.queue()] == [hi.id, b.id, c.id]
    assert [book.position(x) for x in (first, hi, b, c)] == [0, 1, 2, 3]
    book.hold(first)
    book.let_go(first, clean=True)
    assert first.state is LeaseState.ENDED
    assert (hi.state, hi.slices, b.state, b.slices) == (LeaseState.ACTIVE, [0],
                                                        LeaseState.ACTIVE, [1])
    assert (c.state, book.position(c)) == (LeaseState.QUEUED, 1)
    book.end(hi, errors.LeaseEnded("done"))
    assert (c.state, c.slices) == (LeaseState.ACTIVE, [0])
    assert book.queue() == []


def test_head_of_line_blocks_a_smaller_request_of_equal_priority():
    book = make_book(3)
    first = book.ask(A, 2)
    big = book.ask(B, 2)
    small = book.ask(C, 1)
    # One slice is free, but the 2-slice request ahead of the 1-slice one blocks it.
    assert book.free() == [2]
    assert (big.state, small.state) == (LeaseState.QUEUED, LeaseState.QUEUED)
    assert [book.position(big), book.position(small)] == [1, 2]
    # A higher priority goes ahead of the blocked head, and gets the free slice.
    hi = book.ask(HI, 1)
    assert (hi.state, hi.slices) == (LeaseState.ACTIVE, [2])
    book.end(hi, errors.LeaseEnded("done"))
    assert small.state is LeaseState.QUEUED
    book.end(first, errors.LeaseEnded("done"))
    assert (big.slices, small.slices) == ([0, 1], [2])


def test_no_wait_refused_when_full_and_nothing_stays_queued():
    book = make_book(4)
    book.ask(A, 3)
    waiting = book.ask(B, 2)
    with pytest.raises(errors.NoCapacity, match=r"no 1 slices are free now \(1 of 4 free; "
                                                r"1 requests ahead\)"):
        book.ask(C, 1, wait=False)
    assert [lease.id for lease in book.queue()] == [waiting.id]
    assert sorted(book.leases) == ["L1", "L2"]
    assert book.figures()["refused_requests"] == 1
    # A request that fits now is granted even without waiting.
    hi = book.ask(HI, 1, wait=False)
    assert (hi.state, hi.slices) == (LeaseState.ACTIVE, [3])


def test_over_quota_counts_active_and_queued_leases_of_the_tenant():
    book = make_book(2)
    book.ask(A, 2)
    active = book.ask(SMALL, 1)      # queued: the pool is full
    assert active.state is LeaseState.QUEUED
    book.end(book.lease("L1"), errors.LeaseEnded("done"))
    assert (active.state, active.slices) == (LeaseState.ACTIVE, [0])
    book.ask(A, 1)
    queued = book.ask(SMALL, 1)
    assert queued.state is LeaseState.QUEUED
    with pytest.raises(errors.OverQuota, match="tenant small may hold 2 slices and holds or "
                                               "awaits 2; 1 more"):
        book.ask(SMALL, 1)
    assert len(book.leases) == 3
    # Another tenant is not counted against small's quota.
    assert book.ask(B, 1).state is LeaseState.QUEUED
    book.end(queued, errors.LeaseEnded("done"))
    assert book.ask(SMALL, 1).state is LeaseState.QUEUED


def test_more_slices_than_the_pool_or_fewer_than_one_refused():
    book = make_book(4)
    with pytest.raises(errors.NoCapacity, match="this service has 4 slices; a lease of 5"):
        book.ask(A, 5)
    with pytest.raises(errors.InvalidRequest, match="1 slice or more, not 0"):
        book.ask(A, 0)
    assert book.leases == {}
    assert book.figures()["refused_requests"] == 2


def test_unclean_let_go_keeps_an_active_lease_for_the_grace_period():
    clock = Clock()
    book = make_book(2, clock=clock)
    lease = book.ask(A, 2)
    book.hold(lease)
    book.let_go(lease, clean=False)
    assert (lease.state, lease.away_since, lease.holders) == (LeaseState.ACTIVE, 1000.0, 0)
    clock.advance(GRACE - 0.5)
    book.tick()
    assert lease.state is LeaseState.ACTIVE
    clock.advance(0.5)
    book.tick()
    assert lease.state is LeaseState.ENDED
    assert isinstance(lease.end_reason, errors.LeaseEnded)
    assert "away longer than the grace period (60 s)" in lease.end_reason.message
    assert book.free() == [0, 1]
    assert book.figures()["leases_ended"] == 1


def test_hold_within_grace_keeps_the_lease():
    clock = Clock()
    book = make_book(2, clock=clock)
    lease = book.ask(A, 2, name="train")
    book.hold(lease)
    book.let_go(lease, clean=False)
    clock.advance(30)
    # The restarted client finds its lease by name and attaches to it again.
    assert book.ask(A, 2, name="train") is lease
    book.hold(lease)
    assert lease.away_since is None
    clock.advance(10 * GRACE)
    book.tick()
    assert (lease.state, lease.slices, lease.holders) == (LeaseState.ACTIVE, [0, 1], 1)


def test_let_go_with_another_holder_left_keeps_the_lease():
    book = make_book(2)
    lease = book.ask(A, 1)
    book.hold(lease)
    book.hold(lease)
    book.let_go(lease, clean=True)
    assert (lease.state, lease.holders, lease.away_since) == (LeaseState.ACTIVE, 1, None)
    book.let_go(lease, clean=True)
    assert (lease.state, lease.holders) == (LeaseState.ENDED, 0)


def test_queued_lease_let_go_uncleanly_leaves_the_queue():
    book = make_book(2)
    book.ask(A, 2)
    queued = book.ask(B, 1)
    behind = book.ask(C, 1)
    book.hold(queued)
    book.let_go(queued, clean=False)
    assert queued.state is LeaseState.ENDED
    assert queued.id not in book.leases
    assert [lease.id for lease in book.queue()] == [behind.id]
    assert book.position(behind) == 1
    # Only leases that were granted count as ended.
    assert book.figures()["leases_ended"] == 0


def test_max_lease_seconds_counts_from_the_grant():
    clock = Clock()
    book = make_book(2, clock=clock)
    first = book.ask(A, 2)
    timed = book.ask(TIMED, 1)
    clock.advance(50)
    book.end(first, errors.LeaseEnded("done"))
    assert (timed.state, timed.granted_at) == (LeaseState.ACTIVE, 1050.0)
    clock.advance(99.5)
    book.tick()
    assert timed.state is LeaseState.ACTIVE
    clock.advance(0.5)
    book.tick()
    assert timed.state is LeaseState.ENDED
    assert "reached its tenant's max_lease_seconds (100 s)" in timed.end_reason.message
    # A tenant without a limit keeps its lease.
    other = book.ask(A, 1)
    clock.advance(10 ** 6)
    book.hold(other)
    book.tick()
    assert other.state is LeaseState.ACTIVE


def test_revoke_ends_a_lease_and_remembers_why():
    book = make_book(2)
    lease = book.ask(A, 2)
    queued = book.ask(B, 1)
    assert book.revoke(lease.id, by="ops") is lease
    assert lease.state is LeaseState.ENDED
    assert lease.end_reason.message == (
        "lease L1 of tenant a was revoked by the service's admin ops; ask for a new lease.")
    assert (queued.state, queued.slices) == (LeaseState.ACTIVE, [0])
    with pytest.raises(errors.LeaseEnded, match="lease L1 of tenant a was revoked"):
        book.lease("L1")  # a client that still names it hears why it ended
    with pytest.raises(errors.LeaseEnded, match="lease L9 is not live"):
        book.revoke("L9", by="ops")


def test_resume_by_name():
    book = make_book(4)
    lease = book.ask(A, 1, name="train")
    assert book.ask(A, 3, name="train") is lease       # no holders: resumed, as it was
    assert (len(book.leases), lease.wanted) == (1, 1)
    book.hold(lease)
    with pytest.raises(errors.NotPermitted, match="lease 'train' \\(L1\\) is in use"):
        book.ask(A, 1, name="train")
    # Names belong to a tenant: another tenant's "train" is another lease.
    other = book.ask(B, 1, name="train")
    assert other is not lease and other.slices == [1]
    # An ended lease is not resumed.
    book.let_go(lease, clean=True)
    again = book.ask(A, 1, name="train")
    assert again is not lease and again.id == "L3"



def test_resume_by_id_is_refused_while_a_client_holds_the_lease():
    """A second client that names a held lease's id is refused as one naming it by name is;
    once the holder's stream is gone (its grace period), the lease is resumed by id."""
    book = make_book(4)
    lease = book.ask(A, 1)
    book.hold(lease)
    with pytest.raises(errors.NotPermitted) as refused:
        book.resume(A, lease.id)
    assert refused.value.message == ("lease L1 is in use by another client of tenant a; end "
                                     "that client or ask for a lease of its own.")
    named = book.ask(A, 1, name="train")
    book.hold(named)
    with pytest.raises(errors.NotPermitted, match="lease 'train' \\(L2\\) is in use by another"):
        book.resume(A, named.id)
    assert (lease.holders, book.figures()["refused_requests"]) == (1, 2)
    # Another tenant does not reach it; an unknown (or absurdly long) id is not live.
    with pytest.raises(errors.LeaseEnded, match="lease L1 is not live for tenant b"):
        book.resume(B, lease.id)
    with pytest.raises(errors.LeaseEnded, match="lease LLLLLLLLLLLLLLLLLLLLLLLL... is not live"):
        book.resume(A, "L" * (1 << 20))
    book.let_go(lease, clean=False)  # its client vanished: kept for the grace period
    assert book.resume(A, lease.id) is lease


@pytest.mark.parametrize("name", ["x" * 65, "a b", "<b>", "caf\u00e9", "a/b", "n\n"])
def test_a_lease_name_is_bounded(name):
    book = make_book(4)
    with pytest.raises(errors.InvalidRequest) as refused:
        book.ask(A, 1, name=name)
    assert refused.value.code.name == "INVALID_ARGUMENT"
    assert refused.value.message.startswith(
        "a lease name is at most 64 letters, digits, '_', '.' and '-', not ")
    assert len(refused.value.message) < 200 and not book.leases
    assert book.figures()["refused_requests"] == 1


def test_a_32_mib_lease_name_is_refused_without_echoing_it():
    book = make_book(4)
    with pytest.raises(errors.InvalidRequest) as refused:
        book.ask(A, 1, name="n" * (32 << 20))
    assert refused.value.message == (
        "a lease name is at most 64 letters, digits, '_', '.' and '-', not "
        "'nnnnnnnnnnnnnnnnnnnnnnnn... (33554432 characters)'; pick such a name.")
    longest = "my-notebook_v2." + "x" * 49
    assert book.ask(A, 1, name=longest).name == longest  # 64 characters: fine

def test_unhealthy_slices_are_granted_once_healthy():
    sick = {SliceId(0), SliceId(1)}
    book = make_book(4, healthy=lambda s: s not in sick)
    lease = book.ask(A, 3)
    assert lease.state is LeaseState.QUEUED
    assert book.free() == [2, 3]
    book.tick()
    assert lease.state is LeaseState.QUEUED
    sick.discard(SliceId(1))
    book.tick()
    assert (lease.state, lease.slices) == (LeaseState.ACTIVE, [1, 2, 3])
    assert book.free() == []


def test_the_scrub_hook_holds_slices_until_scrubbed():
    recorder = Recorder(scrub=True)
    book = make_book(2, recorder=recorder)
    first = book.ask(A, 2)
    queued = book.ask(B, 1)
    book.end(first, errors.LeaseEnded("done"))
    assert recorder.of("scrub") == [("L1", [0, 1])]
    assert book.scrubbing == {0, 1}
    assert book.free() == []
    assert queued.state is LeaseState.QUEUED
    book.scrubbed([SliceId(1)])
    assert (queued.state, queued.slices) == (LeaseState.ACTIVE, [1])
    assert (book.scrubbing, book.free()) == ({0}, [])
    book.scrubbed([SliceId(0)])
    assert (book.scrubbing, book.free()) == (set(), [0])


def test_without_a_scrub_hook_slices_are_free_at_once():
    book = make_book(2)
    first = book.ask(A, 2)
    book.end(first, errors.LeaseEnded("done"))
    assert (book.scrubbing, book.free()) == (set(), [0, 1])


def test_elastic_reclaim_and_return():
    recorder = Recorder(scrub=True)
    book = make_book(4, recorder=recorder)
    elastic = book.ask(A, 4, elastic=True)
    hi = book.ask(HI, 2)
    # The newest, highest slices are taken first.
    assert (hi.state, sorted(hi.slices)) == (LeaseState.ACTIVE, [2, 3])
    assert recorder.of("reclaimed") == [("L1", 3), ("L1", 2)]
    assert (elastic.state, elastic.slices, elastic.reclaimed) == (LeaseState.ACTIVE, [0, 1],
                                                                  [3, 2])
    assert elastic.seen_slices == (0, 1, 2, 3)
    assert elastic.describe()["reclaimed"] == [3, 2]
    # The quota counts owed slices: a has 4 seen slices of its 8.
    with pytest.raises(errors.OverQuota, match="holds or awaits 4"):
        book.ask(A, 5)
    book.end(hi, errors.LeaseEnded("done"))
    assert recorder.of("returned") == []        # not before the slices are scrubbed
    book.scrubbed([SliceId(2), SliceId(3)])
    assert recorder.of("returned") == [("L1", 3), ("L1", 2)]
    assert (sorted(elastic.slices), elastic.reclaimed) == ([0, 1, 2, 3], [])
    assert elastic.seen_slices == (0, 1, 2, 3)
    assert book.free() == []


def test_elastic_lease_keeps_one_slice():
    recorder = Recorder()
    book = make_book(4, recorder=recorder)
    elastic = book.ask(A, 4, elastic=True)
    hi = book.ask(HI, 4)
    # Three could be taken, not four: nothing is taken and the request waits.
    assert hi.state is LeaseState.QUEUED
    assert recorder.of("reclaimed") == []
    assert elastic.slices == [0, 1, 2, 3]
    mid = book.ask(MID, 3)
    assert mid.state is LeaseState.QUEUED           # behind hi in the queue


def test_reclaim_takes_lowest_priority_newest_first_and_mixes_free_slices():
    recorder = Recorder()
    book = make_book(6, recorder=recorder)
    old = book.ask(A, 2, elastic=True)          # [0, 1]
    new = book.ask(B, 2, elastic=True)          # [2, 3]
    mid = book.ask(MID, 1, elastic=True)        # [4]
    hi = book.ask(HI, 3)
    # One free slice (5), then one each from the newest lowest-priority leases.
    assert sorted(hi.slices) == [1, 3, 5]
    assert recorder.of("reclaimed") == [(new.id, 3), (old.id, 1)]
    assert (old.slices, new.slices, mid.slices) == ([0], [2], [4])


def test_non_elastic_leases_are_never_reclaimed():
    recorder = Recorder()
    book = make_book(4, recorder=recorder)
    fixed = book.ask(A, 3)
    elastic = book.ask(A, 1, elastic=True)      # keeps its one slice
    hi = book.ask(HI, 1)
    assert hi.state is LeaseState.QUEUED
    assert recorder.of("reclaimed") == []
    assert (fixed.slices, elastic.slices) == ([0, 1, 2], [3])


def test_equal_priority_does_not_reclaim():
    recorder = Recorder()
    book = make_book(4, recorder=recorder)
    elastic = book.ask(MID, 4, elastic=True)
    same = book.ask(MID, 1)
    assert same.state is LeaseState.QUEUED
    assert recorder.of("reclaimed") == []
    # One priority higher takes one.
    hi = book.ask(HI, 1)
    assert (hi.slices, recorder.of("reclaimed")) == ([3], [(elastic.id, 3)])


def test_figures():
    clock = Clock()
    book = make_book(4, clock=clock)
    assert book.figures() == {
        "active_users": 0, "capacity_in_use": 0, "capacity_total": 4, "capacity_free": 4,
        "requested_capacity": 0, "assignment_seconds_median": None,
        "successful_requests": 0, "users_waiting": 0, "refused_requests": 0,
        "leases_ended": 0}
    first = book.ask(A, 4)                      # waits 0 s
    book.ask(B, 2)                              # waits 10 s
    clock.advance(6)
    book.ask(B, 2)                              # waits 4 s
    with pytest.raises(errors.NoCapacity):
        book.ask(C, 1, wait=False)
    assert book.figures() == {
        "active_users": 1, "capacity_in_use": 4, "capacity_total": 4, "capacity_free": 0,
        "requested_capacity": 8, "assignment_seconds_median": 0.0,
        "successful_requests": 1, "users_waiting": 1, "refused_requests": 1,
        "leases_ended": 0}
    clock.advance(4)
    book.end(first, errors.LeaseEnded("done"))
    assert book.figures() == {
        "active_users": 1, "capacity_in_use": 4, "capacity_total": 4, "capacity_free": 0,
        "requested_capacity": 4, "assignment_seconds_median": 4.0,
        "successful_requests": 3, "users_waiting": 0, "refused_requests": 1,
        "leases_ended": 1}


def test_describe_lists_leases_and_queue_positions():
    clock = Clock()
    book = make_book(2, clock=clock)
    book.ask(A, 2, name="train")
    book.ask(B, 1)
    clock.advance(2.5)
    book.ask(HI, 2)
    clock.advance(1)
    described = book.describe()
    assert described["leases"] == [{
        "id": "L1", "tenant": "a", "name": "train", "state": "active", "slices": [0, 1],
        "reclaimed": [], "wanted": 2, "elastic": False, "priority": 0, "holders": 0,
        "ended": None}]
    assert [(q["id"], q["tenant"], q["position"], q["waited"], q["state"])
            for q in described["queue"]] == [("L3", "hi", 1, 1.0, "queued"),
                                              ("L2", "b", 2, 3.5, "queued")]
    assert (described["free"], described["scrubbing"]) == ([], [])
    assert described["figures"]["users_waiting"] == 2


def test_reclaim_never_grants_fewer_slices_than_wanted():
    recorder = Recorder()
    sick = set()
    book = make_book(3, healthy=lambda s: s not in sick, recorder=recorder)
    elastic = book.ask(A, 3, elastic=True)
    sick.add(SliceId(2))
    hi = book.ask(HI, 2)
    # Granted all it asked for or nothing, and no slice taken for nothing.
    assert len(hi.slices) in (0, 2)
    assert len(elastic.reclaimed) == len(hi.slices)


def test_reclaimed_slices_return_while_a_blocked_request_waits():
    recorder = Recorder()
    book = make_book(4, recorder=recorder)
    elastic = book.ask(MID, 4, elastic=True)
    hi = book.ask(HI, 2)
    low = book.ask(A, 3)             # priority 0: can take nothing from `elastic`
    assert low.state is LeaseState.QUEUED
    book.end(hi, errors.LeaseEnded("done"))
    # `low` cannot use the two free slices (it needs 3); they are owed to `elastic`.
    assert low.state is LeaseState.QUEUED
    assert sorted(elastic.slices) == [0, 1, 2, 3]
