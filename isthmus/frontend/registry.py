"""The table from IFRT request kinds (the cases of `IfrtRequest`'s oneof) to their handlers.

Every kind of the schema has its entry here, in the schema's order; a kind isthmus does not
serve has one too, whose handler (unsupported.py) answers it the way the client copes with
best: an empty answer, or an error that says why. tests/unit/test_frontend_dispatch.py walks
the installed jaxlib's schema and fails on a kind without an entry (a newer jaxlib's), so
that it never reaches a client as a generic UNIMPLEMENTED, and on an entry that names a kind
or a field the schema lacks.

A handler is `handler(session, request, response) -> None | Awaitable[None]`: it reads its
part of `request`, fills its part of `response` (the session sets the oneof, to an empty
message, where the handler left it unset) or raises `IsthmusError`. A handler that must wait
(for data, for a computation) returns an awaitable; the session sends the response when it
completes.

A jaxlib newer than the oldest supported one adds kinds; their entries are listed in
`NEWER_KINDS` too, so the table may name kinds an older schema lacks (no client of that
jaxlib can send them).

`array_results` and `future_results` name the request fields that carry client-minted
handles of results: when the request fails, those handles are bound to the error, so the
client's later uses report the real cause rather than "unknown handle".
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from isthmus.frontend import arrays, devices, execute, futures, programs, transfers, unsupported
from isthmus.frontend.session import Entry

# Kinds of a protocol version above isthmus's, by what they would do: jaxlib 0.12.1's
# versions 26..28. Each is refused, naming it (`unsupported.newer_protocol`).
_NEWER = {
    "cancel_execution_request": "cancelling an execution",
    "hash_values_request": "hashing arrays' values",
    "deserialize_loaded_executable_request": "deserializing a compiled executable",
}

HANDLERS: Mapping[str, Entry] = MappingProxyType({
    "init_request": Entry(devices.init),
    "check_future_request": Entry(futures.check_future),
    "check_value_ready_request": Entry(futures.check_value_ready),
    "make_array_from_host_buffer_request": Entry(
        transfers.make_array_from_host_buffer, array_results=("array_handle",)),
    "make_arrays_from_host_buffer_shards_request": Entry(
        transfers.make_arrays_from_host_buffer_shards, array_results=("array_handles",)),
    "make_error_arrays_request": Entry(
        arrays.make_error_arrays, array_results=("array_handles",)),
    "assemble_array_from_single_device_arrays_request": Entry(
        arrays.assemble, array_results=("result_handle",)),
    "remap_arrays_request": Entry(arrays.remap_arrays, array_results=("result_handles",)),
    "bitcast_arrays_request": Entry(arrays.bitcast_arrays, array_results=("result_handles",)),
    "reshard_arrays_request": Entry(arrays.reshard_arrays, array_results=("result_handles",)),
    "copy_to_host_buffer_request": Entry(transfers.copy_to_host_buffer),
    "disassemble_into_single_device_arrays_request": Entry(
        arrays.disassemble, array_results=("result_handles",)),
    "delete_array_request": Entry(arrays.delete_array),
    "copy_arrays_request": Entry(arrays.copy_arrays, array_results=("result_handles",)),
    "fully_replicated_shard_request": Entry(
        arrays.fully_replicated_shard, array_results=("result_handle",)),
    "is_array_deleted_request": Entry(arrays.is_array_deleted),
    "destruct_array_request": Entry(arrays.destruct_array),
    "compile_request": Entry(programs.compile_program),
    "loaded_executable_metadata_request": Entry(programs.metadata),
    "loaded_executable_execute_request": Entry(
        execute.execute, array_results=("result_array_handle",),
        future_results=("result_status_handle",)),
    "loaded_executable_fetch_execute_result_request": Entry(execute.fetch_execute_result),
    "loaded_executable_cost_analysis_request": Entry(programs.cost_analysis),
    "loaded_executable_human_readable_program_text_request": Entry(programs.program_text),
    "loaded_executable_delete_request": Entry(programs.delete_executable),
    "loaded_executable_is_deleted_request": Entry(programs.executable_is_deleted),
    "loaded_executable_destruct_request": Entry(programs.destruct_executable),
    "loaded_executable_mpmd_metadata_request": Entry(unsupported.mpmd_metadata),
    "loaded_executable_mpmd_cost_analysis_request": Entry(unsupported.mpmd_cost_analysis),
    "loaded_host_callback_poll_request": Entry(unsupported.host_callback_poll),
    "loaded_host_callback_return_request": Entry(unsupported.host_callback_return),
    "get_default_device_assignment_request": Entry(devices.default_device_assignment),
    "get_default_layout_request": Entry(devices.default_layout),
    **{kind: Entry(unsupported.newer_protocol(what)) for kind, what in _NEWER.items()},
})

# Kinds some supported jaxlibs lack (their entries stand above all the same).
NEWER_KINDS = frozenset(_NEWER)
