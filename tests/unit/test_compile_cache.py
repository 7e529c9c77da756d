"""The persistent compilation cache on a real jaxlib CPU client: a stored executable loads
and computes the same result; damaged, foreign or half-written entries are ignored and
replaced, never a crash; concurrent writers leave a whole entry; the size limit evicts the
least recently used; namespaces do not see each other."""

import dataclasses
import functools
import os
import threading
import time

import numpy as np
import pytest

from isthmus.compat import jax as jax_compat
from isthmus.transport import records
from isthmus.worker import programs
from isthmus.worker.compile_cache import CacheConfig, CompileCache, KeptExecutables, parse_size
from isthmus.worker.slots import make_cpu_client


@pytest.fixture(scope="module")
def client():
    return make_cpu_client(2)


@functools.cache
def module(scale: float) -> bytes:
    """A program's bytes (made once: jax writes the caller's source location into them)."""
    import jax
    import jax.numpy as jnp
    from jax._src.interpreters import mlir

    lowered = jax.jit(lambda x: jnp.tanh(x * scale) + 1).lower(np.ones((4, 4), np.float32))
    return mlir.module_to_bytecode(lowered.compiler_ir("stablehlo"))


def request(scale: float = 2.0):
    xc = jax_compat.xla_client()
    return records.CompileRequest(module(scale), xc.CompileOptions().SerializeAsString(),
                                   (0,), 1)


def run(client, executable):
    import jax

    x = jax.device_put(np.arange(16, dtype=np.float32).reshape(4, 4), client.devices()[0])
    out = executable.execute_sharded([x]).disassemble_into_single_device_arrays()[0][0]
    return np.asarray(out)


def compile_with(client, cache, req):
    return programs.compile_program(client, client.devices()[:1], req, cache)[0]


def entries(cache_dir, namespace="default"):
    return sorted(p for p in os.listdir(os.path.join(cache_dir, namespace))
                  if p.endswith(".xla"))


def test_a_stored_executable_loads_and_computes_the_same(client, tmp_path):
    expected = np.tanh(np.arange(16, dtype=np.float32).reshape(4, 4) * 2) + 1
    first = CompileCache(CacheConfig(str(tmp_path)))
    np.testing.assert_allclose(run(client, compile_with(client, first, request())), expected,
                               rtol=1e-6)
    assert (first.hits, first.misses) == (0, 1) and len(entries(tmp_path)) == 1
    second = CompileCache(CacheConfig(str(tmp_path)))  # as after a restart
    np.testing.assert_allclose(run(client, compile_with(client, second, request())), expected,
                               rtol=1e-6)
    assert (second.hits, second.misses) == (1, 0)
    # Another program is another entry.
    compile_with(client, second, request(3.0))
    assert len(entries(tmp_path)) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_a_damaged_entry_is_replaced(client, tmp_path, damage):
    cache = CompileCache(CacheConfig(str(tmp_path)))
    compile_with(client, cache, request())
    (name,) = entries(tmp_path)
    path = tmp_path / "default" / name
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    else:  # a whole, checksummed entry that this jaxlib cannot load
        import hashlib

        from isthmus.worker.compile_cache import FORMAT

        junk = b"not an executable" * 10
        path.write_bytes(FORMAT + hashlib.sha256(junk).digest() + junk)
    again = CompileCache(CacheConfig(str(tmp_path)))
    expected = np.tanh(np.arange(16, dtype=np.float32).reshape(4, 4) * 2) + 1
    np.testing.assert_allclose(run(client, compile_with(client, again, request())), expected,
                               rtol=1e-6)
    assert again.rejected == 1 and again.hits == 0
    third = CompileCache(CacheConfig(str(tmp_path)))
    compile_with(client, third, request())
    assert third.hits == 1


def test_concurrent_writers_leave_a_whole_entry(client, tmp_path):
    cache = CompileCache(CacheConfig(str(tmp_path)))
    req = request()
    errors = []

    def write():
        try:
            for _ in range(5):
                compile_with(client, CompileCache(CacheConfig(str(tmp_path))), req)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(4)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors
    assert len(entries(tmp_path)) == 1
    assert not [p for p in os.listdir(tmp_path / "default") if ".tmp-" in p]
    compile_with(client, cache, req)
    assert cache.hits == 1


