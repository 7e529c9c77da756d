"""The tenants file of a shared service: parsing, validation (one ValueError per mistake) and
authentication by token digest. Plain dicts through `tenants.parse`, and real files in tmp_path
through `tenants.load`."""

import argparse
import hashlib
import os
import threading

import pytest

from isthmus import errors
from isthmus.controller import tenants

ALICE = tenants.token_digest("alice-secret")
BOB = tenants.token_digest("bob-secret")


def valid():
    """A file with two tenants, one of them an admin; tests change one thing in it."""
    return {
        "grace_seconds": 30,
        "admins": ["bob"],
        "tenants": {
            "alice": {"token_sha256": ALICE, "max_slices": 2, "priority": 10,
                      "max_lease_seconds": 3600},
            "bob": {"token_sha256": BOB, "max_slices": 1},
        },
    }


def test_valid_file_parses_every_field():
    parsed = tenants.parse(valid(), ".", "t.toml")
    assert sorted(parsed.by_name) == ["alice", "bob"]
    assert parsed.grace_seconds == 30.0 and isinstance(parsed.grace_seconds, float)
    assert parsed.path == "t.toml"
    alice, bob = parsed.by_name["alice"], parsed.by_name["bob"]
    assert alice.token_sha256 == hashlib.sha256(b"alice-secret").digest()
    assert (alice.max_slices, alice.priority, alice.max_lease_seconds) == (2, 10, 3600.0)
    assert (bob.max_slices, bob.priority, bob.max_lease_seconds) == (1, 0, None)
    assert (alice.admin, bob.admin) == (False, True)


def test_defaults_when_settings_are_left_out():
    parsed = tenants.parse({"tenants": {"alice": {"token_sha256": ALICE, "max_slices": 0}}})
    assert parsed.grace_seconds == tenants.DEFAULT_GRACE_SECONDS == 60.0
    assert parsed.by_name["alice"].admin is False
    assert parsed.by_name["alice"].max_slices == 0


def test_token_digest_is_hex_sha256_of_the_stripped_token():
    assert tenants.token_digest("  alice-secret\n") == hashlib.sha256(b"alice-secret").hexdigest()


def test_authenticate_right_token():
    parsed = tenants.parse(valid())
    assert parsed.authenticate("alice", "alice-secret") is parsed.by_name["alice"]
    assert parsed.authenticate("bob", "bob-secret").name == "bob"


@pytest.mark.parametrize("name, token", [
    ("alice", "bob-secret"),        # another tenant's token
    ("alice", "alice-secret "),     # close, but not the token
    ("carol", "alice-secret"),      # unknown name with a known token
    ("carol", "carol-secret"),      # unknown name
    ("alice", ""),                  # empty token
])
def test_authenticate_refuses_with_one_message(name, token):
    parsed = tenants.parse(valid())
    with pytest.raises(errors.Unauthenticated) as caught:
        parsed.authenticate(name, token)
    assert type(caught.value) is errors.Unauthenticated
    assert caught.value.code is errors.Code.UNAUTHENTICATED
    # The message names only what the client sent: it does not tell a wrong name from a
    # wrong token.
    assert caught.value.message.startswith(f"tenant {name!r} with this token is not known")


def test_empty_token_refused_even_when_its_digest_is_configured():
    data = {"tenants": {"alice": {"token_sha256": tenants.token_digest(""), "max_slices": 1}}}
    parsed = tenants.parse(data)
    with pytest.raises(errors.Unauthenticated):
        parsed.authenticate("alice", "")


