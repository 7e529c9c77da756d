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
