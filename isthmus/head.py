"""Assembles a head process: fleet, controller, front end and gRPC server.

`Head` is what `isthmus up` and `isthmus run` start, and what tests start in-process. It
serves either an embedded backend (one in-process `DeviceHost` owning N jaxlib CPU devices)
or a fleet of worker processes, grouped into slices, that register with it; with
`launch_workers` it starts those workers itself on this machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from isthmus.controller.controller import Controller, ControllerConfig
from isthmus.controller.fleet import Device, WholeFleet
from isthmus.controller.manager import FleetManager, FleetSpec, ManagerConfig
from isthmus.controller.vetting import ProgramVetter, vetter_for
from isthmus.ids import COMPANION_BASE, DeviceId, SliceId, WorkerId
from isthmus.launch import RestartPolicy
from isthmus.observe.options import ObserveConfig
from isthmus.transport.tls import TlsConfig
from isthmus.wire.peers import Limits
from isthmus.worker.platforms import Platform

if TYPE_CHECKING:  # imported where first used (a plain server needs few of them)
    from isthmus.frontend.lease_service import SharedService
    from isthmus.frontend.service import Frontend
    from isthmus.launch import LocalLauncher
    from isthmus.observe.observer import Observer
    from isthmus.wire.fleet_service import FleetServicer
    from isthmus.wire.gate import Gate
    from isthmus.wire.methods import Method
    from isthmus.worker.compile_cache import CacheConfig
    from isthmus.worker.host import DeviceHost
    from isthmus.worker.sandbox import Sandbox

logger = logging.getLogger(__name__)

# Host buffers at least this large go through the shared directory when the client opts in.
SHARED_TRANSFER_THRESHOLD = 1 << 20
RENEW_TIMEOUT = 120.0  # seconds a shared service waits for a slice's fresh workers


@dataclasses.dataclass(frozen=True, slots=True)
class HeadConfig:
    """How to start a head process."""

    host: str = "127.0.0.1"  # address to listen on
    port: int | None = 0  # 0: pick a free port; None: no TCP client port (`unix_socket`)
    # The client port on this Unix socket too (mode 0600: this user's clients only): where
    # no TCP socket may be opened. `isthmus run` hands its command a private one.
    unix_socket: str | None = None
    devices: int = 8  # CPU devices of the embedded backend (when fleet is None)
    fleet: FleetSpec | None = None  # serve a fleet of worker processes instead
    # The embedded backend's devices, or (GPUs, memory share) what launched workers get.
    platform: Platform = Platform()
    launch_workers: bool = True  # start the fleet's workers on this machine
    restart: RestartPolicy = RestartPolicy()  # restarting launched workers that die
    pin_slices: bool = False  # each launched slice on CPUs of its own (launch.slice_cpus)
    pin_hosts: bool = False  # ... each launched worker (host) on CPUs of its own
    fleet_timeout: float = 180.0  # seconds to wait for the fleet to be complete
    heartbeat_timeout: float = 4.0  # seconds of silence after which a worker is lost
    advertise_host: str | None = None  # where workers reach this process (default: host)
    fleet_port: int = 0  # of the workers' control streams (0: a free one)
    # The fleet's shared secret: workers must prove they know it ("": any worker may join,
    # on a network the fleet trusts). Launched workers get it in ISTHMUS_FLEET_TOKEN.
    fleet_token: str = ""
    tls: TlsConfig | None = None  # mutual TLS between the fleet's members (transport/tls.py)
    controller: ControllerConfig = ControllerConfig()
    max_host_buffer_bytes: int = 1 << 40
    # Directory for clients on this machine to hand over large host buffers through shared
    # memory (HostBufferReadFromDisk); "auto": a fresh one under /dev/shm; None: off.
    shared_dir: str | None = "auto"
    # What serves the client port: "h2" (wire/h2server.py), "grpc" (grpc.aio), or "auto"
    # (h2 when the h2 library is installed).
    client_transport: str = "auto"
    max_message_bytes: int = 1 << 31  # a client's larger gRPC messages are refused
    shared: SharedConfig | None = None  # serve as a shared service (leases, identities)
    observe: ObserveConfig | None = None  # serve metrics and the live view (isthmus/observe)


@dataclasses.dataclass(frozen=True, slots=True)
class SharedConfig:
    """A shared service: who may use it, and how clients reach it (docs/shared.md)."""

    tenants: str  # the tenants file (controller/tenants.py)
    # The TLS certificate and key of the client port; None: a self-signed pair made at start
    # in `state_dir` (users are handed its service-cert.pem).
    cert: str | None = None
    key: str | None = None
    state_dir: str | None = None  # None: a directory beside the tenants file
    unix_socket: str | None = None  # also serve tunnels here (clients on this machine)
    allow_plain_connect: bool = False  # accept credentials in clear over TCP
    limits: Limits = Limits()  # what connections without credentials may cost (wire/peers.py)


def loads_vetted(config: HeadConfig) -> bool:
    """Whether the hosts load the vetting process's trial compile of a CPU program instead of
    compiling it again: each new program is then compiled once, not once there and again on
    every host. Not a shared service's: machine code from the process that parses every
    tenant's bytes is not to run on another tenant's workers. Not simulated hosts'."""
    if config.shared is not None or config.platform.simulate_flops:
        return False
    return config.fleet is not None or config.platform.name == "cpu"