def test_the_size_limit_evicts_the_least_recently_used(client, tmp_path):
    probe = CompileCache(CacheConfig(str(tmp_path / "probe")))
    compile_with(client, probe, request(1.0))
    size = os.path.getsize(tmp_path / "probe" / "default" / entries(tmp_path / "probe")[0])
    cache = CompileCache(CacheConfig(str(tmp_path), max_bytes=int(size * 2.5)))
    compile_with(client, cache, request(1.0))
    time.sleep(0.05)  # each use a later modification time: the order the cache evicts in
    compile_with(client, cache, request(2.0))
    time.sleep(0.05)
    compile_with(client, cache, request(1.0))  # a hit: 1.0 is now the most recent
    time.sleep(0.05)
    compile_with(client, cache, request(3.0))  # over the limit: 2.0 goes
    assert cache.hits == 1 and len(entries(tmp_path)) == 2
    fresh = CompileCache(CacheConfig(str(tmp_path), max_bytes=int(size * 2.5)))
    compile_with(client, fresh, request(1.0))
    compile_with(client, fresh, request(3.0))
    assert fresh.hits == 2


def test_namespaces_do_not_share_entries(client, tmp_path):
    compile_with(client, CompileCache(CacheConfig(str(tmp_path), "alice")), request())
    bob = CompileCache(CacheConfig(str(tmp_path), "bob"))
    compile_with(client, bob, request())
    assert bob.hits == 0 and len(entries(tmp_path, "alice")) == len(entries(tmp_path, "bob"))


def test_an_fsspec_url_works(client):
    location = f"memory://isthmus-test-{os.getpid()}"
    compile_with(client, CompileCache(CacheConfig(location)), request())
    again = CompileCache(CacheConfig(location))
    compile_with(client, again, request())
    assert again.hits == 1


def test_options_are_checked():
    assert parse_size("4G", "x") == 4 << 30 and parse_size("512MiB", "x") == 512 << 20
    for bad in ("0", "-1G", "lots"):
        with pytest.raises(ValueError, match="--compile-cache-size"):
            parse_size(bad, "--compile-cache-size")
    for namespace in ("", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="namespace"):
            CacheConfig("/tmp/x", namespace)


def test_a_shared_services_tenants_do_not_share_entries(client, tmp_path):
    """One cache (one --compile-cache namespace), two tenants of a shared service: the
    request's namespace keys the entry, so one tenant never loads the other's."""
    import dataclasses

    cache = CompileCache(CacheConfig(str(tmp_path)))
    compile_with(client, cache, dataclasses.replace(request(), namespace="alice"))
    compile_with(client, cache, dataclasses.replace(request(), namespace="bob"))
    assert cache.hits == 0 and len(entries(tmp_path)) == 2
    compile_with(client, cache, dataclasses.replace(request(), namespace="bob"))
    assert cache.hits == 1


# ---- executables kept in a worker's memory across its collective groups --------------------

def test_kept_executables_load_on_a_new_client_and_compute_the_same():
    # A re-formed group is a new client: what the old one compiled loads on it.
    old, new = make_cpu_client(2), make_cpu_client(2)
    expected = np.tanh(np.arange(16, dtype=np.float32).reshape(4, 4) * 2) + 1
    kept = KeptExecutables()
    compile_with(old, kept, request())
    kept.flush()  # written in a thread of its own, after the compile
    assert kept.stats()["kept_executable_bytes"] > 0
    np.testing.assert_allclose(run(new, compile_with(new, kept, request())), expected,
                               rtol=1e-6)
    assert (kept.hits, kept.misses) == (1, 1)
    # Another group shape is another key: compiled, not loaded.
    programs.compile_program(new, new.devices()[1:2],
                             dataclasses.replace(request(), device_ids=(1,)), kept)
    assert kept.hits == 1