def test_load_reads_toml_and_token_file_relative_to_it(tmp_path):
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "alice.token").write_text("  alice-secret\n\n")
    path = tmp_path / "tenants.toml"
    path.write_text(
        'grace_seconds = 5.5\n'
        'admins = ["alice"]\n'
        '[tenants.alice]\n'
        'token_file = "tokens/alice.token"\n'
        'max_slices = 3\n'
        'priority = -1\n'
        f'[tenants.bob]\ntoken_sha256 = "{BOB.upper()}"\nmax_slices = 1\n'
        'max_lease_seconds = 0.5\n')
    parsed = tenants.load(str(path))
    assert parsed.path == str(path)
    assert parsed.grace_seconds == 5.5
    alice = parsed.authenticate("alice", "alice-secret")
    assert (alice.max_slices, alice.priority, alice.admin) == (3, -1, True)
    assert parsed.authenticate("bob", "bob-secret").max_lease_seconds == 0.5


def test_load_missing_file_names_it(tmp_path):
    path = tmp_path / "nowhere.toml"
    with pytest.raises(ValueError, match=f"cannot read the tenants file {path}"):
        tenants.load(str(path))


def test_load_not_toml_names_it(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.alice\n")
    with pytest.raises(ValueError, match=f"the tenants file {path} is not TOML"):
        tenants.load(str(path))


def test_missing_token_file_names_it(tmp_path):
    data = {"tenants": {"alice": {"token_file": "alice.token", "max_slices": 1}}}
    with pytest.raises(ValueError, match="cannot read the token file .*alice.token"):
        tenants.parse(data, str(tmp_path))


def test_empty_token_file_refused(tmp_path):
    (tmp_path / "alice.token").write_text(" \n")
    data = {"tenants": {"alice": {"token_file": "alice.token", "max_slices": 1}}}
    with pytest.raises(ValueError, match="token file .*alice.token is empty"):
        tenants.parse(data, str(tmp_path))


def with_alice(**changes):
    """valid() with alice's table changed (None removes a field)."""
    data = valid()
    alice = data["tenants"]["alice"]
    for field, value in changes.items():
        if value is None:
            alice.pop(field, None)
        else:
            alice[field] = value
    return data


@pytest.mark.parametrize("data, message", [
    ({}, r"t.toml: no \[tenants.NAME\] table"),
    ({"tenants": {}}, r"t.toml: no \[tenants.NAME\] table"),
    ({"tenants": ["alice"]}, r"t.toml: no \[tenants.NAME\] table"),
    ({**valid(), "grace": 3}, r"t.toml: unknown settings \['grace'\]"),
    ({**valid(), "admins": "bob"}, "admins must be a list of tenant names"),
    ({**valid(), "admins": ["carol"]}, r"admins \['carol'\] have no \[tenants.NAME\] table"),
    ({**valid(), "grace_seconds": -1}, "grace_seconds must be a number of seconds >= 0"),
    ({**valid(), "grace_seconds": "60s"}, "grace_seconds must be a number of seconds >= 0"),
    ({**valid(), "grace_seconds": True}, "grace_seconds must be a number of seconds >= 0"),
    (with_alice(colour="red"), r"\[tenants.alice\]: unknown fields \['colour'\]"),
    (with_alice(token_file="alice.token"), "give exactly one of token_file and token_sha256"),
    (with_alice(token_sha256=None), "give exactly one of token_file and token_sha256"),
    (with_alice(token_sha256="abc"), "token_sha256 must be 64 hex digits"),
    (with_alice(token_sha256="zz" * 32), "token_sha256 must be 64 hex digits"),
    (with_alice(token_sha256=ALICE + "00"), "token_sha256 must be 64 hex digits"),
    (with_alice(max_slices=None), "max_slices must be a whole number >= 0"),
    (with_alice(max_slices=-1), "max_slices must be a whole number >= 0"),
    (with_alice(max_slices=1.5), "max_slices must be a whole number >= 0"),
    (with_alice(max_slices=True), "max_slices must be a whole number >= 0"),
    (with_alice(priority="high"), "priority must be a whole number"),
    (with_alice(priority=1.0), "priority must be a whole number"),
    (with_alice(priority=False), "priority must be a whole number"),
    (with_alice(max_lease_seconds=0), "max_lease_seconds must be a number of seconds > 0"),
    (with_alice(max_lease_seconds=-5), "max_lease_seconds must be a number of seconds > 0"),
    (with_alice(max_lease_seconds="1h"), "max_lease_seconds must be a number of seconds > 0"),
    (with_alice(max_lease_seconds=True), "max_lease_seconds must be a number of seconds > 0"),
    ({"tenants": {"alice": 3}}, r"\[tenants.alice\] must be a table"),
    ({"tenants": {"al ice": {"token_sha256": ALICE, "max_slices": 1}}},
     "a tenant name is letters, digits"),
    ({"tenants": {"": {"token_sha256": ALICE, "max_slices": 1}}},
     "a tenant name is letters, digits"),
    ({"tenants": {"al/ice": {"token_sha256": ALICE, "max_slices": 1}}},
     "a tenant name is letters, digits"),
    ({"tenants": {"alice": {"token_sha256": ALICE, "max_slices": 1},
                  "bob": {"token_sha256": ALICE.upper(), "max_slices": 1}}},
     "two tenants share a token"),
])
def test_validation_errors(data, message):
    with pytest.raises(ValueError, match=message):
        tenants.parse(data, ".", "t.toml")


def test_duplicate_token_between_file_and_digest(tmp_path):
    (tmp_path / "a.token").write_text("alice-secret\n")
    data = {"tenants": {"alice": {"token_file": "a.token", "max_slices": 1},
                        "bob": {"token_sha256": ALICE, "max_slices": 1}}}
    with pytest.raises(ValueError, match="two tenants share a token"):
        tenants.parse(data, str(tmp_path))


def test_edge_values_accepted():
    data = {"grace_seconds": 0, "tenants": {
        "A.b_c-9": {"token_sha256": ALICE, "max_slices": 0, "priority": -3,
                    "max_lease_seconds": 0.001}}}
    parsed = tenants.parse(data)
    tenant = parsed.by_name["A.b_c-9"]
    assert (parsed.grace_seconds, tenant.priority, tenant.max_lease_seconds) == (0.0, -3, 0.001)


@pytest.mark.parametrize("field", ["grace_seconds", "max_lease_seconds"])
def test_nan_seconds_refused(tmp_path, field):
    path = tmp_path / "tenants.toml"
    alice = f'[tenants.alice]\ntoken_sha256 = "{ALICE}"\nmax_slices = 1\n'
    if field == "grace_seconds":
        path.write_text("grace_seconds = nan\n" + alice)
    else:
        path.write_text(alice + "max_lease_seconds = nan\n")
    with pytest.raises(ValueError, match=f"{field} must be a number of seconds"):
        tenants.load(str(path))


def test_tenant_repr_hides_the_digest():
    alice = tenants.parse(valid()).by_name["alice"]
    assert "token_sha256" not in repr(alice)
    assert ALICE not in repr(alice)


def test_storage_roots_colocated_python_and_fresh_workers():
    data = valid()
    data["fresh_workers"] = "always"
    data["tenants"]["alice"].update(storage_root="data/alice", colocated_python=True)
    data["tenants"]["bob"]["storage_root"] = "gs://bucket/bob/"
    parsed = tenants.parse(data, "/srv/isthmus", "t.toml")
    alice, bob = parsed.by_name["alice"], parsed.by_name["bob"]
    assert alice.storage_root == "/srv/isthmus/data/alice" and alice.colocated_python
    assert bob.storage_root == "gs://bucket/bob" and not bob.colocated_python
    assert parsed.fresh_workers == "always"
    assert tenants.parse(valid(), ".", "t.toml").fresh_workers == "colocated"


@pytest.mark.parametrize("field, value, message", [
    ("colocated_python", "yes", "colocated_python must be true or false"),
    ("storage_root", "", "storage_root must be a directory or an fsspec URL"),
    ("storage_root", "gs://", "names no bucket or path"),
])
def test_bad_storage_root_or_colocated_python_is_one_line(field, value, message):
    data = valid()
    data["tenants"]["alice"][field] = value
    with pytest.raises(ValueError, match=message):
        tenants.parse(data, ".", "t.toml")


def test_bad_fresh_workers_is_one_line():
    data = valid()
    data["fresh_workers"] = "sometimes"
    with pytest.raises(ValueError, match="fresh_workers must be"):
        tenants.parse(data, ".", "t.toml")


# ---- files that are not what they should be: refused in one line naming them, never waited on


def refusal_of(read, fifo):
    """The message of `read()`'s ValueError (or SystemExit's stderr); fails, rather than
    hanging, when `read` waits on the FIFO `fifo` for a writer."""
    outcome = []

    def run():
        try:
            read()
        except (ValueError, SystemExit, Exception) as e:  # noqa: BLE001 - returned to assert on
            outcome.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # lets the blocked reader go
        thread.join(10)
        pytest.fail(f"reading {fifo} waited for a writer")
    assert outcome, "nothing was refused"
    return outcome[0]


def test_a_fifo_as_token_file_or_tenants_file_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "alice.token"
    os.mkfifo(fifo)
    (tmp_path / "tenants.toml").write_text(
        '[tenants.alice]\ntoken_file = "alice.token"\nmax_slices = 1\n')
    refused = refusal_of(lambda: tenants.load(str(tmp_path / "tenants.toml")), fifo)
    assert isinstance(refused, ValueError)
    assert str(refused) == f"the token file {fifo} is a FIFO, not a regular file; give a file"
    refused = refusal_of(lambda: tenants.load(str(fifo)), fifo)
    assert str(refused) == (f"the tenants file {fifo} is a FIFO, not a regular file; give a "
                            "file")


def test_a_fifo_as_the_clients_or_the_fleets_token_file_is_refused(tmp_path, capsys):
    from isthmus import shared
    from isthmus.options import fleet_token

    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    refused = refusal_of(lambda: shared.read_token_file(str(fifo)), fifo)
    assert isinstance(refused, shared.LeaseRefused) and f"token file {fifo} is a FIFO" in str(
        refused)
    refused = refusal_of(lambda: fleet_token(argparse.Namespace(token_file=str(fifo))), fifo)
    assert isinstance(refused, SystemExit) and refused.code == 2
    assert capsys.readouterr().err == (f"isthmus: --token-file {fifo} is a FIFO, not a "
                                       "regular file; give a file\n")


def test_a_directory_a_device_or_a_long_file_is_not_a_token_file(tmp_path):
    with pytest.raises(ValueError, match=f"the token file {tmp_path} is a directory"):
        tenants.read_token(str(tmp_path))
    with pytest.raises(ValueError, match="the token file /dev/zero is a device"):
        tenants.read_token("/dev/zero")
    long = tmp_path / "long.token"
    long.write_text("x" * (tenants.MAX_TOKEN_BYTES + 1))
    with pytest.raises(ValueError, match=f"token file {long} is longer than 4096 bytes"):
        tenants.read_token(str(long))
    long.write_text("x" * tenants.MAX_TOKEN_BYTES)
    assert tenants.read_token(str(long)) == "x" * 4096


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_bytes(b'[tenants.alice]\ntoken_sha256 = "\xff"\nmax_slices = 1\n')
    with pytest.raises(ValueError) as refused:
        tenants.load(str(path))
    assert str(refused.value) == (f"the tenants file {path} is not UTF-8 text (byte 32); save "
                                  "it as UTF-8")
    (tmp_path / "alice.token").write_bytes(b"secret\xe9\n")
    path.write_text('[tenants.alice]\ntoken_file = "alice.token"\nmax_slices = 1\n')
    with pytest.raises(ValueError, match=f"the token file {tmp_path}/alice.token is not UTF-8"):
        tenants.load(str(path))
