"""Floods beside a tenant (issue 38, item 6): `python -m bench.shared --floods [--quick]`.

A shared server (its default limits) on a fleet of 3 slices x 1 host x 1 device, tenants
`victim`, `flooder` and `limited` (1 slice each). The victim's steady loop (`bench.shared`'s loop of
pipelined tiny jitted programs, started by `isthmus run --service`, as users run a job) is
timed alone, then beside each of:

- *hog N*: N plain CPU hogs (`while True: pass` processes) - what the same number of busy
  processes cost the machine, with nothing sent to the service;
- *Status flood*: N strangers, each from an address of its own (127.0.0.2, ...: another host,
  to the service), opening HTTP/2 connections and calling `isthmus.Admin/Status` as fast as
  they can;
- *TLS flood*: N strangers doing TLS handshakes on the client port as fast as they can (and,
  for reference, the same at a port nobody serves: what the machine's TCP stack costs);
- *tenant flood*: the `flooder` tenant running the same loop flat out on its own slice
  (its default max_requests_per_second), and the `limited` tenant doing so with
  `max_requests_per_second = 2000` (`LIMITED_RATE`).

Each flood is compared with the hog of its size (N = 2 for the strangers; for a tenant, 1:
its program, or 2: its program and its `isthmus run`, which here share the machine with the
service as they would not in use); the goal is >= 0.8 (`TARGET`). Medians over rounds, the
scenarios interleaved within each round. No figure here is a test assertion.
"""

from __future__ import annotations

import socket
import ssl
import statistics
import subprocess
import sys
import time
from typing import Any

FLEET = (3, 1, 1)
LIMITED_RATE = 2000  # the `limited` flooder's max_requests_per_second
STRANGERS = ("127.0.0.2", "127.0.0.3")  # each flooding process's own address
TARGET = 0.8  # a flood's steps/s over the hog's of the same size
CALLS_PER_CONNECTION = 8
TENANTS = ("victim", "flooder", "limited")


# ---- the flooding processes (this file as a script) ------------------------------------------


def hog() -> None:
    while True:
        pass


def _status_connection_bytes() -> bytes:
    """A connection's bytes: the HTTP/2 preface, then CALLS_PER_CONNECTION Status calls."""
    import hpack

    def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
        return (len(payload).to_bytes(3, "big") + bytes([kind, flags])
                + stream.to_bytes(4, "big") + payload)

    encoder = hpack.Encoder()
    out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(0x4, 0, 0)
    for stream in range(1, 2 * CALLS_PER_CONNECTION, 2):
        block = encoder.encode([(":method", "POST"), (":scheme", "http"),
                                (":path", "/isthmus.Admin/Status"), (":authority", "x"),
                                ("content-type", "application/grpc"), ("te", "trailers")])
        out += frame(0x1, 0x4, stream, block) + frame(0x0, 0x1, stream, b"\0" * 5)
    return out


def flood_status(target: str, source: str) -> None:
    host, port = target.rsplit(":", 1)
    payload = _status_connection_bytes()
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2,
                                          source_address=(source, 0)) as sock:
                sock.sendall(payload)
                sock.settimeout(0.05)  # what comes back soon, then the next connection
                while sock.recv(1 << 16):
                    pass
        except OSError:
            pass


def flood_tls(target: str, source: str) -> None:
    host, port = target.rsplit(":", 1)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2,
                                          source_address=(source, 0)) as sock, \
                    context.wrap_socket(sock, server_hostname=host):
                pass  # the handshake is the cost
        except (OSError, ssl.SSLError):
            pass


# ---- the driver ------------------------------------------------------------------------------


def _tenant_loop(svc: dict[str, Any], who: str) -> Any:
    from bench.shared_processes import Child, base_env, job_of

    child = Child(["--loop"], base_env(), job_of(svc, who))
    child.pid = int(child.expect("READY", 180).split()[1])
    return child


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait(10)


