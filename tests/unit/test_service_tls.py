"""A shared service's self-signed certificate: made once, presented again after a restart
while it still serves, made anew when it does not."""

from isthmus.transport.service_tls import self_signed


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_a_restarted_service_presents_the_pair_it_made_before(tmp_path):
    first = self_signed(str(tmp_path), ["localhost", "127.0.0.1", "::1"])
    again = self_signed(str(tmp_path), ["127.0.0.1", "localhost"])
    assert again == first
    assert _read(again.cert) == _read(first.cert)  # the users' --service-ca stays good


def test_a_pair_that_no_longer_serves_is_made_anew(tmp_path):
    made = self_signed(str(tmp_path), ["localhost"])
    cert = _read(made.cert)
    # A name it does not cover (the service moved to another address).
    assert _read(self_signed(str(tmp_path), ["localhost", "10.1.2.3"]).cert) != cert
    cert = _read(made.cert)
    # A key that does not load.
    with open(made.key, "w") as f:
        f.write("not a key\n")
    assert _read(self_signed(str(tmp_path), ["localhost"]).cert) != cert
    # One that runs out within a week.
    short = self_signed(str(tmp_path / "short"), ["localhost"], days=3)
    cert = _read(short.cert)
    assert _read(self_signed(str(tmp_path / "short"), ["localhost"]).cert) != cert
