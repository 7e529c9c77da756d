"""The device clients isthmus serves: jaxlib's CPU client, CUDA through jax's plugin, or the
TPU through libtpu.

A worker (and the embedded backend) makes its client here, once per collective group. The
process is prepared first (`prepare_process`, before jax touches a GPU): the GPUs a worker is
given become its CUDA_VISIBLE_DEVICES, and XLA's allocator settings come from the options.

jax's own backends stay CPU-only in these processes (JAX_PLATFORMS=cpu): the CUDA client is
made here, by hand, so that it can join a collective group (NCCL through the distributed
runtime) and be replaced when the group re-forms. Two clients of one process live side by
side for a moment then, which is why GPU memory is not preallocated by default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, MutableMapping

from isthmus import errors
from isthmus.compat import jax as jax_compat
from isthmus.compat.jaxlib_types import (
    CpuCollectives,
    DistributedClient,
    JaxlibClient,
    JaxlibDevice,
)
from isthmus.worker import scheduling
from isthmus.worker.compile_cache import CacheConfig

PLATFORMS = ("cpu", "cuda", "tpu", "auto")
CPU_MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")
# A worker's exit code when its host cannot serve the platform: restarting will not help.
EXIT_PLATFORM_UNAVAILABLE = 5
# XLA's own default share of GPU memory per client; see `Platform.memory_fraction`.
DEFAULT_GPU_MEMORY_FRACTION = 0.75
# For tests on machines without accelerators: when set (to 1) in the environment of a CPU
# worker or embedded backend, its CPU devices are served as accelerators of this kind, each
# with a colocated CPU device beside it, as a GPU worker's are (docs/design.md, "Colocated
# CPU devices"). Programs then run on CPU either way; only the device model changes.
STAND_IN_ENV = "ISTHMUS_ACCELERATOR_STAND_IN"
STAND_IN_KIND = "accelerator stand-in"


class PlatformUnavailable(errors.IsthmusError):
    """The platform asked for cannot be served by this process (one line for the user)."""

    code = errors.Code.FAILED_PRECONDITION


@dataclasses.dataclass(frozen=True, slots=True)
class Platform:
    """What a worker serves: the platform and, for CUDA, which GPUs and how much of them."""

    # "cpu", "cuda", "tpu" or "auto" (TPU where libtpu and chips are present, else CUDA
    # when jax's plugin finds a GPU, else CPU)
    name: str = "cpu"
    gpus: tuple[int, ...] | None = None  # GPUs to own (None: CUDA_VISIBLE_DEVICES, or all)
    # Cap of each client's memory pool, as a share of each GPU. Two workers sharing a GPU
    # need less than half each; a re-formation briefly holds an old and a new client.
    memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION
    preallocate: bool = False  # reserve the whole share up front (XLA's default is True)
    # FLOP/s of each device of a simulated accelerator (`isthmus.worker.simulated`): programs
    # take wall time but no CPU after their first call, and their results are wrong. 0: off.
    simulate_flops: float = 0.0
    # Where compiled executables persist across restarts (`worker/compile_cache.py`).
    compile_cache: CacheConfig | None = None

    def __post_init__(self) -> None:
        if self.name not in PLATFORMS:
            raise ValueError(f"--platform must be one of {', '.join(PLATFORMS)}, not "
                             f"{self.name!r}")
        if self.simulate_flops < 0:
            raise ValueError(f"--simulate-flops must be positive, not {self.simulate_flops:g}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 1], not "
                             f"{self.memory_fraction}")


def parse_gpus(text: str | None) -> tuple[int, ...] | None:
    """`"0,1"` -> (0, 1); None or "" -> None."""
    if not text:
        return None
    try:
        gpus = tuple(int(g) for g in text.split(","))
    except ValueError:
        raise ValueError(f"--gpus takes GPU numbers separated by commas (0,1), "
                         f"not {text!r}") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus takes distinct GPU numbers, not {text!r}")
    return gpus


def visible_gpus(environ: Mapping[str, str] = os.environ) -> tuple[int, ...]:
    """The GPUs this machine shows a new process, without touching CUDA (which would claim
    memory): CUDA_VISIBLE_DEVICES when set, else the NVIDIA driver's list."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        names = [g for g in listed.split(",") if g.strip() and g.strip() != "-1"]
        return tuple(range(len(names)))  # numbered as the process will see them
    try:
        return tuple(range(len(os.listdir("/proc/driver/nvidia/gpus"))))
    except OSError:
        return ()


