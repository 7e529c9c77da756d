"""Colocated Python on a host: jax's `colocated_python` calls, run next to their shards.

The stock client sends a colocated function as a `CustomCallProgram`: cloudpickled code (the
function and its input and output specs) with the devices it runs on. The controller never
unpickles it; each host of the call does, here, and runs the function on its own shards:

- *Devices by global id.* jax's pickles name devices by id. While a host unpickles (and while
  the function pickles specs back for the client), `serialization`'s device lookups are
  pointed at this host's devices by their global (fleet-wide) ids, so a `Mesh` or a sharding
  in the code becomes the same devices here, addressable or not (a worker's client spans the
  whole collective group), and specs pickled here name the ids the client knows.
- *Arrays without copies.* Inputs are jax arrays built over the host's own shard buffers;
  a call over several hosts sees global arrays whose addressable shards are the local ones,
  as a multi-process jax program does.
- *Order.* Calls from one client thread (one IFRT execution stream) run one after another,
  in program order; calls from different threads run concurrently, each on a thread of the
  host's Python pool.

Outputs are placeholders (`Pending`) until the call finishes; the controller dispatches
nothing that reads them before it hears that the call is done. A call outlives a re-formation
of the collective group: its outputs land in the new group's client (`python_calls.py`), as
do the arrays its Python kept from the old one (`_from_an_earlier_group`).
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypedDict

import numpy as np
import numpy.typing as npt

from isthmus import errors
from isthmus.compat import jax as jax_compat
from isthmus.compat.jaxlib_types import JaxArray, JaxlibClient, JaxlibDevice
from isthmus.transport.records import ColocatedProgram
from isthmus.worker.buffers import BufferStore
from isthmus.worker.slots import HostArray, Loaded, Slot, Unloadable, computation_error

if TYPE_CHECKING:
    import jax
    from jax.tree_util import PyTreeDef


MAX_TRACEBACK_CHARS = 6000


class CallsHost(Protocol):
    """The colocated calls of the host that took a placeholder over (`python_calls.PythonCalls`
    of a re-formed group's host)."""

    buffers: BufferStore
    devices: dict[int, JaxlibDevice]  # by global id


class Pending:
    """An output of a colocated call still running: ready once the call has stored it.
    `moved_to`: the host of a re-formed group that took its slot over while the call ran
    (`PythonCalls.take_calls`); None while it is where the call began."""

    __slots__ = ("_event", "value", "moved_to")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.value: Slot | None = None
        self.moved_to: CallsHost | None = None

    def resolve(self, value: Slot) -> None:
        self.value = value
        self._event.set()

    def resolved(self) -> bool:
        return self._event.is_set()

    @property
    def nbytes(self) -> int:
        return 0

    def is_ready(self) -> bool:
        return self._event.is_set() and self.value.is_ready()

    def is_deleted(self) -> bool:
        return False

    def block_until_ready(self) -> object:
        self._event.wait()
        if hasattr(self.value, "error"):
            raise self.value.error
        return self.value.block_until_ready()

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None
                  ) -> np.ndarray:
        self.block_until_ready()
        return np.asarray(self.value)


# ---- device lookups by global id -----------------------------------------------------------

class _Devices(TypedDict):
    by_id: dict[int, JaxlibDevice]  # by global id
    ids: dict[JaxlibDevice, int]  # ... and back


_current: _Devices = {"by_id": {}, "ids": {}}
_patch_lock = threading.RLock()
# The global ids of the devices of every client still alive that this host pointed at, by
# client: those of an earlier collective group too. Its arrays outlive the group when a call
# ran across a re-formation or kept them (jax's result store between a call that finds its
# output specs and the call that pops its result; a colocated object's state).
_earlier: weakref.WeakKeyDictionary[JaxlibClient, dict[int, int]] = (
    weakref.WeakKeyDictionary())


def use_devices(devices: dict[int, JaxlibDevice]) -> None:
    """Points jax's colocated-Python (de)serialization at these devices, by global id."""
    _current["by_id"] = dict(devices)
    _current["ids"] = {d: g for g, d in devices.items()}
    with _patch_lock:
        for g, d in devices.items():
            _earlier.setdefault(d.client, {})[d.id] = g
        jax_compat.point_colocated_devices(lambda: _current["by_id"], _global_id)


def _global_id(device: JaxlibDevice) -> int:
    found = _current["ids"].get(device)
    if found is None:
        found = _earlier.get(device.client, {}).get(device.id)
    if found is None:
        raise ValueError(f"device {device} is not one of this host's devices")
    return found


@dataclasses.dataclass(slots=True)
class PythonFunction:
    """A colocated program unpickled on this host."""

    program: ColocatedProgram
    fun: Callable[..., object]
    in_tree: PyTreeDef
    in_specs: tuple[jax.ShapeDtypeStruct, ...]
    local_in: tuple[tuple[int, ...], ...]  # per input: its positions held here
    local_out: tuple[tuple[int, ...], ...]  # per output: likewise
    local_devices: frozenset[JaxlibDevice]  # the call's devices held here


# What a host's program table holds (`DeviceHost._executables`): a program loaded, one that
# could not be, or a colocated Python function (`python_calls.py`).
Program: TypeAlias = Loaded | Unloadable | PythonFunction


def user_error(name: str, e: BaseException) -> errors.IsthmusError:
    """A Python exception raised by user code, with its type, message and traceback."""
    if isinstance(e, errors.IsthmusError):
        return e
    for suffix in ("_output_specs_and_push_result", "_pop_result"):  # jax's helper programs
        name = name.removesuffix(suffix)
    frames = e.__traceback__.tb_next if e.__traceback__ is not None else None  # not ours
    text = "".join(traceback.format_exception(type(e), e, frames))
    if len(text) > MAX_TRACEBACK_CHARS:
        text = "...\n" + text[-MAX_TRACEBACK_CHARS:]
    return errors.UserCodeError(
        f"the colocated Python function {name!r} raised {type(e).__name__}: {e}\n{text}")