def embedded_fleet(num_devices: int, platform: str = "cpu",
                   simulate_flops: float = 0.0, compile_cache: CacheConfig | None = None
                   ) -> tuple[WholeFleet, DeviceHost]:
    """One in-process worker with `num_devices` jaxlib CPU devices, or the GPUs it sees
    (simulated accelerators at `simulate_flops` FLOP/s each, when that is set; executables
    kept in `compile_cache`, a `CacheConfig`, across restarts)."""
    from isthmus.worker.platforms import companion_devices, describe_client, make_client
    from isthmus.worker.simulated import make_host

    if num_devices < 1:
        raise ValueError(f"--devices must be at least 1, not {num_devices}")
    client = make_client(platform, num_devices)
    from isthmus.worker.compile_cache import CompileCache

    cache = CompileCache(compile_cache) if compile_cache is not None else None
    described = describe_client(platform, client)
    companions = None
    if described.companions:
        companions = companion_devices({d.id: d for d in client.local_devices()},
                                       make_client("cpu", len(client.local_devices())),
                                       COMPANION_BASE)
    host = make_host(client, simulate_flops=simulate_flops, compile_cache=cache,
                     companions=companions)
    # An accelerator's copy to the host takes a while: the client's CopyToHostBuffer is
    # answered while it runs (a worker answers with the data, so copies in the call).
    host.reads.copy_inline = host.on_cpu
    from isthmus.worker.programs import warm_up

    warm_up()  # MLIR's first use, before the first program waits for it
    worker = WorkerId(0)
    devices = [Device(DeviceId(d.id), worker, local, platform, described.device_kind,
                      SliceId(0), 0, described.memory_kinds,
                      attributes=described.attributes[local] if described.attributes else ())
               for local, d in enumerate(client.local_devices())]
    if companions:
        devices += [d.companion() for d in devices]
    fleet = WholeFleet(devices, {worker: host})
    host.attach_flow(fleet.flow, worker)
    return fleet, host


