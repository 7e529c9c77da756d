"""A shared service for the tests of its trust boundaries (tests/integration/test_shared*.py).

`SharedService` is `isthmus up --tenants` on a local CPU fleet: it writes a tenants file of
the tenants and settings it is given, and each tenant's token file, into a directory of the
test's, and knows each tenant's token file and token, the service's certificate and its
client port. `SharedService.lease` holds a lease as a tenant in the test process
(`isthmus.shared.lease`: a forwarder and a lease stream, no jax). `JOB` is a program for the
stock jax client run through a lease's tunnel; `result_of` reads its result, to compare with
`EXPECTED`.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from isthmus import shared
from isthmus.testing import LocalServer

# A sharded program over all the devices the client sees, on a mesh across its slices.
JOB = """
import jax, jax.numpy as jnp, numpy as np
devices = jax.devices()
print("DEVICES", [d.id for d in devices], sorted({d.slice_index for d in devices}))
x = jnp.arange(32.0).reshape(4, 8)
from jax.experimental import mesh_utils
n = len({d.slice_index for d in devices})
mesh = jax.sharding.Mesh(
    mesh_utils.create_hybrid_device_mesh((len(devices) // n,), (n,), devices), ("d",))
y = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "d")))
print("RESULT", float(jax.jit(lambda a: (a @ a.T).sum() * 0.5)(y)))
"""
EXPECTED = float((np.arange(32.0).reshape(4, 8) @ np.arange(32.0).reshape(4, 8).T).sum() * 0.5)


def result_of(result: subprocess.CompletedProcess[str]) -> float:
    """The number a client printed after RESULT (it must have exited with 0)."""
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))
    return float(line.split()[1])


def tenants_file(tenants: dict[str, dict[str, Any]], settings: dict[str, Any]) -> str:
    """A tenants file's text: `settings` at its top (`{"grace_seconds": 3}`), then a table
    [tenants.NAME] per tenant with token_file = "NAME.token" and the tenant's own settings
    (`{"alice": {"max_slices": 2}}`). Values are written as JSON, which TOML reads alike for
    numbers, booleans, strings and lists of them."""
    lines = [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    for name, table in tenants.items():
        lines += [f"[tenants.{name}]", f'token_file = "{name}.token"']
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


class SharedService(LocalServer):
    """`isthmus up --tenants` on a CPU fleet of `fleet` (slices, hosts per slice, devices per
    host), its tenants file and token files in `directory`; a context manager, as
    `LocalServer` is."""

    def __init__(self, directory: pathlib.Path, fleet: tuple[int, int, int],
                 tenants: dict[str, dict[str, Any]], settings: dict[str, Any] | None = None,
                 args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        """`tenants` and `settings`: the tenants file (`tenants_file`); each tenant's token
        file gets the token NAME-secret-PID. `args`: more arguments of `isthmus up`; `env`:
        its environment (default: this process's)."""
        path = directory / "tenants.toml"
        path.write_text(tenants_file(tenants, settings or {}))
        self.directory = directory
        self.tokens: dict[str, str] = {}  # tenant -> its token file
        self.secrets: dict[str, str] = {}  # tenant -> its token
        for name in tenants:
            self.secrets[name] = f"{name}-secret-{os.getpid()}"
            self.tokens[name] = str(directory / f"{name}.token")
            pathlib.Path(self.tokens[name]).write_text(self.secrets[name] + "\n")
        # The self-signed certificate the service makes beside its tenants file.
        self.ca = str(directory / "isthmus-service" / "service-cert.pem")
        super().__init__(devices=None, fleet=fleet, env=env,
                         args=["--tenants", str(path), *args])

    @property
    def service(self) -> str:
        """The client port, HOST:PORT (what `isthmus run --service` takes)."""
        return self.address.removeprefix("grpc://")

    def lease(self, who: str, **options: Any) -> AbstractContextManager[shared.Grant]:
        """`isthmus.shared.lease` as tenant `who` (a context manager; its grant on entry)."""
        return shared.lease(self.service, token_file=self.tokens[who], ca=self.ca,
                            report=lambda line: None, **options)