def load(program: ColocatedProgram, devices: dict[int, JaxlibDevice], local: set[JaxlibDevice]
         ) -> PythonFunction:
    """Unpickles a program for this host's devices (blocking: it may import modules)."""
    use_devices(devices)
    try:
        with _patch_lock:  # unpickling imports modules: one at a time (jax 0.12 does too)
            fun, in_tree, in_specs, _, _, _ = jax_compat.deserialize_colocated(program.text)
    except jax_compat.JaxInternalMissing as e:
        raise errors.CompileError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a module missing here, a version skew, ...
        raise errors.CompileError(
            f"the colocated Python function {program.name!r} could not be unpickled on the "
            f"worker ({type(e).__name__}: {e}); install the modules it uses on every worker, "
            "with the same versions as the client.") from None

    def held(ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(p for p, g in enumerate(ids) if g in devices and devices[g] in local)

    return PythonFunction(program, fun, in_tree, tuple(in_specs),
                     tuple(held(ids) for ids in program.inputs),
                     tuple(held(ids) for ids in program.outputs),
                     frozenset(devices[program.device_ids[p]] for p in held(program.device_ids)))


def run(function: PythonFunction, devices: dict[int, JaxlibDevice],
        inputs: Sequence[Sequence[JaxArray | HostArray]]) -> list[list[JaxArray | HostArray]]:
    """Calls the function on this host's shards (blocking); returns, per output, the values
    of its local positions."""
    import jax
    from jax import tree_util

    program = function.program
    use_devices(devices)
    leaves = []
    for index, (spec, shards) in enumerate(zip(function.in_specs, inputs)):
        positions = function.local_in[index]
        values = [_device_value(s, devices[program.inputs[index][p]])
                  for s, p in zip(shards, positions)]
        for value in values:
            try:
                value.block_until_ready()
            except Exception as e:  # noqa: BLE001 - the input's own failure, not the call's
                raise computation_error(e) from None
        leaves.append(jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, values))
    args, kwargs = tree_util.tree_unflatten(function.in_tree, leaves)
    # Arrays the function makes without naming a device (jnp.array(0)) go to the call's first
    # device here, not to a jax backend of this process that the fleet does not know.
    local = [devices[g] for g in program.device_ids if devices[g] in function.local_devices]
    try:
        with jax.default_device(local[0] if local else None):
            result = function.fun(*args, **kwargs)
        outputs = tree_util.tree_leaves(result)
        if len(outputs) != len(program.outputs):
            raise ValueError(f"it returned {len(outputs)} arrays but its output specs list "
                             f"{len(program.outputs)}")
        per_output = []
        for index, out in enumerate(outputs):
            per_output.append(_local_shards(program, index, function.local_out[index], out,
                                            devices))
        return per_output
    except Exception as e:  # noqa: BLE001 - the user's exception, reported to the client
        raise user_error(program.name, e) from None


def _device_value(value: JaxArray | HostArray, device: JaxlibDevice) -> JaxArray:
    """A shard as the user function sees it: string arrays become StringDType jax arrays."""
    import jax

    if hasattr(value, "value") and getattr(value.value, "dtype", None) == np.dtype(object):
        strings = np.array([x.decode() if isinstance(x, bytes) else str(x)
                            for x in value.value.flat], dtype=np.dtypes.StringDType())
        return jax.device_put(strings.reshape(value.value.shape), device)
    return value


def _local_shards(program: ColocatedProgram, index: int, positions: Sequence[int],
                  out: object, devices: dict[int, JaxlibDevice]) -> list[JaxArray | HostArray]:
    import jax

    dtype_name, shape = program.output_types[index]
    if not isinstance(out, jax.Array):
        raise TypeError(f"output {index} is a {type(out).__name__}, not a jax.Array")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"output {index} has shape {list(out.shape)} but its spec says "
                         f"{list(shape)}")
    is_string = dtype_name == "string"
    if not is_string and np.dtype(out.dtype).name != dtype_name:
        raise ValueError(f"output {index} is {out.dtype} but its spec says {dtype_name}")
    by_device = {shard.device: shard.data for shard in out.addressable_shards}
    values: list[JaxArray | HostArray] = []
    for p in positions:
        device = devices[program.outputs[index][p]]
        shard = by_device.get(device)
        if shard is None:
            shard = _from_an_earlier_group(out, program.outputs[index][p], device)
        if shard is None:
            raise ValueError(f"output {index} has no shard on {device}, which its spec names")
        if is_string:
            host = np.asarray(shard)
            shard = HostArray(np.array([str(x).encode() for x in host.flat],
                                       dtype=object).reshape(host.shape))
        values.append(shard)
    return values


def _from_an_earlier_group(out: jax.Array, global_id: int, device: JaxlibDevice
                           ) -> JaxArray | None:
    """`out`'s shard on device `global_id` of an earlier collective group's client, copied
    onto `device` of this group's (which `regroup.move_buffers` did for stored buffers), or
    None when it has none there."""
    import jax
    from jax.sharding import SingleDeviceSharding

    for shard in out.addressable_shards:
        held = shard.device
        if held.client is not device.client and _earlier.get(held.client, {}).get(
                held.id) == global_id:
            return jax.device_put(np.asarray(shard.data), SingleDeviceSharding(
                device, memory_kind=shard.data.sharding.memory_kind))
    return None
