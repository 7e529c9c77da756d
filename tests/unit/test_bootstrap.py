"""The jax plugin that `isthmus run` puts on a child's path (`isthmus/_bootstrap`) works in
a Python where isthmus is not importable: it reads jax's backends through
isthmus/compat/jax.py, loaded from its file."""

import os
import subprocess
import sys
import textwrap

import isthmus._bootstrap as bootstrap

CHILD = textwrap.dedent("""
    import sys

    class NoIsthmus:  # as in a Python where isthmus is not installed
        def find_spec(self, name, path=None, target=None):
            if name == "isthmus" or name.startswith("isthmus."):
                raise ImportError(f"no module named {name!r} here")

    sys.meta_path.insert(0, NoIsthmus())
    from jax_plugins import isthmus_proxy

    isthmus_proxy.initialize()
    compat = isthmus_proxy._jax_compat()
    assert compat.__name__ == "_isthmus_jax_compat", compat.__name__
    assert "proxy" in compat.registered_backends()
    assert not [m for m in sys.modules if m == "isthmus" or m.startswith("isthmus.")]
    print("ok")
""")


def test_the_plugin_registers_the_proxy_backend_without_isthmus():
    folder = os.path.dirname(bootstrap.__file__)
    env = dict(os.environ, JAX_PLATFORMS="proxy", PYTHONPATH=folder)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