def run(quick: bool = False) -> dict[str, Any]:
    """Steps/s of the victim's loop in each scenario (medians over rounds) and the ratios."""
    import json

    from bench.shared_processes import cpu_seconds, service

    rounds, seconds = (2, 2.0) if quick else (5, 3.0)
    began = time.monotonic()
    samples: dict[str, list[float]] = {}
    controller_cores: dict[str, list[float]] = {}
    with service(FLEET, {name: "max_slices = 1\n" + (
            f"max_requests_per_second = {LIMITED_RATE}\n" if name == "limited" else "")
            for name in TENANTS}) as svc:
        victim = _tenant_loop(svc, "victim")
        flooders = {"tenant flood": _tenant_loop(svc, "flooder"),
                    "limited tenant flood": _tenant_loop(svc, "limited")}
        controller = svc["server"].process.pid
        target = svc["service"]
        with socket.socket() as unused:  # a port that was free: nobody listens there
            unused.bind(("127.0.0.1", 0))
            closed = f"127.0.0.1:{unused.getsockname()[1]}"

        def measure(name: str, start: Any) -> None:
            extra = start()
            try:
                time.sleep(0.5)  # the flood is under way
                at = time.monotonic() + 0.2
                before, wall = cpu_seconds(controller), time.monotonic()
                victim.send(f"go {at} {seconds}")
                answer = json.loads(victim.expect("{", 60 + seconds))
                cores = (cpu_seconds(controller) - before) / (time.monotonic() - wall)
            finally:
                if isinstance(extra, list):
                    _stop(extra)
                elif extra is not None:  # the flooding tenant: its answer ends its run
                    rates[name] = 1.0 / json.loads(extra.expect("{", 60 + 3 * seconds))[
                        "per_program_s"]
            samples.setdefault(name, []).append(1.0 / answer["per_program_s"])
            controller_cores.setdefault(name, []).append(cores)

        rates: dict[str, float] = {}  # the flooders' own steps/s

        def tenant_flood(name: str) -> Any:
            flooders[name].send(f"go {time.monotonic()} {seconds + 1.5}")
            return flooders[name]

        scenarios = {
            "alone": lambda: [],
            "hog 1": lambda: [_spawn("--hog")],
            "tenant flood": lambda: tenant_flood("tenant flood"),
            "limited tenant flood": lambda: tenant_flood("limited tenant flood"),
            "hog 2": lambda: [_spawn("--hog") for _ in STRANGERS],
            "Status flood 2": lambda: [_spawn("--flood-status", target, s) for s in STRANGERS],
            "TLS flood 2": lambda: [_spawn("--flood-tls", target, s) for s in STRANGERS],
            # The same flood at a port nobody serves: what the machine's TCP stack costs
            # (each connection refused by the kernel), without the service.
            "TLS flood 2, closed port": lambda: [_spawn("--flood-tls", closed, s)
                                                 for s in STRANGERS],
        }
        try:
            for _ in range(rounds):
                for name, start in scenarios.items():
                    measure(name, start)
        finally:
            victim.close()
            for child in flooders.values():
                child.close()
    steps = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "fleet": "x".join(map(str, FLEET)), "rounds": rounds, "seconds": seconds,
        "steps_per_s": steps, "all": samples,
        "controller_cores": {n: statistics.median(v) for n, v in controller_cores.items()},
        "flooder_steps_per_s": rates,
        "ratios": {"tenant flood / hog 1": steps["tenant flood"] / steps["hog 1"],
                   "tenant flood / hog 2": steps["tenant flood"] / steps["hog 2"],
                   "limited tenant flood / hog 1": steps["limited tenant flood"]
                   / steps["hog 1"],
                   "Status flood 2 / hog 2": steps["Status flood 2"] / steps["hog 2"],
                   "TLS flood 2 / hog 2": steps["TLS flood 2"] / steps["hog 2"],
                   "TLS flood 2 / same at a closed port": steps["TLS flood 2"]
                   / steps["TLS flood 2, closed port"]},
        "wall_s": time.monotonic() - began,
    }


def report(results: dict[str, Any]) -> list[str]:
    lines = [f"floods beside a tenant's loop (fleet {results['fleet']}, --tenants, default "
             f"limits; medians of {results['rounds']} rounds of {results['seconds']:g} s; "
             f"goal: flood / hog of its size >= {TARGET}):",
             f"    {'':26}{'steps/s':>9}{'controller cores':>18}"]
    for name, value in results["steps_per_s"].items():
        lines.append(f"    {name:26}{value:9.0f}{results['controller_cores'][name]:18.2f}")
    for name, ratio in results["ratios"].items():
        lines.append(f"    {name:38}{ratio:6.2f}")
    lines.append("    the flooders' own steps/s: " + ", ".join(
        f"{name} {rate:.0f}" for name, rate in results["flooder_steps_per_s"].items()))
    return lines


if __name__ == "__main__":
    if "--hog" in sys.argv:
        hog()
    elif "--flood-status" in sys.argv:
        flood_status(sys.argv[2], sys.argv[3])
    elif "--flood-tls" in sys.argv:
        flood_tls(sys.argv[2], sys.argv[3])
