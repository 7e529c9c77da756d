"""How a `DeviceHost` hands one run of a program to jaxlib: its arguments from the host's
shards, its outputs into them, and the launch id of a run over several devices."""

from __future__ import annotations

from collections.abc import Sequence

from isthmus.compat import jax as jax_compat
from isthmus.compat.jaxlib_types import JaxArray, ShardedToken
from isthmus.ids import BufferId
from isthmus.worker.buffers import BufferStore, ids_of
from isthmus.worker.slots import Loaded

_LAUNCH_IDS = 0x7FFFFFFF  # jaxlib takes a launch id as a positive int32


def launch_id(results: Sequence[int]) -> int | None:
    """The launch id of a run over several devices, the same on every worker of it.

    The processes of a collective meet only when they launch it with the same id. jaxlib's
    own count of launches (0.12.1 and later) agrees only between processes that ran the same
    programs since they started, which a restarted worker or one that outlived a lost slice
    has not; so each run gets its first output's group base instead, which the controller
    gives every worker of the run alike and no other run shares. A program without outputs
    keeps jaxlib's count.
    """
    return results[0] % _LAUNCH_IDS + 1 if results else None


def arguments_one(buffers: BufferStore, args: Sequence[int | Sequence[BufferId]],
                  copy_first: frozenset[int]) -> list[JaxArray]:
    """The arguments of a program on one device: its shards as they are (its one position
    here is 0: an argument's id is its base, or its first id); those in `copy_first` copied,
    so that donation cannot consume them."""
    import jax

    # An int is a group base, the id of its position 0 (no BufferId() call on this path).
    ids: list[BufferId] = [ref if isinstance(ref, int) else ref[0]  # type: ignore[misc]
                           for ref in args]
    values = buffers.values(ids)
    for index in copy_first:
        values[index] = jax.device_put(values[index], values[index].sharding, may_alias=False)
    return values


def run_one(loaded: Loaded, buffers: BufferStore, args: Sequence[int | Sequence[BufferId]],
            results: Sequence[BufferId], copy_first: frozenset[int]) -> None:
    """A program on one device, the common step: its shards go in as they are and each
    output's array is made by a handler made once (no global arrays built and taken apart,
    no sharding made per output: 45 -> 12 us for an 8-argument step in jaxlib); an output's
    id is its base. Raises as the call into jaxlib does, or an argument's own error.

    Without copies, the arguments go in unchecked (`BufferStore.slots_of`): jaxlib refuses
    a deleted array, and anything that is no array, before it runs anything, and the
    checked read then names the argument's own error (failed, donated, absent)."""
    if copy_first:
        values = arguments_one(buffers, args, copy_first)
    else:
        values = buffers.slots_of(args)
    try:
        run = loaded.executable.execute_sharded(values)  # type: ignore[arg-type]
    except Exception:
        if not copy_first:
            arguments_one(buffers, args, copy_first)  # raises why an argument is unusable
        raise
    buffers.store_all(results, run.consume_with_handlers(loaded.result_handlers))


def run_sharded(loaded: Loaded, buffers: BufferStore, args: Sequence[int | Sequence[BufferId]],
                positions: Sequence[int], copy_first: frozenset[int],
                launch: int | None) -> tuple[list[list[JaxArray]], ShardedToken]:
    """A program over several devices: each argument as one array of this host's shards,
    each output taken apart into its shards here; and the run's token. `launch` is the run's
    launch id (`launch_id`)."""
    import jax

    array_impl = jax_compat.jaxlib_extension().ArrayImpl
    arrays = []
    for index, ref in enumerate(args):
        shards = [buffers.value(b) for b in ids_of(ref, positions)]
        if index in copy_first:
            shards = [jax.device_put(s, s.sharding, may_alias=False) for s in shards]
        # A token parameter has no aval: jax passes a bool[0] buffer for it.
        aval = loaded.info.param_avals[index] or shards[0].aval
        # Shards are in the program's device order; jaxlib's own checks would reject the
        # local-only shard lists of a multi-process program.
        arrays.append(array_impl(aval, loaded.arg_shardings[index], shards, True, True))
    outputs = loaded.executable.execute_sharded(arrays, with_tokens=True, launch_id=launch)
    return outputs.disassemble_into_single_device_arrays(), outputs.consume_token()
