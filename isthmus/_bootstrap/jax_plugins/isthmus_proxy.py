"""Registers jax's `proxy` backend (the IFRT proxy client) when JAX_PLATFORMS asks for it.

jax imports every module of the `jax_plugins` namespace package (and every `jax_plugins`
entry point) before it creates backends, and calls its `initialize()`. isthmus installs this
module as such an entry point, and `isthmus run` also puts its folder on the child's
PYTHONPATH, so that a script that only does `import jax` reaches the server named by
JAX_BACKEND_TARGET. It imports nothing from isthmus, so it works in any Python with jax.

This folder has no __init__.py on purpose: `jax_plugins` must stay a namespace package, or
it would hide other plugins (CUDA, TPU) installed beside it.
"""

import os


def initialize() -> None:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if "proxy" not in [p.strip() for p in platforms.split(",")]:
        return
    try:  # someone (pathwaysutils.initialize) registered it already: leave theirs
        from jax._src import xla_bridge

        if "proxy" in getattr(xla_bridge, "_backend_factories", {}):
            return
    except ImportError:
        pass
    register()


def register() -> None:
    """Registers the `proxy` backend factory, reading the target when jax creates it."""
    import jax
    from jax.extend import backend
    from jax.extend.backend import ifrt_proxy

    def make_client():
        target = jax.config.read("jax_backend_target") or os.environ.get(
            "JAX_BACKEND_TARGET", "")
        if not target:
            raise RuntimeError(
                "JAX_PLATFORMS includes 'proxy' but no server is named: set "
                "JAX_BACKEND_TARGET=grpc://HOST:PORT (isthmus up prints it).")
        options = ifrt_proxy.ClientConnectionOptions()
        timeout = os.environ.get("ISTHMUS_CONNECT_TIMEOUT") or os.environ.get(
            "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS")
        if timeout:
            options.connection_timeout_in_seconds = int(float(timeout))
        return ifrt_proxy.get_client(target, options)

    backend.register_backend_factory("proxy", make_client, priority=-1)
