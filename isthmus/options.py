"""Options the `isthmus` commands share (platform, fleet TLS, fleet token), and how a bad one
is refused: one line naming it and the fix, exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from isthmus.transport.auth import TOKEN_ENVIRONMENT
from isthmus.transport.tls import TlsConfig
from isthmus.transport.tls import from_options as tls_from_options
from isthmus.worker.compile_cache import CacheConfig, CompileCache, parse_size
from isthmus.worker.platforms import DEFAULT_GPU_MEMORY_FRACTION, PLATFORMS, Platform, parse_gpus


def refuse(message: str) -> NoReturn:
    """A bad option or environment: one line naming it and the fix, exit code 2."""
    print(f"isthmus: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as Linux writes one ("0-3,8,10-11") -> its CPU numbers; ValueError names
    what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list such as 0-3,8")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"{part.strip()!r} in {text!r} runs backwards")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def cpu_list(cpus: frozenset[int] | set[int] | list[int]) -> str:
    """CPU numbers -> a CPU list ("0-3,8"): the inverse of `parse_cpus`."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def require_affinity(flag: str) -> None:
    """Refuses `flag` where threads cannot be pinned (sched_setaffinity: Linux only)."""
    if not hasattr(os, "sched_setaffinity"):
        refuse(f"{flag} pins threads with sched_setaffinity, which only Linux has; drop it")


def pin_to_cpus(text: str) -> None:
    """`--cpus`: this process (and what it starts) runs on those CPUs only, which must be
    among those it may use now; refuses otherwise."""
    require_affinity("--cpus")
    try:
        cpus = parse_cpus(text)
    except ValueError as e:
        refuse(f"--cpus: {e}")
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        refuse(f"--cpus {text}: CPU {cpu_list(cpus - allowed)} is not among those this "
               f"process may use ({cpu_list(allowed)}); pick from those")
    # Every thread, those an import started already (gRPC's) too; new ones inherit it.
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), cpus)
        except ProcessLookupError:
            pass  # it has ended


def fleet_token(args: argparse.Namespace) -> str:
    """The fleet's shared secret: --token-file, else $ISTHMUS_FLEET_TOKEN, else none (any
    worker that reaches the controller may join: a network the fleet trusts)."""
    if args.token_file:
        from isthmus.controller.tenants import read_token

        try:  # a FIFO or a device is refused, not read (reading one would wait)
            return read_token(args.token_file, "--token-file")
        except ValueError as e:  # "--token-file PATH: No such file or directory"
            refuse(str(e).removeprefix("cannot read "))
    return os.environ.get(TOKEN_ENVIRONMENT, "").strip()


def tls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help="mutual TLS between the fleet's members: this member's "
                             "certificate (signed by --tls-ca, with the name isthmus-fleet); "
                             "launched workers get the same files")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="the fleet CA's certificate, which every member's must be "
                             "signed by")


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    try:
        return tls_from_options(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as e:
        refuse(str(e))


def platform_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--platform", choices=PLATFORMS, default="cpu",
                        help="devices to serve: cpu, cuda (NVIDIA GPUs through jax's CUDA "
                             "plugin), tpu (TPU chips through libtpu), or auto (tpu where "
                             "libtpu finds chips, else cuda where a GPU and the plugin are "
                             "present, else cpu) (default: cpu)")
    parser.add_argument("--gpus", default=None,
                        help="GPUs to use, e.g. 0,1 (default: CUDA_VISIBLE_DEVICES, or all)")
    parser.add_argument("--gpu-memory-fraction", type=float,
                        default=DEFAULT_GPU_MEMORY_FRACTION,
                        help="the share of each GPU a device client may use; a local fleet "
                             "divides it among the workers that share a GPU (default: "
                             f"{DEFAULT_GPU_MEMORY_FRACTION})")
    parser.add_argument("--simulate-flops", type=float, default=0.0, metavar="RATE",
                        help="benchmarks only: simulated accelerators of RATE FLOP/s per "
                             "device; each program runs for real once, then takes its FLOPs / "
                             "RATE of wall time and no CPU, with wrong results (CPU only)")
    parser.add_argument("--compile-cache", default=None, metavar="DIR_OR_URL",
                        help="keep compiled programs in this directory (or fsspec URL, e.g. "
                             "gs://bucket/path with gcsfs installed), so that they are loaded, "
                             "not compiled, after a restart; loading an entry runs its code, "
                             "so let only trusted servers write there")
    parser.add_argument("--compile-cache-namespace", default="default", metavar="NAME",
                        help="the tenant's part of a shared --compile-cache (default: "
                             "default)")
    parser.add_argument("--compile-cache-size", default="4G", metavar="BYTES",
                        help="least recently used programs leave the cache past this size, "
                             "e.g. 512M, 4G (default: 4G)")


def platform_config(args: argparse.Namespace) -> Platform:
    try:
        if args.simulate_flops and args.platform != "cpu":
            raise ValueError("--simulate-flops simulates accelerators on the CPU; drop "
                             f"--platform {args.platform}")
        cache = None
        if args.compile_cache:
            cache = CacheConfig(args.compile_cache, args.compile_cache_namespace,
                                parse_size(args.compile_cache_size, "--compile-cache-size"))
            try:
                CompileCache(cache)  # makes the directory: a bad location fails here
            except OSError as e:
                raise ValueError(f"--compile-cache {cache.location}: {e.strerror or e}; "
                                 "give a directory this user can write") from None
        return Platform(args.platform, parse_gpus(args.gpus), args.gpu_memory_fraction,
                        simulate_flops=args.simulate_flops, compile_cache=cache)
    except ValueError as e:
        refuse(str(e))