def cuda_plugin_installed() -> bool:
    """Whether jax's CUDA plugin is importable (without importing or initialising it)."""
    import importlib.util

    for version in (12, 13):
        try:
            if importlib.util.find_spec(f"jax_plugins.xla_cuda{version}") is not None:
                return True
        except ImportError:  # no jax_plugins package at all
            return False
    return False


def libtpu_installed() -> bool:
    """Whether libtpu is importable (without loading it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("libtpu") is not None
    except ImportError:
        return False


def visible_tpu_chips(dev: str = "/dev") -> int:
    """The TPU chips this process may open, without opening them: the accel devices
    (/dev/accelN), else the VFIO groups (/dev/vfio/N, v5e and later), else the chips on
    the PCI bus (a machine may show its whole host's chips on the bus but hand a sandbox
    only some: a v5litepod-4 host showed 4 there and 1 group in /dev/vfio)."""
    import glob

    accel = [p for p in glob.glob(f"{dev}/accel*") if p[len(dev) + 6:].isdigit()]
    if accel:
        return len(accel)
    try:
        groups = [n for n in os.listdir(f"{dev}/vfio") if n.isdigit()]
    except OSError:
        groups = []
    return len(groups) if groups else jax_compat.tpu_chips()


def resolve(name: str) -> str:
    """`auto` -> `tpu` where libtpu and TPU chips are present, else `cuda` where a GPU and
    jax's CUDA plugin are, else `cpu`."""
    if name != "auto":
        return name
    if libtpu_installed() and visible_tpu_chips() > 0:
        return "tpu"
    return "cuda" if visible_gpus() and cuda_plugin_installed() else "cpu"


def check_local_tpu() -> None:
    """Raises PlatformUnavailable, without touching libtpu, where TPU workers would fail."""
    if not libtpu_installed():
        raise _no_tpu("libtpu is not installed in this Python")
    if visible_tpu_chips() == 0:
        raise _no_tpu("this machine shows no TPU chip")


def _no_tpu(reason: str) -> PlatformUnavailable:
    return PlatformUnavailable(
        f"TPU was asked for but {reason}; install jax with libtpu (pip install 'jax[tpu]') "
        "on a TPU machine, or use --platform cpu.")


# The process's TPU client, once made. A worker describes its devices at start and joins a
# collective group later, and again at every re-formation (a TPU group is one process's):
# they share this client, so the chips are opened once (not twice at each start) and a new
# group's client never holds the chips' memory beside the old one's.
_TPU_CLIENT: list[JaxlibClient] = []


def make_tpu_client() -> JaxlibClient:
    """The client of the chips this process may use (libtpu's environment says which: one
    process at a time may hold a chip), made at the first call and the same one after."""
    if _TPU_CLIENT:
        return _TPU_CLIENT[0]
    check_local_tpu()
    try:
        client = jax_compat.make_tpu_client()
    except Exception as e:  # noqa: BLE001 - libtpu says why in its message
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _no_tpu(f"libtpu could not open the chips ({first[:300]}; another process "
                      "may hold them)") from None
    if not client.local_devices():
        raise _no_tpu("libtpu found no chip")
    _TPU_CLIENT.append(client)
    return client