def test_kept_executables_are_bounded_least_recently_used_first(client):
    kept = KeptExecutables(max_bytes=1)
    compile_with(client, kept, request())
    kept.flush()
    assert kept.stats()["kept_executable_bytes"] == 0  # larger than the bound: not kept
    size = len(client.serialize_executable(compile_with(client, None, request())))
    kept = KeptExecutables(max_bytes=int(size * 2.5))
    for scale in (2.0, 3.0, 4.0):
        compile_with(client, kept, request(scale))
        kept.flush()
        if scale == 3.0:
            compile_with(client, kept, request(2.0))  # used again: newer than 3.0
    assert kept.hits == 1 and kept.stats()["kept_executable_bytes"] <= size * 2.5
    compile_with(client, kept, request(2.0))
    assert kept.hits == 2  # kept; 3.0, the least recently used, went
    compile_with(client, kept, request(3.0))
    assert kept.hits == 2


def test_a_kept_executable_that_does_not_load_is_compiled_again(client, caplog):
    kept = KeptExecutables()
    compile_with(client, kept, request())
    kept.flush()
    with kept._lock:
        (key,) = kept._entries
        kept._entries[key] = b"not an executable"
    expected = np.tanh(np.arange(16, dtype=np.float32).reshape(4, 4) * 2) + 1
    np.testing.assert_allclose(run(client, compile_with(client, kept, request())), expected,
                               rtol=1e-6)
    assert kept.hits == 0 and "does not load" in caplog.text
    kept.flush()
    compile_with(client, kept, request())
    assert kept.hits == 1  # kept again, whole


def test_kept_executables_write_through_to_the_persistent_cache(client, tmp_path):
    kept = KeptExecutables(CompileCache(CacheConfig(str(tmp_path))))
    compile_with(client, kept, request())
    kept.flush()  # written after the compile's answer, in a thread of its own
    assert len(entries(tmp_path)) == 1
    # A fresh process (nothing kept) finds it below.
    fresh = KeptExecutables(CompileCache(CacheConfig(str(tmp_path))))
    compile_with(client, fresh, request())
    assert fresh.stats() == {"compile_cache_hits": 1, "compile_cache_misses": 0,
                                  "compile_cache_rejected": 0, "kept_executable_hits": 0,
                                  "kept_executable_bytes": 0}


# ---- the vetting process's record beside the cache (controller/vetted_record.py) -------------

def test_the_vetted_record_keeps_programs_and_trial_marks(tmp_path):
    from isthmus.controller.vetted_record import VettedRecord, marked

    record = VettedRecord(CacheConfig(str(tmp_path)))
    raw, digest = b"r" * 64, b"d" * 32
    assert record.program(raw) is None and record.hits == 0
    record.remember(raw, b"the vetted program", digest)
    assert VettedRecord(CacheConfig(str(tmp_path))).program(raw) == (
        b"the vetted program", digest)  # a restarted server finds it
    assert not marked(record.location, digest, b"options")
    record.mark(digest, b"options")
    assert marked(record.location, digest, b"options")
    assert not marked(record.location, digest, b"other options")
    assert not marked(record.location, b"e" * 32, b"options")
    # A damaged entry is a miss, never another program.
    (entry,) = (tmp_path / ".vetted" / "programs").iterdir()
    data = bytearray(entry.read_bytes())
    data[-5] ^= 1
    entry.write_bytes(bytes(data))
    assert record.program(raw) is None
    entry.write_bytes(b"garbage")
    assert record.program(raw) is None


def test_the_vetted_record_is_apart_per_jaxlib_version(tmp_path, monkeypatch):
    import jaxlib

    from isthmus.controller.vetted_record import VettedRecord, marked

    record = VettedRecord(CacheConfig(str(tmp_path)))
    record.remember(b"r" * 64, b"program", b"d" * 32)
    record.mark(b"d" * 32, b"options")
    monkeypatch.setattr(jaxlib, "__version__", "0.0.0-another")
    other = VettedRecord(CacheConfig(str(tmp_path)))
    assert other.program(b"r" * 64) is None
    assert not marked(other.location, b"d" * 32, b"options")
