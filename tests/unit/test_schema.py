from isthmus.frontend import service  # noqa: F401 - registers handlers
from isthmus.frontend.registry import HANDLERS
from isthmus.protocol import schema as schema_module


def test_schema_has_the_protocol_messages():
    s = schema_module.schema()
    request = s["xla.ifrt.proxy.IfrtRequest"]
    assert "init_request" in request.DESCRIPTOR.fields_by_name
    assert s.has("xla.ifrt.HloShardingProto")
    assert s.has("xla.CompileOptionsProto")


def test_every_request_kind_has_a_handler():
    request = schema_module.schema()["xla.ifrt.proxy.IfrtRequest"]
    kinds = {f.name for f in request.DESCRIPTOR.oneofs_by_name["request"].fields}
    assert kinds - set(HANDLERS) == set(), "request kinds nobody answers"


def test_extraction_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = schema_module.load_file_set()
    assert list(tmp_path.rglob("ifrt-schema-*.pb"))
    assert schema_module.load_file_set() == first