def check_local_cuda() -> None:
    """Raises PlatformUnavailable, without touching CUDA, where local CUDA workers would
    fail: no CUDA plugin in this Python, or no GPU."""
    if not cuda_plugin_installed():
        raise _no_cuda("jax's CUDA plugin is not installed in this Python")
    if not visible_gpus():
        raise _no_cuda("this machine shows no GPU (none in /proc/driver/nvidia/gpus, or "
                       "CUDA_VISIBLE_DEVICES is empty)")


def prepare_process(platform: Platform, environ: MutableMapping[str, str] = os.environ
                    ) -> None:
    """Sets what jax and XLA read at start-up. Call before any client is made."""
    # jax's own default backends stay on the CPU: the accelerator client is ours.
    environ["JAX_PLATFORMS"] = "cpu"
    environ.pop("JAX_BACKEND_TARGET", None)
    if platform.name in ("cpu", "tpu"):  # libtpu's own environment says which chips
        return
    if platform.gpus is not None:
        # GPU numbers index CUDA_VISIBLE_DEVICES where it is set (as CUDA numbers them for
        # this process), else the machine's GPUs.
        listed = environ.get("CUDA_VISIBLE_DEVICES")
        names = [g.strip() for g in listed.split(",")] if listed else None
        if names is not None and any(g >= len(names) for g in platform.gpus):
            raise ValueError(f"--gpus {','.join(map(str, platform.gpus))}: this process may "
                             f"use {len(names)} GPUs (CUDA_VISIBLE_DEVICES={listed})")
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(
            names[g] if names is not None else str(g) for g in platform.gpus)
    if "XLA_CLIENT_MEM_FRACTION" not in environ:
        environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{platform.memory_fraction:g}"
    environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE",
                       "true" if platform.preallocate else "false")


def _cuda_plugin_registered() -> bool:
    return "cuda" in jax_compat.discover_backends()  # imports jax_plugins.xla_cuda1x


def _no_cuda(reason: str) -> PlatformUnavailable:
    return PlatformUnavailable(
        f"CUDA was asked for but {reason}; install jax's CUDA plugin (pip install "
        "'isthmus[cuda12]' or 'isthmus[cuda13]', matching the driver) on a machine with an "
        "NVIDIA GPU, or use --platform cpu.")


def make_cuda_client(distributed_client: DistributedClient | None = None, node_id: int = 0,
                     num_nodes: int = 1) -> JaxlibClient:
    """A client over the GPUs this process may see; NCCL collectives when distributed."""
    if not _cuda_plugin_registered():
        raise _no_cuda("jax's CUDA plugin is not installed in this Python")
    xla_client = jax_compat.xla_client()
    try:
        if not xla_client.pjrt_plugin_initialized("cuda"):
            xla_client.initialize_pjrt_plugin("cuda")
        options = dict(xla_client.generate_pjrt_gpu_plugin_options())
        if distributed_client is not None:
            options.update(node_id=node_id, num_nodes=num_nodes)
        client = xla_client.make_c_api_client("cuda", options, distributed_client)
    except PlatformUnavailable:
        raise
    except Exception as e:
        if distributed_client is not None:
            raise  # joining a group failed: the caller says so, with this error
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _no_cuda(f"the CUDA plugin found no usable GPU ({first})") from None
    if not client.local_devices():
        raise _no_cuda("the CUDA plugin found no GPU")
    return client


