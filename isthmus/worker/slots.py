"""The records a `DeviceHost` keeps per buffer and per program, and its small helpers.

A buffer slot holds a jax array, a `HostArray` (IFRT string arrays stay host objects) or a
`Failed` (the error that prevented it); a program slot holds a `Loaded` executable, an
`Unloadable` (why it could not be compiled here) or a colocated `PythonFunction`
(`colocated.Program`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from isthmus import errors
from isthmus.compat import jax as jax_compat
from isthmus.compat.jaxlib_types import (
    JaxArray,
    JaxAval,
    JaxlibClient,
    JaxlibDevice,
    JaxSharding,
    LoadedExecutable,
    ResultHandler,
)
from isthmus.transport import records


def make_cpu_client(num_devices: int, **distributed: object) -> JaxlibClient:
    """A jaxlib CPU client on which every custom call jax lowers to is registered.

    jax registers its CPU custom calls (LAPACK, sparse kernels) lazily, when a CPU client is
    made through `xla_client.make_cpu_client`; importing the modules that own them first
    queues their registrations.
    """
    import jax

    # LAPACK kernels find their functions (scipy's) at initialisation, which jax does while
    # lowering; a server that only runs programs must do it itself or call null pointers.
    jax_compat.initialize_lapack()
    try:
        import jax.experimental.sparse  # noqa: F401 - registers the CPU sparse kernels
    except ImportError:  # pragma: no cover - an optional part of jax
        pass
    return jax_compat.xla_client().make_cpu_client(asynchronous=True, num_devices=num_devices,
                                                   **distributed)


def computation_error(e: BaseException) -> errors.IsthmusError:
    """The error of a failed computation, as the user should see it: a collective whose
    transport lost a peer is that peer's loss (DATA_LOSS), not an execution error."""
    if isinstance(e, errors.IsthmusError):
        return e
    text = str(e)
    if errors.is_peer_failure(text):
        detail = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        return errors.PeerFailure(
            f"the computation producing this array lost a peer of its collective group "
            f"({detail[:300]})")
    return errors.from_runtime_error(
        e, errors.ExecutionError, "the computation producing this array failed")


class Failed:
    """A buffer slot that holds the error which prevented its creation."""

    __slots__ = ("error",)

    def __init__(self, error: errors.IsthmusError) -> None:
        self.error = error


class HostArray:
    """A string array: IFRT keeps these as host objects; no program can take them."""

    __slots__ = ("value", "_deleted")

    def __init__(self, value: np.ndarray) -> None:
        self.value = value
        self._deleted = False

    @property
    def nbytes(self) -> int:
        return sum(len(x) for x in self.value.flat)

    def is_ready(self) -> bool:
        return True

    def block_until_ready(self) -> HostArray:
        return self

    def is_deleted(self) -> bool:
        return self._deleted

    def delete(self) -> None:
        self._deleted = True

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None
                  ) -> np.ndarray:
        return self.value


@dataclasses.dataclass(slots=True)
class Loaded:
    executable: LoadedExecutable
    info: records.CompiledInfo
    devices: tuple[JaxlibDevice, ...]  # of the whole program, in its order
    arg_shardings: tuple[JaxSharding, ...]  # per parameter: to wrap shards with
    positions: tuple[int, ...]  # positions (in the program's device list) held here
    # Global ids of the program's devices when some are on other hosts (None: all here).
    span: frozenset[int] | None = None
    # A program on one device: per output, what makes its array from the output buffer
    # (`programs.result_handlers`; None: outputs taken apart as jaxlib returns them).
    result_handlers: list[ResultHandler] | None = None  # a list, as jaxlib takes it


@dataclasses.dataclass(slots=True)
class Unloadable:
    error: errors.IsthmusError  # why the program could not be compiled here
    positions: tuple[int, ...]  # its positions held here, whose outputs get the error


# What a buffer slot holds (`buffers.py`): an array (stored), a host array, or an error.
Slot: TypeAlias = "JaxArray | HostArray | Failed"


class Settling(Protocol):
    """What `block_all` waits for: an array, or a collective program in flight."""

    def block_until_ready(self) -> object: ...

    def is_deleted(self) -> bool: ...


async def failing(error: errors.IsthmusError) -> NoReturn:
    raise error


def failed_now(error: errors.IsthmusError) -> asyncio.Future[None]:
    """A future that has failed already with `error` (see `already_done`)."""
    future = asyncio.get_running_loop().create_future()
    future.set_exception(error)
    return future


def already_done() -> asyncio.Future[None]:
    """An awaitable that is done already: a future, so that gathering it makes no task and
    a caller may see at once that it is done."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


def settle_quietly(value: JaxArray) -> None:
    try:
        value.block_until_ready()
    except Exception:  # noqa: BLE001 - the caller reads the error from the value
        pass


def block_all(values: Sequence[Settling]) -> None:
    """Waits until each array is computed; returns at the first that failed (the caller
    reads the error), passing over one donated meanwhile (its consumer waits for it)."""
    for value in values:
        try:
            value.block_until_ready()
        except Exception:  # noqa: BLE001 - reported by the caller's second pass
            if not value.is_deleted():
                return


async def first_of(event: asyncio.Event, other: Awaitable[object]) -> None:
    """Waits for `other` or for `event`, whichever comes first."""
    waits = [asyncio.ensure_future(other), asyncio.ensure_future(event.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    waits[1].cancel()


@functools.cache
def _jax_put() -> tuple[Callable[..., JaxAval], Callable[..., JaxArray]]:
    import jax

    return jax.core.ShapedArray, jax_compat.batched_device_put()


def place(value: np.ndarray, sharding: JaxSharding, device: JaxlibDevice) -> JaxArray:
    """Host data on one device (`sharding` its SingleDeviceSharding), as jax.device_put
    places a numpy array: the call its numpy handler makes, without the argument handling
    around it (4 µs a small shard instead of 30)."""
    shaped_array, batched_device_put = _jax_put()
    return batched_device_put(shaped_array(value.shape, value.dtype), sharding, [value],
                              [device])


def move(value: JaxArray, target: JaxSharding) -> JaxArray:
    """A copy of a jax array in `target` (a SingleDeviceSharding). Between the two clients of
    an accelerator host (an accelerator and its colocated CPU device) PjRt copies through
    host memory itself; where a plugin refuses that, the copy goes through numpy here."""
    import jax

    try:
        return jax.device_put(value, target, may_alias=False)
    except Exception:
        (device,) = target.device_set
        if next(iter(value.devices())).client is device.client:
            raise
        return place(np.asarray(value), target, device)
