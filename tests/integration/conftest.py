import pytest

from isthmus.testing import LocalServer

# The client-side suite runs against both backends: the embedded one (8 devices in the
# server process) and a fleet of 2 slices x 2 hosts x 2 devices (4 worker processes).
BACKENDS = {"embedded": {"devices": 8}, "fleet": {"devices": None, "fleet": (2, 2, 2)}}


@pytest.fixture(scope="session", params=list(BACKENDS))
def server(request):
    """An isthmus server with 8 devices, shared by the tests of one backend."""
    with LocalServer(**BACKENDS[request.param]) as s:
        s.kind = request.param
        yield s
        assert s.alive(), f"the server died during the tests:\n{s.log()}"
