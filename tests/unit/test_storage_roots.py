"""A tenant's client-named locations resolve inside its storage root, or are refused."""

import pytest

from isthmus import errors
from isthmus.controller import tenants
from isthmus.controller.storage import TenantFiles, resolve

LOCAL = "/data/alice"
BUCKET = "gs://bucket/alice"


@pytest.mark.parametrize("location, want", [
    ("ckpt", "/data/alice/ckpt"),
    ("ckpt/7/w", "/data/alice/ckpt/7/w"),
    ("./ckpt//7/", "/data/alice/ckpt/7"),
    ("ckpt/../other", "/data/alice/other"),
    (".", "/data/alice"),
    ("/data/alice", "/data/alice"),
    ("/data/alice/ckpt", "/data/alice/ckpt"),
    ("//data/alice/ckpt", "/data/alice/ckpt"),
    ("file:///data/alice/ckpt", "/data/alice/ckpt"),
    ("FILE:///data/alice/x/../y", "/data/alice/y"),
    ("~/ckpt", "/data/alice/~/ckpt"),  # a name, not the home directory
    ("data:x", "/data/alice/data:x"),  # a name, not fsspec's data: URL
])
def test_a_local_root_takes_relative_names_and_paths_inside_it(location, want):
    assert resolve(LOCAL, location) == want


@pytest.mark.parametrize("location", [
    "..", "../bob/ckpt", "ckpt/../../bob", "./../alice2", "/data/bob/ckpt", "/data/alice2",
    "/data/alice/../bob", "/", "/etc/passwd", "file:///data/bob", "file://../bob",
    "ftp://example.com/x", "webhdfs://example.com/x", "http://example.com/x",
    "gs://bucket/alice", "s3://bucket/alice", "local:///data/alice/x",
    "simplecache::file:///data/alice/x", "ckpt::gs://b/x", "ckpt\x00", "", "   ",
])
def test_a_local_root_refuses_escapes_other_places_and_other_schemes(location):
    with pytest.raises(errors.NotPermitted, match="outside this tenant's storage root "
                       "/data/alice") as e:
        resolve(LOCAL, location, "a checkpoint")
    assert e.value.code == errors.Code.PERMISSION_DENIED
    assert e.value.message.startswith("a checkpoint at ")


@pytest.mark.parametrize("location, want", [
    ("ckpt", "gs://bucket/alice/ckpt"),
    ("ckpt/./7//", "gs://bucket/alice/ckpt/7"),
    ("gs://bucket/alice/ckpt", "gs://bucket/alice/ckpt"),
    ("gs://bucket/alice", "gs://bucket/alice"),
    ("GS://bucket/alice/x/../y", "gs://bucket/alice/y"),
])
def test_a_url_root_takes_relative_names_and_urls_inside_it(location, want):
    assert resolve(BUCKET, location) == want


@pytest.mark.parametrize("location", [
    "../bob", "../../other/alice", "../../..", "gs://bucket/bob/x", "gs://bucket/alice2",
    "gs://other/alice", "gs://bucket/alice/../bob", "gs://evil.example.com/x",
    "/tmp/x", "/data/alice", "file:///tmp/x", "s3://bucket/alice", "http://bucket/alice",
    "ftp://bucket/alice",
])
def test_a_url_root_refuses_other_buckets_paths_and_schemes(location):
    with pytest.raises(errors.NotPermitted, match="storage root gs://bucket/alice"):
        resolve(BUCKET, location)


def test_a_tenant_without_a_root_is_told_how_to_get_one():
    files = TenantFiles("carol", None, "/etc/isthmus/tenants.toml", "lease-1", 60.0)
    with pytest.raises(errors.NotPermitted) as e:
        files.resolve("ckpt", "a profile")
    assert e.value.code == errors.Code.PERMISSION_DENIED
    message = e.value.message
    assert "tenant carol has no storage root" in message and "a profile" in message
    assert "storage_root = " in message and "[tenants.carol]" in message
    assert "/etc/isthmus/tenants.toml" in message


def test_a_tenant_with_a_root_resolves_inside_it():
    files = TenantFiles("alice", LOCAL, "t.toml", "lease-1", 60.0)
    assert files.resolve("ckpt", "a checkpoint") == "/data/alice/ckpt"


def test_the_tenants_file_gives_roots_and_the_profile_cap(tmp_path):
    parsed = tenants.parse({
        "max_profile_seconds": 5,
        "tenants": {"alice": {"token_sha256": "ab" * 32, "max_slices": 1,
                              "storage_root": "files/alice/"},
                    "carol": {"token_sha256": "cd" * 32, "max_slices": 1}}},
        str(tmp_path), "t.toml")
    assert parsed.by_name["alice"].storage_root == str(tmp_path / "files" / "alice")
    assert parsed.by_name["carol"].storage_root is None
    assert parsed.max_profile_seconds == 5.0
    default = tenants.parse({"tenants": {"a": {"token_sha256": "ab" * 32, "max_slices": 1}}})
    assert default.max_profile_seconds == 60.0


@pytest.mark.parametrize("value", [0, -1, "60", True, float("inf")])
def test_the_profile_cap_is_a_positive_number_of_seconds(value):
    with pytest.raises(ValueError, match="max_profile_seconds must be a number of seconds"):
        tenants.parse({"max_profile_seconds": value,
                       "tenants": {"a": {"token_sha256": "ab" * 32, "max_slices": 1}}})
