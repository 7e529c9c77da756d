"""The user-side helper: point this process's jax at an isthmus server."""

from __future__ import annotations

import os


def connect(address: str, *, timeout: float | None = None) -> None:
    """Makes jax in this process use the isthmus server at `address`.

    Call it before the first jax computation. Afterwards ``jax.devices()`` lists the server's
    devices and every jitted function runs there.

    Args:
      address: ``grpc://HOST:PORT`` (or ``HOST:PORT``), as ``isthmus up`` prints it.
      timeout: seconds to wait for the server when jax first connects.

    Raises:
      RuntimeError: jax has already created its backends in this process.
    """
    # The stock client logs insecure-credential warnings and, at exit, a "server
    # disconnected: CANCELLED" stack trace that reads like a crash: keep C++ logs to errors
    # unless the user chose a level (effective when jaxlib is not yet loaded).
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax

    from isthmus._bootstrap.jax_plugins import isthmus_proxy
    from isthmus.compat import jax as jax_compat

    if "://" not in address:
        address = f"grpc://{address}"
    if jax_compat.backends_are_initialized():
        raise RuntimeError(
            "jax already initialized its backends in this process; call isthmus.connect() "
            "before the first jax computation (or set JAX_PLATFORMS=proxy and "
            "JAX_BACKEND_TARGET before starting Python).")
    # The server speaks plain gRPC; the client reads this when it creates the channel.
    os.environ["IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS"] = "true"
    if timeout is not None:
        os.environ["ISTHMUS_CONNECT_TIMEOUT"] = str(timeout)
    jax.config.update("jax_platforms", "proxy")
    jax.config.update("jax_backend_target", address)
    isthmus_proxy.register()