def make_client(platform: str, num_devices: int,
                distributed_client: DistributedClient | None = None, node_id: int = 0,
                num_nodes: int = 1, collectives: CpuCollectives | None = None) -> JaxlibClient:
    """The client a worker serves: `num_devices` CPU devices, or its GPUs or TPU chips (all
    it sees)."""
    if platform == "tpu":
        if distributed_client is not None:
            raise PlatformUnavailable(
                "a TPU group over several processes is not served yet (docs/tpu.md): run "
                "one worker per TPU host, each its own slice, or the embedded backend.")
        client = make_tpu_client()
        if len(client.local_devices()) != num_devices:
            raise PlatformUnavailable(
                f"this process sees {len(client.local_devices())} TPU chips but serves "
                f"{num_devices}; serve exactly that many (--devices, --devices-per-host).")
        return client
    if platform == "cuda":
        client = make_cuda_client(distributed_client, node_id, num_nodes)
        if len(client.local_devices()) != num_devices:
            raise PlatformUnavailable(
                f"this worker sees {len(client.local_devices())} GPUs but serves "
                f"{num_devices}; give it exactly that many (--gpus, or CUDA_VISIBLE_DEVICES).")
        return client
    from isthmus.worker.slots import make_cpu_client

    extra: dict[str, object] = {}
    if distributed_client is not None:
        extra = dict(distributed_client=distributed_client, node_id=node_id,
                     num_nodes=num_nodes, collectives=collectives)
    return make_cpu_client(num_devices, **extra)


def join_group(address: str, node_id: int, num_nodes: int, platform: str, devices: int,
               timeout: int, gloo_scheduling: str = scheduling.DEFAULT
               ) -> tuple[DistributedClient, JaxlibClient]:
    """Joins the collective group whose coordinator is at `address` (blocking): returns the
    distributed-runtime client (keep it alive) and the device client made in the group.
    A CPU group's gloo loop thread gets `gloo_scheduling` (`worker/scheduling.py`)."""
    _jax = jax_compat.jaxlib_extension()
    distributed = _jax.get_distributed_runtime_client(
        address, node_id, init_timeout=timeout, shutdown_on_destruction=False)
    distributed.connect()
    # CPU collectives cross processes through gloo; CUDA ones through NCCL, which the GPU
    # client sets up itself over the same distributed runtime. A group of one process
    # crosses none: no gloo (whose TCP sockets a sandbox may refuse), and a TPU host's
    # chips talk among themselves (a slice of several hosts: docs/tpu.md).
    collectives = None
    if platform == "cpu" and num_nodes > 1:
        collectives, started = scheduling.started_by(
            lambda: _jax.make_gloo_tcp_collectives(distributed))
        scheduling.schedule_loop(started, gloo_scheduling)
    if platform == "tpu" and num_nodes == 1:
        return distributed, make_client(platform, devices)
    return distributed, make_client(platform, devices, distributed_client=distributed,
                                    node_id=node_id, num_nodes=num_nodes,
                                    collectives=collectives)


@dataclasses.dataclass(frozen=True, slots=True)
class Description:
    """What a worker tells the controller about its devices (from a client of its own)."""

    platform: str
    devices: int
    device_kind: str
    memory_kinds: tuple[str, ...]  # the default first
    companions: bool = False  # each device has a colocated CPU device (accelerators do)
    # Per device, in local order: its backend's attributes (`device_attributes`).
    attributes: tuple[tuple[tuple[str, int | tuple[int, ...]], ...], ...] = ()


def stand_in(environ: Mapping[str, str] = os.environ) -> bool:
    """CPU devices are served as accelerators (`STAND_IN_ENV`; tests only)."""
    return environ.get(STAND_IN_ENV, "") not in ("", "0")


def describe(platform: Platform, cpu_devices: int) -> Description:
    """Resolves `auto` and reads the device kind and memory kinds off a real client."""
    name = platform.name
    if name == "auto":
        name = resolve(name)
        if name == "cuda":
            try:
                client = make_cuda_client()
            except PlatformUnavailable:
                name = "cpu"
            else:
                return describe_client("cuda", client)
    if name == "tpu":
        return describe_client("tpu", make_tpu_client())
    if name == "cpu":
        if stand_in():
            return Description("cpu", cpu_devices, STAND_IN_KIND, CPU_MEMORY_KINDS, True)
        return Description("cpu", cpu_devices, "cpu", CPU_MEMORY_KINDS)
    return describe_client("cuda", make_cuda_client())


