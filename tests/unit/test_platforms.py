"""Platforms: what a worker serves, and how a local fleet hands out GPUs (no GPU needed)."""

import pytest

from isthmus.compat import jax as jax_compat
from isthmus.launch import LocalLauncher
from isthmus.worker import platforms
from isthmus.worker.platforms import Platform


def test_options_are_checked():
    assert platforms.parse_gpus("0,2") == (0, 2)
    assert platforms.parse_gpus("") is None
    with pytest.raises(ValueError, match="distinct"):
        platforms.parse_gpus("1,1")
    with pytest.raises(ValueError, match="commas"):
        platforms.parse_gpus("a")
    with pytest.raises(ValueError, match="--platform"):
        Platform("gpu")
    with pytest.raises(ValueError, match="memory-fraction"):
        Platform("cuda", memory_fraction=0)


def test_prepare_process_gives_a_cuda_worker_its_gpus_and_a_memory_share():
    env = {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": "x"}
    platforms.prepare_process(Platform("cuda", (2, 3), 0.4), env)
    assert env == {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "2,3",
                   "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4",
                   "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    mine = {"XLA_CLIENT_MEM_FRACTION": "0.2", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    platforms.prepare_process(Platform("cuda"), mine)  # the user's own settings win
    assert mine["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in mine
    # Under CUDA_VISIBLE_DEVICES (a scheduler's choice), GPU numbers index that list.
    scheduled = {"CUDA_VISIBLE_DEVICES": "4,GPU-ab12,6"}
    platforms.prepare_process(Platform("cuda", (1, 2)), scheduled)
    assert scheduled["CUDA_VISIBLE_DEVICES"] == "GPU-ab12,6"
    with pytest.raises(ValueError, match="may use 1 GPUs"):
        platforms.prepare_process(Platform("cuda", (1,)), {"CUDA_VISIBLE_DEVICES": "3"})
    cpu = {}
    platforms.prepare_process(Platform("cpu"), cpu)
    assert cpu == {"JAX_PLATFORMS": "cpu"}


def test_visible_gpus_never_touch_cuda():
    assert platforms.visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}) == (0, 1)
    assert platforms.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert platforms.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == ()


def test_without_the_plugin_cuda_is_one_clear_error_and_auto_is_cpu():
    if platforms.cuda_plugin_installed():
        pytest.skip("jax's CUDA plugin is installed here")
    with pytest.raises(platforms.PlatformUnavailable, match="isthmus\\[cuda12\\]"):
        platforms.make_cuda_client()
    with pytest.raises(platforms.PlatformUnavailable, match="--platform cpu"):
        platforms.check_local_cuda()
    assert platforms.resolve("auto") == "cpu"
    described = platforms.describe(Platform("auto"), 3)
    assert described == platforms.Description("cpu", 3, "cpu", platforms.CPU_MEMORY_KINDS)


def _options(slices, hosts, per_host, platform):
    launcher = LocalLauncher("127.0.0.1:1", slices, hosts, per_host, platform=platform)
    return [launcher.platform_options(s, h) for s in range(slices) for h in range(hosts)]


def test_a_local_cuda_fleet_shares_out_its_gpus():
    # Two workers of one GPU each on a machine with one GPU: both on GPU 0, half the share.
    assert _options(2, 1, 1, Platform("cuda", (0,), 0.8)) == [
        ["--platform", "cuda", "--gpus", "0", "--gpu-memory-fraction", "0.4"]] * 2
    # Four GPUs, two hosts of two: each worker owns two, all of their share.
    got = _options(1, 2, 2, Platform("cuda", (0, 1, 2, 3), 0.75))
    assert [o[3] for o in got] == ["0,1", "2,3"] and {o[5] for o in got} == {"0.75"}
    with pytest.raises(ValueError, match="2 GPUs per host"):
        _options(1, 1, 2, Platform("cuda", (0,)))
    assert _options(1, 2, 4, Platform("cpu")) == [[], []]


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


class _Client:
    def __init__(self, *stats):
        self.devices = [_Device(s) for s in stats]

    def local_devices(self):
        return self.devices


def test_device_memory_comes_from_the_workers_client_and_shows_in_status():
    from types import SimpleNamespace

    from isthmus.status import render
    from isthmus.worker.host import DeviceHost

    gib = 1 << 30
    gpu = SimpleNamespace(client=_Client(
        {"bytes_in_use": gib, "peak_bytes_in_use": 2 * gib, "bytes_limit": 60 * gib},
        {"bytes_in_use": gib, "peak_bytes_in_use": gib, "bytes_limit": 60 * gib}))
    memory = DeviceHost.device_memory(gpu)
    assert memory == {"device_bytes_in_use": 2 * gib, "device_peak_bytes_in_use": 3 * gib,
                      "device_bytes_limit": 120 * gib}
    assert DeviceHost.device_memory(SimpleNamespace(client=_Client(None))) == {}  # CPU
    status = {"platform": {"name": "cuda"}, "generation": 1, "sessions": {}, "executables": 0,
              "devices": [{"id": 0, "worker": 0, "slice": 0, "host": 0, "kind": "H200"}],
              "workers": {"0": {"buffers": 1, "bytes": 4, **memory}}}
    assert "device memory: 2.0 GiB in use (peak 3.0 GiB) of 120.0 GiB" in render(status)


def test_the_cuda_client_is_made_through_the_plugin_with_the_group(monkeypatch):
    """The CUDA path without a GPU: the calls into jaxlib, with a stand-in plugin."""
    xla_client = jax_compat.xla_client()
    calls = []

    class Client:
        def __init__(self, n):
            self.n = n

        def local_devices(self):
            return [object()] * self.n

    monkeypatch.setattr(platforms, "_cuda_plugin_registered", lambda: True)
    monkeypatch.setattr(xla_client, "pjrt_plugin_initialized", lambda name: False)
    monkeypatch.setattr(xla_client, "initialize_pjrt_plugin", lambda name: calls.append(name))
    monkeypatch.setattr(xla_client, "generate_pjrt_gpu_plugin_options",
                        lambda: {"platform_name": "cuda", "memory_fraction": 0.4})
    made = []

    def make(name, options, distributed):
        made.append((name, dict(options), distributed))
        return Client(2)

    monkeypatch.setattr(xla_client, "make_c_api_client", make)
    group = object()
    client = platforms.make_client("cuda", 2, distributed_client=group, node_id=1,
                                   num_nodes=3)
    assert isinstance(client, Client) and calls == ["cuda"]
    assert made == [("cuda", {"platform_name": "cuda", "memory_fraction": 0.4, "node_id": 1,
                              "num_nodes": 3}, group)]
    with pytest.raises(platforms.PlatformUnavailable, match="sees 2 GPUs but serves 4"):
        platforms.make_client("cuda", 4)

    def broken(name, options, distributed):
        raise RuntimeError("INTERNAL: no CUDA-capable device is detected\nmore")

    monkeypatch.setattr(xla_client, "make_c_api_client", broken)
    with pytest.raises(platforms.PlatformUnavailable, match="no CUDA-capable device") as info:
        platforms.make_cuda_client()
    assert "\n" not in str(info.value)


def test_colocated_cpu_devices_pair_with_accelerators_host_by_host(monkeypatch):
    class Dev:
        def __init__(self, id, process_index):
            self.id, self.process_index = id, process_index

    class Client:
        def __init__(self, devices):
            self._devices = devices

        def devices(self):
            return self._devices

    # Two hosts with two accelerators each (global ids 0..3); the CPU client numbers its
    # devices its own way.
    accelerators = {0: Dev(10, 0), 1: Dev(11, 0), 2: Dev(20, 1), 3: Dev(21, 1)}
    cpus = [Dev(131073, 1), Dev(0, 0), Dev(131072, 1), Dev(1, 0)]
    mapping = platforms.companion_devices(accelerators, Client(cpus), 1000)
    assert {g: (d.process_index, d.id) for g, d in mapping.items()} == {
        1000: (0, 0), 1001: (0, 1), 1002: (1, 131072), 1003: (1, 131073)}
    with pytest.raises(Exception, match="bug in isthmus"):
        platforms.companion_devices(accelerators, Client(cpus[:3]), 1000)
    # The stand-in for tests: a CPU worker describes accelerators that have them.
    monkeypatch.setenv(platforms.STAND_IN_ENV, "1")
    described = platforms.describe(Platform("cpu"), 3)
    assert (described.device_kind, described.companions) == (platforms.STAND_IN_KIND, True)
    monkeypatch.delenv(platforms.STAND_IN_ENV)
    assert not platforms.describe(Platform("cpu"), 3).companions


def test_visible_tpu_chips_are_those_this_process_may_open(tmp_path, monkeypatch):
    """A sandbox may show a host's four chips on the PCI bus and hand it one VFIO group:
    the chips a local TPU worker owns are the ones it may open."""
    from isthmus.compat import jax as jax_compat
    from isthmus.worker.platforms import visible_tpu_chips

    monkeypatch.setattr(jax_compat, "tpu_chips", lambda: 4)  # the bus
    assert visible_tpu_chips(str(tmp_path)) == 4  # nothing better known
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "vfio").touch()
    (tmp_path / "vfio" / "3").touch()
    assert visible_tpu_chips(str(tmp_path)) == 1
    for n in range(2):
        (tmp_path / f"accel{n}").touch()
    assert visible_tpu_chips(str(tmp_path)) == 2


def test_a_process_opens_the_tpu_once_and_shares_that_client(monkeypatch):
    """A worker's description at start and each of its collective groups get the same TPU
    client, made at the first call: the chips are opened once a process."""
    made = []

    class Chip:
        device_kind = "TPU v5 lite"

    class Client:
        platform = "tpu"

        def local_devices(self):
            return [Chip()]

    def open_chips():
        if made:
            raise RuntimeError("INTERNAL: the chips are open already")
        made.append(Client())
        return made[-1]

    monkeypatch.setattr(platforms, "_TPU_CLIENT", [])
    monkeypatch.setattr(platforms, "check_local_tpu", lambda: None)
    monkeypatch.setattr(jax_compat, "make_tpu_client", open_chips)
    first = platforms.make_tpu_client()
    assert platforms.make_client("tpu", 1) is first
    assert platforms.make_client("tpu", 1) is first  # a later group's
    assert len(made) == 1
    monkeypatch.setattr(platforms, "_TPU_CLIENT", [])  # a fresh process whose open fails
    with pytest.raises(platforms.PlatformUnavailable, match="could not open the chips"):
        platforms.make_tpu_client()