class Head:
    """A running server: `await Head(config).start()`, then `await head.stop()`."""

    def __init__(self, config: HeadConfig, vetter: ProgramVetter | None = None) -> None:
        """`vetter`: the process that parses programs, if the caller started it already
        (`serve` does, before this module's imports, so that its own overlap them)."""
        self.config = config
        self.server: Any = None
        self.frontend: Frontend | None = None
        self.manager: FleetManager | None = None
        self.launcher: LocalLauncher | None = None
        self.port = 0
        self.shared_dir: str | None = None
        self._own_shared_dir = False
        self._hosts: list[DeviceHost] = []
        self._vetter = vetter  # the process that parses programs
        self._vetter_started: asyncio.Task[None] | None = None
        self.fleet_service: FleetServicer | None = None  # the workers' control streams
        self.shared: SharedService | None = None  # a shared service's leases
        self.service_cert: str | None = None  # the certificate clients of it trust
        self.observer: Observer | None = None  # metrics and the live view

    @property
    def _unix_dir(self) -> str | None:
        """Where a fleet without TCP keeps its sockets: beside the client port's."""
        if self.config.port is None and self.config.unix_socket is not None:
            import os

            return os.path.dirname(os.path.abspath(self.config.unix_socket))
        return None

    @property
    def address(self) -> str:
        """Where clients reach the server: its TCP port, or its Unix socket without one."""
        if self.config.port is None and self.config.unix_socket is not None:
            return f"grpc://unix:{self.config.unix_socket}"
        host = self.config.host
        if host in ("0.0.0.0", "::"):
            host = self.config.advertise_host or "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"grpc://{host}:{self.port}"

    async def start(self) -> str:
        """Starts everything; returns the address clients reach. On failure, what was
        started is stopped before the error goes on."""
        try:
            return await self._start()
        except BaseException:
            await self._stop_vetter()  # `stop` does the rest, where a part failed
            raise

    async def _stop_vetter(self) -> None:
        if self._vetter_started is not None:
            self._vetter_started.cancel()
            await asyncio.gather(self._vetter_started, return_exceptions=True)
            self._vetter_started = None
        if self._vetter is not None:
            await self._vetter.close()

    async def _start(self) -> str:
        from isthmus.frontend.service import Frontend, FrontendConfig
        from isthmus.protocol.schema import schema
        from isthmus.wire.servicer import start_server

        config = self.config
        extra_methods: dict[str, Method] = {}
        if config.observe is not None:
            from isthmus.observe.observer import Observer

            self.observer = Observer(config.observe, self)
            self.observer.attach_events()  # the fleet's first events are seen too
        self.shared_dir = self._make_shared_dir()
        joins = None
        # The process that parses client programs, started first: its imports overlap the
        # rest of the start, and `start` returns once it is ready, so that the first program
        # does not wait for it. With a compilation cache, what it concluded is kept beside it.
        vetter = self._vetter or vetter_for(config.platform.compile_cache)
        self._vetter = vetter
        self._vetter_started = asyncio.get_running_loop().create_task(vetter.start())
        if config.fleet is None:
            fleet, host = embedded_fleet(config.devices, config.platform.name,
                                         config.platform.simulate_flops,
                                         config.platform.compile_cache)
            self._hosts.append(host)
            controller = Controller(fleet, config.controller, vetter)
            controller.loads_vetted = loads_vetted(config)
        else:
            from isthmus.transport.auth import JoinTokens
            from isthmus.wire.fleet_service import FleetServicer

            fleet = WholeFleet([], {})
            controller = Controller(fleet, config.controller, vetter)
            controller.loads_vetted = loads_vetted(config)
            advertise = config.advertise_host or (
                config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1")
            self.manager = FleetManager(
                config.fleet, fleet,
                ManagerConfig(advertise_host=advertise, shared_dir=self.shared_dir,
                              heartbeat_timeout=config.heartbeat_timeout,
                              unix_dir=self._unix_dir),
                on_slice_down=controller.ledger.poison_slice, on_crash=controller.crashed,
                last_program=controller.last_program)
            # A shared service's own workers join with single-use tokens (`transport/auth.py`).
            joins = (JoinTokens() if config.shared is not None and config.launch_workers
                     else None)
            self.fleet_service = FleetServicer(self.manager, config.fleet_token, config.tls,
                                               joins)
            if self._unix_dir is not None:  # a fleet on this machine without TCP
                await self.fleet_service.start_unix(f"{self._unix_dir}/fleet.sock")
            else:
                await self.fleet_service.start(config.host, config.fleet_port)
            extra_methods = self.fleet_service.methods()
        # Clients' files in the shared directory are named by handle, not by session: a
        # shared service takes none (its workers still use it among themselves).
        self.frontend = Frontend(controller, schema(), FrontendConfig(
            max_host_buffer_bytes=config.max_host_buffer_bytes,
            shared_dir=None if config.shared is not None else self.shared_dir))
        if self.manager is not None:
            self.frontend.extra_status = self.manager.status
        gate = None
        if config.shared is not None:
            gate = self._make_shared(controller, extra_methods)
        if self.observer is not None:
            try:
                await self.observer.start()
            except BaseException:
                await self.stop()
                raise
        self.server, self.port = await start_server(
            self.frontend, config.host, config.port, extra_methods, config.client_transport,
            max_message=config.max_message_bytes, gate=gate,
            unix_path=config.shared.unix_socket if config.shared else config.unix_socket)
        if self.manager is not None:
            self.manager.start()
            spec = config.fleet
            assert spec is not None
            if config.launch_workers:
                from isthmus.launch import LocalLauncher

                confined = self._sandbox() if config.shared is not None else None
                self.launcher = LocalLauncher(self.address.removeprefix("grpc://"),
                                              spec.slices, spec.hosts_per_slice,
                                              spec.devices_per_host, restart=config.restart,
                                              token=config.fleet_token, tls=config.tls,
                                              pin_slices=config.pin_slices,
                                              pin_hosts=config.pin_hosts,
                                              join_tokens=None if joins is None
                                              else joins.issue, sandbox=confined,
                                              keep_executables=config.shared is None,
                                              platform=dataclasses.replace(
                                                  config.platform, name=spec.platform))
            if self.launcher is not None and self.shared is not None:
                self.shared.renew = self._renew
            try:
                if self.launcher is not None:
                    self.launcher.start()
                await self.manager.wait_complete(config.fleet_timeout)
            except BaseException:
                await self.stop()
                raise
        if self.shared is not None:
            self.shared.start()
        try:
            await asyncio.wait_for(asyncio.shield(self._vetter_started), 60)
        except Exception as e:  # noqa: BLE001 - the first program starts another child
            logger.warning("the process that parses programs did not start (%r); the first "
                           "program will start another", e)
        logger.info("serving %d devices at %s", len(fleet.devices), self.address)
        return self.address

    def _make_shared(self, controller: Controller, methods: dict[str, Method]) -> Gate:
        """The leases, the gate and the lease methods of a shared service."""
        import os

        from isthmus.controller import tenants as tenants_file
        from isthmus.frontend.lease_service import SharedService
        from isthmus.transport import service_tls
        from isthmus.wire import lease_methods
        from isthmus.wire.gate import Gate

        config, frontend = self.config, self.frontend
        shared = config.shared
        assert shared is not None and frontend is not None
        tenants = tenants_file.load(shared.tenants)
        fleet = controller.fleet
        self.shared = SharedService(
            tenants, controller, lambda: sorted({d.slice_index for d in fleet.devices}))
        frontend.shared = self.shared
        if shared.cert is not None and shared.key is not None:
            certificate = service_tls.ServiceCertificate(shared.cert, shared.key)
        else:
            directory = shared.state_dir or os.path.join(
                os.path.dirname(os.path.abspath(shared.tenants)), "isthmus-service")
            certificate = service_tls.self_signed(
                directory, service_tls.default_names(config.host, config.advertise_host))
            logger.warning("made a self-signed certificate for the client port: hand users "
                           "%s (--service-ca)", certificate.cert)
        self.service_cert = certificate.cert
        methods.update(lease_methods.methods(self.shared))
        return Gate(self.shared.authenticate, self.shared.lease_for,
                    certificate.server_context(), shared.allow_plain_connect, shared.limits)

    async def _renew(self, slices: list[SliceId], reason: str) -> None:
        """Fresh worker processes for `slices` (`LocalLauncher.renew`); returns once they
        serve, or after RENEW_TIMEOUT s (the slices stay out of the pool until they do)."""
        import time

        manager, launcher = self.manager, self.launcher
        assert manager is not None and launcher is not None
        loop = asyncio.get_running_loop()
        for slice_index in slices:
            manager.retire(slice_index, reason)
        olds = await asyncio.gather(*(loop.run_in_executor(None, launcher.renew, s)
                                      for s in slices))
        old = {pid for pids in olds for pid in pids}
        hosts = manager.spec.hosts_per_slice
        fleet = manager.fleet

        def serving(s: SliceId) -> bool:
            channels = [manager.members.get(manager.slot(s, h)) for h in range(hosts)]
            return fleet.slice_error(s) is None and all(
                c is not None and c.register.pid not in old for c in channels)

        deadline = time.monotonic() + RENEW_TIMEOUT
        while not all(serving(s) for s in slices) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        logger.info("renewed the workers of slices %s (%s)", slices, reason)

    async def _validate_hosts(self, wait: float = 5.0) -> None:
        """Validate mode, at stop, every session closed, the workers still there: each host's
        buffers agree with the ledger (`Controller.validate_hosts`); what does not is logged
        as "isthmus validate:", which the test suite's servers fail on."""
        assert self.frontend is not None
        answered, problems = await self.frontend.controller.validate_hosts(wait)
        for problem in problems:
            logger.error("isthmus validate: at stop, every session closed, %s", problem)
        if not problems:
            logger.info("validate: at stop, every session closed, the buffers of %d hosts "
                        "agree with the ledger", answered)

    def _sandbox(self) -> Sandbox | None:
        """How a shared service's launched workers confine themselves (`worker/sandbox.py`),
        or None where this machine cannot: then no tenant runs colocated Python."""
        import os

        from isthmus.worker import sandbox

        assert self.shared is not None
        why = sandbox.unavailable()
        if why is not None:
            self.shared.python_refusal = (
                f"this service's workers cannot be confined: {why}; colocated Python is off "
                "for every tenant. Ask the operator to run the service where Landlock works")
            logger.warning("%s", self.shared.python_refusal)
            return None
        roots = []
        for tenant in self.shared.tenants.by_name.values():
            root = tenant.storage_root
            if root is not None and "://" not in root:
                os.makedirs(root, mode=0o700, exist_ok=True)
                roots.append(root)
        self.shared.python_refusal = None
        # Not the fleet's shared directory: other leases' buffers pass through it (workers
        # that cannot read it pull from their peers instead).
        return sandbox.Sandbox(writable=tuple(roots))

    def _make_shared_dir(self) -> str | None:
        import os
        import tempfile

        if self.config.shared_dir != "auto":
            return self.config.shared_dir
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
            else None
        self._own_shared_dir = True
        return tempfile.mkdtemp(prefix="isthmus-", dir=base)

    def client_environment(self) -> dict[str, str]:
        """Environment variables for a client on this machine (beyond the target)."""
        if self.shared_dir is None or self.config.shared is not None:
            return {}
        return {"IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_DIRECTORY": self.shared_dir,
                "IFRT_PROXY_GRPC_LARGE_TRANSFER_OPTIMIZATION_THRESHOLD_BYTES":
                    str(SHARED_TRANSFER_THRESHOLD)}

    async def _stop_serving(self, grace: float) -> None:
        """Stops the clients' server: no new request, and every session's stream ends."""
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None

    async def stop(self, grace: float = 2.0) -> None:
        if self.observer is not None:
            await self.observer.stop()
            self.observer = None
        if self.launcher is not None:
            # Before the workers are told to shut down: their exits are no failures.
            self.launcher.stop_restarting()
        if self.shared is not None:
            await self.shared.stop()
        if self.frontend is not None and self.frontend.controller.config.validate:
            # The sessions closed while the workers are still there to say what they hold.
            await self._stop_serving(grace)
            await self.frontend.close()
            await self._validate_hosts()
        if self.manager is not None:
            await self.manager.stop()
        await self._stop_serving(grace)
        if self.fleet_service is not None:
            await self.fleet_service.stop()
            self.fleet_service = None
        if self.frontend is not None:
            await self.frontend.close()
        await self._stop_vetter()
        if self.launcher is not None:
            self.launcher.stop()
            self.launcher = None
        for host in self._hosts:
            await host.close()
        self._hosts.clear()
        if self._own_shared_dir and self.shared_dir:
            import shutil

            shutil.rmtree(self.shared_dir, ignore_errors=True)
            self._own_shared_dir = False
