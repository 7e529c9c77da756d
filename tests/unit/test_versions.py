import pytest

from isthmus import errors
from isthmus.protocol import versions


def test_highest_common_version():
    v = versions.negotiate(16, 25, 3)
    assert (v.protocol, v.serdes) == (25, 3)
    assert versions.negotiate(10, 20, 3).protocol == 20
    assert versions.negotiate(20, 99, 5).protocol == versions.MAX_PROTOCOL_VERSION


@pytest.mark.parametrize("low,high", [(1, 5), (26, 30), (0, 0)])
def test_no_common_version_is_refused(low, high):
    with pytest.raises(errors.VersionMismatch) as info:
        versions.negotiate(low, high, 3)
    assert info.value.code == errors.Code.FAILED_PRECONDITION


def test_serdes_too_old():
    with pytest.raises(errors.VersionMismatch):
        versions.negotiate(16, 25, 2, 0)


def test_the_refusal_names_the_client_and_server_jaxlib():
    import jaxlib.version

    assert versions.client_jaxlib(0, 3) == "jaxlib 0.10.x"
    assert versions.client_jaxlib(2, 6) == "jaxlib 0.12.0"
    assert versions.client_jaxlib(3, 7) == "jaxlib 0.12.1"
    assert "newer than 0.12" in versions.client_jaxlib(4, 8)
    with pytest.raises(errors.VersionMismatch) as info:
        versions.negotiate(26, 30, 8, 4)
    message = str(info.value)
    assert "a jaxlib newer than 0.12" in message
    assert f"jaxlib {jaxlib.version.__version__}" in message
