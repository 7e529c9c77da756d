"""The table from request kinds to handlers (frontend/registry.py) against the installed
jaxlib's schema: every kind has its entry, every entry names a kind and fields that exist.
And the table from an executable's plan kinds to their runners (frontend/execute.py)."""

import asyncio

import pytest
from google.protobuf.descriptor import FieldDescriptor

from isthmus.controller.controller import Controller, ControllerConfig
from isthmus.frontend.registry import HANDLERS, NEWER_KINDS
from isthmus.frontend.service import Frontend
from isthmus.head import embedded_fleet
from isthmus.protocol.schema import schema

UNIMPLEMENTED = 12
HANDLE_TYPES = {FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64,
                FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64}


def _kinds(message: str, oneof: str) -> list[str]:
    descriptor = schema()[message].DESCRIPTOR
    return [field.name for field in descriptor.oneofs_by_name[oneof].fields]


def _plan_kinds() -> set[type]:
    """Every class of the server's layers that is a `controller.ProgramPlan`: it says whether
    it is private and whether it runs on the hosts."""
    import importlib
    import inspect
    import pkgutil

    kinds = set()
    for package in ("isthmus.controller", "isthmus.transport", "isthmus.frontend"):
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            name = f"{package}.{info.name}"
            module = importlib.import_module(name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == name and all(isinstance(getattr(cls, flag, None), bool)
                                                  for flag in ("private", "on_hosts")):
                    kinds.add(cls)
    return kinds


def test_every_plan_kind_has_a_runner_and_the_hosts_load_those_they_run():
    from isthmus.frontend.execute import RUNNERS
    from isthmus.transport.records import ColocatedProgram, CompileRequest

    kinds = _plan_kinds()
    assert len(kinds) >= 6, kinds  # the discovery finds the kinds at all
    assert {k.__name__ for k in kinds - set(RUNNERS)} == set(), "plans without a runner"
    assert {k.__name__ for k in set(RUNNERS) - kinds} == set(), "runners of no plan"
    # `Controller.executable` sends an `on_hosts` plan to the hosts as a program they load.
    for kind in kinds:
        assert kind.on_hosts == issubclass(kind, (CompileRequest, ColocatedProgram)), kind
    assert not CompileRequest.private and ColocatedProgram.private


def test_every_request_kind_of_the_schema_has_an_entry():
    missing = [kind for kind in _kinds("xla.ifrt.proxy.IfrtRequest", "request")
               if kind not in HANDLERS]
    assert missing == [], (
        "request kinds of this jaxlib without an entry in frontend/registry.py (give each a "
        f"handler, or one in frontend/unsupported.py that refuses it in words): {missing}")


def test_every_entry_names_a_request_kind_of_the_schema():
    kinds = set(_kinds("xla.ifrt.proxy.IfrtRequest", "request"))
    assert sorted(set(HANDLERS) - kinds - NEWER_KINDS) == []
    assert NEWER_KINDS <= set(HANDLERS)


def test_every_request_kind_has_its_response_kind():
    # The session answers a kind `x_request` with `x_response` (set empty when the handler
    # left it unset).
    requests = set(_kinds("xla.ifrt.proxy.IfrtRequest", "request"))
    responses = set(_kinds("xla.ifrt.proxy.IfrtResponse", "response"))
    assert [kind for kind in HANDLERS if kind in requests
            and kind.removesuffix("_request") + "_response" not in responses] == []


def test_result_handle_fields_are_handle_fields_of_their_request():
    request = schema()["xla.ifrt.proxy.IfrtRequest"].DESCRIPTOR
    wrong = []
    for kind, entry in HANDLERS.items():
        if kind not in request.fields_by_name:
            continue  # a kind of a newer jaxlib (NEWER_KINDS)
        body = request.fields_by_name[kind].message_type
        for name in entry.array_results + entry.future_results:
            field = body.fields_by_name.get(name)
            if field is None or field.type not in HANDLE_TYPES:
                wrong.append(f"{kind}.{name}")
    assert wrong == []


def _answers(handlers, fill_requests):
    """The responses of a session of `handlers` to requests made by `fill_requests`."""

    async def main():
        fleet, _ = embedded_fleet(1)
        frontend = Frontend(Controller(fleet, ControllerConfig(host_buffer_timeout=1)),
                            schema())
        frontend.handlers = handlers
        metadata = schema()["xla.ifrt.proxy.GrpcIfrtSessionMetadata"]()
        metadata.version.protocol_version = 25
        metadata.version.ifrt_serdes_version_number = 3
        sent = []
        session = frontend.open_session(metadata.SerializeToString(), sent.append)
        for op_id, fill in enumerate(fill_requests, start=7):
            request = schema()["xla.ifrt.proxy.IfrtRequest"]()
            request.request_metadata.op_id = op_id
            fill(request)
            session.handle(request)
        await session.close()
        return sent

    return asyncio.run(main())


def test_a_kind_without_an_entry_is_answered_unimplemented_naming_it():
    """What a newer client's request kind meets (XLA's server answers it the same way)."""
    sent = _answers({k: v for k, v in HANDLERS.items() if k != "init_request"},
                    [lambda r: r.init_request.SetInParent(), lambda r: None])
    assert [r.response_metadata.op_id for r in sent] == [7, 8]
    assert [r.response_metadata.status.code for r in sent] == [UNIMPLEMENTED] * 2
    assert "init_request" in sent[0].response_metadata.status.message
    assert "(empty)" in sent[1].response_metadata.status.message


@pytest.mark.parametrize("kind", sorted(NEWER_KINDS))
def test_a_kind_of_a_newer_protocol_is_refused_naming_the_versions(kind):
    if kind not in _kinds("xla.ifrt.proxy.IfrtRequest", "request"):
        pytest.skip(f"this jaxlib has no {kind}")
    sent = _answers(HANDLERS, [lambda r: getattr(r, kind).SetInParent()])
    status = sent[0].response_metadata.status
    assert status.code == UNIMPLEMENTED
    assert "protocol version above 25" in status.message
    assert "negotiated version 25" in status.message
