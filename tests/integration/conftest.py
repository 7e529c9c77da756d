import pytest

from isthmus.testing import LocalServer


@pytest.fixture(scope="session")
def server():
    """One embedded isthmus server with 8 CPU devices for the whole test session."""
    with LocalServer(devices=8) as s:
        yield s
    # A server that died during the session would have failed the tests using it.
