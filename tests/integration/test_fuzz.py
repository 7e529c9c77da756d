"""The protocol fuzzer with valid handles (issue 23) against both backends: a short seeded
run in the default suite, a long one marked slow. No finding may come out (a crash, a hang,
an INTERNAL answer, an OK without its message, a wrong value), and afterwards the stock jax
client still computes correctly on the same server.

When a run reports findings, the report names each with its request; the eleven defects of
issue 23 each have a minimal reproduction in `test_hostile_requests.py`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from isthmus.testing import LocalServer
from tests.integration.fuzzer import Fuzzer, Summary
from tests.integration.harness import compare

BACKENDS = {"embedded": {"devices": 4},
            "fleet": {"devices": None, "fleet": (2, 1, 2)}}
# Requests and a time cap per backend for the default suite (the fleet answers ~5x slower).
SHORT = {"embedded": (1500, 15.0), "fleet": (400, 15.0)}
LONG = {"embedded": (100000, 600.0), "fleet": (40000, 600.0)}


@pytest.fixture(scope="module", params=list(BACKENDS))
def fuzz_server(request: pytest.FixtureRequest) -> Iterator[LocalServer]:
    """A 4-device server whose host-buffer deadline is short (an upload the fuzzer withholds
    costs 2 s, not 10)."""
    with LocalServer(args=["--host-buffer-timeout", "2"], **BACKENDS[request.param]) as s:
        s.kind = request.param
        yield s


def _pids(server: LocalServer) -> list[int]:
    pids = [server.process.pid]
    if server.fleet is not None:
        for slice_index in range(server.fleet[0]):
            pids += server.worker_pids(slice_index)
    return pids


def _fuzz(server: LocalServer, seed: int, requests: int, seconds: float) -> Summary:
    fuzzer = Fuzzer(server.address, seed=seed, sessions=3, timeout=10.0, pids=_pids(server))
    summary = fuzzer.run(requests=requests, seconds=seconds)
    print(summary.report())
    return summary


def _stock_client_still_works(server: LocalServer) -> None:
    compare("""
        import jax, jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
        x = jax.device_put(np.arange(16.0, dtype=np.float32), NamedSharding(mesh, P("d")))
        emit("sum", jax.jit(lambda a: (a * 2).sum())(x))
        emit("y", jax.jit(lambda a: a + 1, out_shardings=NamedSharding(mesh, P()))(x))
    """, server.address)
    assert server.alive(), server.log()


def test_fuzz_short(fuzz_server: LocalServer) -> None:
    requests, seconds = SHORT[fuzz_server.kind]
    summary = _fuzz(fuzz_server, seed=23, requests=requests, seconds=seconds)
    if summary.findings:
        pytest.fail(summary.report(), pytrace=False)
    assert summary.requests >= min(requests, 200), summary.report()
    _stock_client_still_works(fuzz_server)


@pytest.mark.slow
def test_fuzz_long(fuzz_server: LocalServer) -> None:
    requests, seconds = LONG[fuzz_server.kind]
    summary = _fuzz(fuzz_server, seed=2023, requests=requests, seconds=seconds)
    if summary.findings:
        pytest.fail(summary.report(), pytrace=False)
    _stock_client_still_works(fuzz_server)
