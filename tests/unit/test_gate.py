"""The gate of a shared service's client port: what a CONNECT request must carry, and what
it establishes (no sockets: `Gate.identify` on request heads)."""

from __future__ import annotations

import base64

import pytest

from isthmus import errors
from isthmus.controller import tenants
from isthmus.frontend.lease_service import Identity
from isthmus.wire.gate import Gate

TENANTS = tenants.parse({"tenants": {"alice": {"token_sha256": tenants.token_digest("s3cret"),
                                               "max_slices": 1}}})


def authenticate(name, token, lease_id):
    return Identity(TENANTS.authenticate(name, token), lease_id)


def bound(identity):
    return Identity(identity.tenant, "L7")


def head(authority, credentials=None):
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if credentials is not None:
        token = base64.b64encode(credentials.encode()).decode()
        lines.append("Proxy-Authorization: Basic " + token)
    return "\r\n".join(lines).encode()


def test_a_tunnel_names_control_a_lease_or_the_tenants_one_lease():
    gate = Gate(authenticate, bound, tls=None)
    assert gate.identify(head("control", "alice:s3cret"), secure=True) == Identity(
        TENANTS.by_name["alice"], None)
    assert gate.identify(head("lease/L3", "alice:s3cret"), secure=True).lease_id == "L3"
    assert gate.identify(head("10.0.0.1:8470", "alice:s3cret"), secure=True).lease_id == "L7"
    # The token alone names its tenant.
    assert gate.identify(head("control", ":s3cret"), secure=True).tenant.name == "alice"


@pytest.mark.parametrize("request_head, error, words", [
    (head("control"), errors.Unauthenticated, "carries no credentials"),
    (head("control", "alice:wrong"), errors.Unauthenticated, "not known to the service"),
    (head("control", "bob:s3cret"), errors.Unauthenticated, "not known to the service"),
    (b"CONNECT control HTTP/1.1\r\nProxy-Authorization: Basic !!!", errors.Unauthenticated,
     "not valid base64"),
    (b"GET / HTTP/1.1", errors.InvalidRequest, "only CONNECT"),
    (b"CONNECT", errors.InvalidRequest, "malformed"),
])
def test_bad_tunnels_are_refused_naming_why(request_head, error, words):
    with pytest.raises(error, match=words):
        Gate(authenticate, bound, tls=None).identify(request_head, secure=True)


def test_credentials_in_clear_only_where_the_operator_allows_them():
    with pytest.raises(errors.Unauthenticated, match="credentials in clear are refused"):
        Gate(authenticate, bound, tls=None).identify(head("control", "alice:s3cret"),
                                                     secure=False)
    allowed = Gate(authenticate, bound, tls=None, allow_plain_connect=True)
    assert allowed.identify(head("control", "alice:s3cret"), secure=False).tenant.name == \
        "alice"
