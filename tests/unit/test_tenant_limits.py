"""A shared service's per-tenant limits (tenants file fields, `frontend/tenant_limits.py`) and
the per-peer limits of strangers (`wire/peers.py`), without sockets."""

from __future__ import annotations

import pytest

from isthmus import errors
from isthmus.controller.tenants import DEFAULT_MAX_UPLOAD_BYTES, parse, token_digest
from isthmus.frontend.tenant_limits import Pace, UploadBudget
from isthmus.wire.peers import Limits, PeerBook, _key


def tenants(top: str = "", alice: str = ""):
    import tomllib

    return parse(tomllib.loads(f"""
{top}
[tenants.alice]
token_sha256 = "{token_digest('a')}"
max_slices = 1
{alice}
[tenants.bob]
token_sha256 = "{token_digest('b')}"
max_slices = 1
"""), path="tenants.toml")


def test_limits_are_the_tenants_or_the_files_defaults():
    plain = tenants()
    assert plain.by_name["alice"].max_upload_bytes == DEFAULT_MAX_UPLOAD_BYTES
    chosen = tenants("max_upload_bytes = 1000\nmax_requests_per_second = 50",
                     "max_upload_bytes = 10")
    assert chosen.by_name["alice"].max_upload_bytes == 10
    assert chosen.by_name["bob"].max_upload_bytes == 1000
    assert chosen.by_name["bob"].max_requests_per_second == 50.0
    with pytest.raises(ValueError, match=r"\[tenants.alice\]: max_upload_bytes"):
        tenants(alice="max_upload_bytes = -1")
    with pytest.raises(ValueError, match="max_requests_per_second must be a number > 0"):
        tenants("max_requests_per_second = 0")


def test_an_upload_over_the_budget_names_the_setting_and_counts_nothing():
    budget = UploadBudget(tenants(alice="max_upload_bytes = 100").by_name["alice"],
                          "tenants.toml")
    budget.take(60)
    with pytest.raises(errors.TooLarge, match="max_upload_bytes of 100") as refused:
        budget.take(41)
    assert refused.value.code is errors.Code.RESOURCE_EXHAUSTED
    assert budget.held == 60
    budget.give(60)
    budget.take(100)


def test_a_pace_lets_one_seconds_worth_through_then_asks_to_wait():
    pace = Pace(10.0)
    assert [pace.spend() for _ in range(10)] == [0.0] * 10
    assert pace.spend() == pytest.approx(0.1 + 0.01, abs=0.02)


def test_a_peer_is_refused_over_its_connections_and_its_rate():
    book = PeerBook(Limits(auth_seconds=5, peer_connections=2, peer_requests=3))
    first, second = book.admit("10.0.0.1", False), book.admit("10.0.0.1", False)
    assert first is not None and second is not None
    assert book.admit("10.0.0.1", False) is None  # a third at once
    assert book.admit("10.0.0.2", False) is not None  # another host
    first.release()
    # Three tokens a second: two went to the connections (the third was refused unspent).
    assert second.spend() and not second.spend()
    assert book.admit("127.0.0.1", True) is not None  # this machine is not counted
    assert _key("2001:db8::1") == _key("2001:db8::2") == "2001:db8::/64"
    assert _key("::ffff:10.0.0.1") == "10.0.0.1"


def test_a_store_counts_uploads_until_a_request_takes_them():
    import asyncio

    from isthmus.frontend.host_buffers import HostBufferStore
    from isthmus.ids import HostBufferHandle

    async def main():
        budget = UploadBudget(tenants(alice="max_upload_bytes = 100").by_name["alice"], "")
        one, two = HostBufferStore(10.0, budget), HostBufferStore(10.0, budget)
        one.begin(HostBufferHandle(1), 60)
        with pytest.raises(errors.TooLarge):  # the tenant's other session shares the cap
            two.begin(HostBufferHandle(1), 50)
        one.complete(HostBufferHandle(1), memoryview(bytes(60)))
        taken = []
        one.when_ready(HostBufferHandle(1), lambda data, error: taken.append(len(data)))
        assert taken == [60] and budget.held == 0  # a request took it
        two.begin(HostBufferHandle(2), 100)
        two.abort(HostBufferHandle(2), errors.HostBufferMissing("broke off"))
        assert budget.held == 0
        one.begin(HostBufferHandle(3), 40)
        one.close(errors.SessionClosed("closed"))
        assert budget.held == 0

    asyncio.run(main())