def describe_client(name: str, client: JaxlibClient) -> Description:
    devices = client.local_devices()
    first = devices[0]
    default = first.default_memory().kind
    kinds = [m.kind for m in first.addressable_memories()]
    kinds = tuple([default] + [k for k in kinds if k != default])
    if name == "cpu" and stand_in():
        return Description(name, len(devices), STAND_IN_KIND, kinds, True)
    return Description(name, len(devices), first.device_kind, kinds, name != "cpu",
                       tuple(device_attributes(d) for d in devices))


ATTRIBUTES = ("coords", "core_on_chip")  # what jax reads of a TPU device beyond its id


def device_attributes(device: JaxlibDevice) -> tuple[tuple[str, int | tuple[int, ...]], ...]:
    """The backend's attributes of a jaxlib device that a client needs as they are: a TPU's
    chip coordinates and core (jax builds TPU meshes from them); none for CPU and GPU."""
    found: list[tuple[str, int | tuple[int, ...]]] = []
    for name in ATTRIBUTES:
        value = getattr(device, name, None)
        if isinstance(value, int):
            found.append((name, int(value)))
        elif isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            found.append((name, tuple(int(v) for v in value)))
    return tuple(found)


def companion_devices(primary: dict[int, JaxlibDevice], client: JaxlibClient, base: int
                      ) -> dict[int, JaxlibDevice]:
    """The colocated CPU devices of a group's accelerators: `primary` maps global ids to
    the accelerators' jaxlib devices (every host's), `client` is the CPU client of the
    group's colocated devices, which has as many per host. The r-th accelerator of a host
    (by global id) has that host's r-th CPU device, whose global id is `base` plus its own.
    """
    accelerators: dict[int, list[int]] = {}
    for g in sorted(primary):
        accelerators.setdefault(primary[g].process_index, []).append(g)
    cpus: dict[int, list[JaxlibDevice]] = {}
    for device in sorted(client.devices(), key=lambda d: d.id):
        cpus.setdefault(device.process_index, []).append(device)
    mapping = {}
    for process, ids in accelerators.items():
        found = cpus.get(process, [])
        if len(found) != len(ids):
            raise errors.InternalError(
                f"host {process} of the group has {len(ids)} accelerators but {len(found)} "
                "colocated CPU devices; this is a bug in isthmus: please report it.")
        mapping.update({base + g: cpu for g, cpu in zip(ids, found)})
    return mapping


def device_memory(client: JaxlibClient, devices: dict[int, JaxlibDevice]) -> dict[str, int]:
    """A jaxlib client's own memory figures, summed over its devices, and per device as
    `memory/<global id>/<figure>` (GPU clients keep them; jaxlib's CPU client does
    not, and then there are none)."""
    totals: dict[str, int] = {}
    global_ids: dict[JaxlibDevice, int] | None = None
    for device in client.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - a client without statistics
            return {}
        if not stats:
            return {}
        if global_ids is None:
            global_ids = {d: g for g, d in devices.items()}
        for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            if key in stats:
                totals[f"device_{key}"] = totals.get(f"device_{key}", 0) + int(stats[key])
                if device in global_ids:
                    totals[f"memory/{global_ids[device]}/{key}"] = int(stats[key])
    return totals


def default_layout(device: JaxlibDevice | None, dtype: str, shape: tuple[int, ...]) -> str:
    """The backend's default layout of an array of `dtype` (a numpy name) and `shape` on a
    jaxlib `device` (None: not this host's), as XLA writes it: row-major on CPU and GPU
    ("{1,0}"), tiled and often transposed on a TPU ("{0,1:T(8,128)}")."""
    from isthmus.transport.messages import dtype_of

    if device is None:
        raise errors.InvalidRequest("the device is not on this host.")
    try:
        return str(device.client.get_default_layout(dtype_of(dtype), tuple(shape), device))
    except Exception as e:  # noqa: BLE001 - a dtype or shape this backend refuses
        raise errors.from_runtime_error(
            e, errors.InvalidRequest, "the backend has no default layout for it") from None
