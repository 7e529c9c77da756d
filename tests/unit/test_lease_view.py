"""A lease's view of the fleet (`FleetView`): it provides every member of the `Fleet`
protocol itself (nothing is forwarded to the whole fleet by default), and it answers for the
lease's devices and workers only."""

import asyncio

import pytest

from isthmus import errors
from isthmus.controller import tenants
from isthmus.controller.fleet import Device, Fleet, WholeFleet
from isthmus.controller.lease_view import FleetView
from isthmus.controller.leases import Lease
from isthmus.ids import DeviceId, SliceId, WorkerId
from isthmus.transport import commands as c

SLICES, HOSTS, PER_HOST = 3, 2, 2


class Channel:
    local = False  # a worker process's, as far as the controller can tell

    """A worker's channel that writes down what it was handed."""

    def __init__(self):
        self.sent = []

    def send(self, command):
        self.sent.append(command)

    def ask(self, request):
        raise AssertionError("no request is asked here")

    def deliver(self, commands, more=False):
        self.sent.extend(commands.items)

    def stats(self):
        return {}


def make_fleet():
    devices = [Device(DeviceId((s * HOSTS + h) * PER_HOST + d), WorkerId(s * HOSTS + h), d,
                      "cpu", "cpu", SliceId(s), h)
               for s in range(SLICES) for h in range(HOSTS) for d in range(PER_HOST)]
    channels = {WorkerId(w): Channel() for w in range(SLICES * HOSTS)}
    return WholeFleet(devices, channels), channels


def make_lease(slices, reclaimed=()):
    tenant = tenants.Tenant("a", b"", max_slices=SLICES)
    return Lease("lease-1", tenant, len(slices), "", True, 0.0, 0, slices=list(slices),
                 reclaimed=list(reclaimed))


def workers_of(slice_index):
    return [WorkerId(slice_index * HOSTS + h) for h in range(HOSTS)]


def protocol_members(protocol):
    """The names a protocol class declares (methods, properties, annotated attributes)."""
    declared = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
    return {name for name in declared if not name.startswith("_")}


def unprovided(fleet):
    """The members of `Fleet` that `fleet` does not define itself: neither its class (nor a
    base below `object`) nor the object."""
    own = set(vars(fleet))
    for klass in type(fleet).__mro__[:-1]:
        own |= set(vars(klass))
    return protocol_members(Fleet) - own


def test_the_protocol_names_what_sessions_use():
    assert protocol_members(Fleet) == {
        "devices", "all_devices", "flow", "device", "devices_of", "slice_label",
        "unavailable", "slice_error_of", "channel", "multicast"}


def test_the_view_provides_every_member_itself():
    fleet, _ = make_fleet()
    view = FleetView(fleet, make_lease([SliceId(1)]))
    assert unprovided(view) == set()
    assert unprovided(fleet) == set()
    assert "__getattr__" not in vars(FleetView)  # nothing else reaches the whole fleet
    with pytest.raises(AttributeError):
        view.members  # noqa: B018 (the whole fleet's, not a lease's)


@pytest.mark.parametrize("member", sorted(protocol_members(Fleet)))
def test_a_member_the_view_lacks_is_found(member):
    fleet, _ = make_fleet()
    view = FleetView(fleet, make_lease([SliceId(1)]))
    lacking = type("Lacking", (), {k: v for k, v in vars(FleetView).items()
                                   if not k.startswith("__") and k != member})
    copy = object.__new__(lacking)
    copy.__dict__.update({k: v for k, v in vars(view).items() if k != member})
    assert unprovided(copy) == {member}


def test_the_view_lists_and_finds_only_the_leases_devices():
    fleet, _ = make_fleet()
    view = FleetView(fleet, make_lease([SliceId(2), SliceId(1)]))
    assert {d.slice_index for d in view.devices} == {1, 2}
    assert view.all_devices == view.devices  # a CPU fleet: no colocated CPU devices
    assert [view.slice_label(d) for d in view.devices] == [0] * 4 + [1] * 4
    assert [fleet.slice_label(d) for d in view.devices] == [1] * 4 + [2] * 4
    mine, other = view.devices[0], fleet.devices[0]
    assert view.device(mine.id) is mine
    assert view.devices_of([mine.id]) == (mine,)
    with pytest.raises(errors.UnknownHandle, match="not one of lease lease-1's devices"):
        view.device(other.id)
    with pytest.raises(errors.UnknownHandle):
        view.devices_of([mine.id, other.id])


def test_the_view_reaches_only_the_leases_workers():
    fleet, channels = make_fleet()
    view = FleetView(fleet, make_lease([SliceId(1)]))
    mine, other = workers_of(1), workers_of(0)
    assert view.channel(mine[0]) is channels[mine[0]]
    for ask in (view.channel, view.slice_error_of):
        with pytest.raises(errors.InternalError, match="serves none of the lease's slices"):
            ask(other[0])
    with pytest.raises(errors.InternalError):
        view.multicast(fleet.worker_set(mine + other[:1]), c.Free((1,)))
    assert all(not channel.sent for channel in channels.values())

    async def multicast():
        view.multicast(fleet.worker_set(mine), c.Free((2,)))
        fleet.flush()

    asyncio.run(multicast())
    assert [w for w, channel in channels.items() if channel.sent] == mine


def test_the_view_sees_its_own_slices_health_and_backlogs():
    fleet, _ = make_fleet()
    view = FleetView(fleet, make_lease([SliceId(1)], reclaimed=[SliceId(2)]))
    by_slice = {s: [d for d in view.devices if d.slice_index == s] for s in (1, 2)}
    assert isinstance(view.unavailable(by_slice[2]), errors.SliceReclaimed)
    assert view.unavailable(by_slice[1]) is None
    fleet.mark_down(SliceId(0), errors.WorkerLost("slice 0 is down"))
    assert view.unavailable(by_slice[1]) is None and fleet.unavailable(fleet.devices)
    fleet.mark_down(SliceId(1), errors.WorkerLost("slice 1 is down"))
    assert view.unavailable(by_slice[1]) is fleet.slice_error(SliceId(1))
    assert view.slice_error_of(workers_of(1)[0]) is fleet.slice_error(SliceId(1))

    high = fleet.flow.limits.high
    fleet.flow.report(workers_of(0)[0], high)  # another lease's worker is far behind
    assert not fleet.flow.is_open and view.flow.is_open
    fleet.flow.report(workers_of(1)[0], high)
    assert not view.flow.is_open
