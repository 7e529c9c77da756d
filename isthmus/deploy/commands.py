"""The `isthmus slurm` and `isthmus k8s` commands: their options, and what they run."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import Any

from isthmus import options, serve
from isthmus.deploy.kubernetes import TENANTS_DIR, TENANTS_FILE
from isthmus.lease_cli import add_server_arguments, shared_config


def add_deploy_commands(commands: Any,
                        platform_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    """Adds `slurm` and `k8s` to the command line's subcommands."""
    slurm = commands.add_parser(
        "slurm", help="run a fleet in this Slurm allocation (from a batch script), and a "
                      "client command if given", usage="isthmus slurm [options] [-- CMD ...]")
    slurm.add_argument("--hosts-per-slice", type=int, default=1,
                       help="consecutive tasks that form one slice (default: 1)")
    slurm.add_argument("--devices-per-host", type=int, default=4,
                       help="CPU devices per worker, or GPUs per worker task (default: 4)")
    platform_arguments(slurm)
    slurm.add_argument("--port", type=int, default=0,
                       help="the controller's port on the first node (default: a free one)")
    slurm.add_argument("--address-file", default=None, metavar="PATH",
                       help="write grpc://HOST:PORT here for clients outside the job")
    slurm.add_argument("--log-level", default=os.environ.get("ISTHMUS_LOG_LEVEL", "WARNING"))
    # A shared service (--tenants FILE ...): the options of `isthmus up`, passed on as given.
    add_server_arguments(slurm)
    slurm.add_argument("command", nargs=argparse.REMAINDER, help="the client to run")
    k8s = commands.add_parser("k8s", help="Kubernetes manifests for a fleet")
    k8s_commands = k8s.add_subparsers(dest="k8s_command", required=True)
    render = k8s_commands.add_parser(
        "render", help="write the manifests of a fleet (a JobSet, or a Deployment and "
                       "StatefulSets) to stdout or a file; see docs/kubernetes.md")
    render.add_argument("--slices", type=int, default=1)
    render.add_argument("--hosts-per-slice", type=int, default=2)
    render.add_argument("--devices-per-host", type=int, default=4,
                        help="CPU devices, GPUs (nvidia.com/gpu) or TPU chips "
                             "(google.com/tpu: a TPU host's, all of them) per worker pod")
    render.add_argument("--platform", choices=("cpu", "cuda", "tpu"), default="cpu")
    render.add_argument("--tpu-accelerator", default="tpu-v5-lite-podslice",
                        help="the GKE TPU node pool's accelerator type (node label "
                             "cloud.google.com/gke-tpu-accelerator; default: "
                             "tpu-v5-lite-podslice)")
    render.add_argument("--tpu-topology", default="",
                        help="one slice's TPU topology, e.g. 2x4 (node label "
                             "cloud.google.com/gke-tpu-topology; default: devices-per-host x "
                             "hosts-per-slice)")
    render.add_argument("--image", default="python:3.12-slim",
                        help="a container image with isthmus installed (and jax's CUDA "
                             "plugin for --platform cuda)")
    render.add_argument("--name", default="isthmus", help="prefix of every object's name")
    render.add_argument("--namespace", default=None)
    render.add_argument("--variant", choices=("jobset", "plain"), default="jobset",
                        help="jobset: one JobSet (needs the JobSet controller); plain: a "
                             "Deployment and a StatefulSet per slice (default: jobset)")
    render.add_argument("--compile-cache", default=None, metavar="URL",
                        help="a compilation cache every pod reaches (gs://..., s3://...)")
    render.add_argument("--tenants-secret", default=None, metavar="SECRET",
                        help="serve as a shared service (docs/shared.md): the Secret with "
                             f"{TENANTS_FILE} and the token files it names, mounted at "
                             f"{TENANTS_DIR}; needs --service-tls-secret")
    render.add_argument("--service-tls-secret", default=None, metavar="SECRET",
                        help="a shared service's client port certificate: a kubernetes.io/tls "
                             "Secret (e.g. cert-manager's) naming NAME-controller")
    render.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")


def slurm_command(args: argparse.Namespace) -> int:
    """`isthmus slurm`: a fleet in this allocation (deploy/slurm.py)."""
    from isthmus.deploy import slurm

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    platform = ["--platform", args.platform, "--simulate-flops", f"{args.simulate_flops:g}"]
    if args.gpus:
        platform += ["--gpus", args.gpus]
    if args.compile_cache:
        platform += ["--compile-cache", args.compile_cache, "--compile-cache-namespace",
                     args.compile_cache_namespace, "--compile-cache-size",
                     args.compile_cache_size]
    service = service_options(args)
    if args.unix_socket and not args.tenants:  # the job's command reaches it over TCP
        options.refuse("--unix-socket is for a shared service: add --tenants")
    try:
        options.platform_config(args)  # refuses bad platform options before anything starts
        fleet = slurm.plan(os.environ, args.hosts_per_slice, args.devices_per_host, args.port)
        arguments = slurm.server_arguments(fleet, [*platform, "--log-level", args.log_level],
                                           command, service)
    except ValueError as e:
        options.refuse(str(e))
    server = serve.server_parser().parse_args(arguments)
    shared_config(server)  # refuses a bad tenants file before any worker starts
    serve.prepare_server_process(server)
    step = slurm.start_workers(fleet, platform, os.environ)  # type: ignore[arg-type]
    slurm.write_address(args.address_file, fleet)
    role = f"shared service (tenants: {args.tenants})" if args.tenants else "controller"
    print(f"isthmus slurm: job {fleet.job_id}, {fleet.workers} workers in {fleet.slices} "
          f"slices; {role} at grpc://{fleet.host}:{fleet.port}", file=sys.stderr,
          flush=True)
    try:
        return asyncio.run(serve.run(server) if command else serve.up(server))
    except KeyboardInterrupt:
        return 0
    finally:
        slurm.stop_workers(step)


def service_options(args: argparse.Namespace) -> list[str]:
    """The shared service's options given to `isthmus slurm`, as `isthmus up` takes them:
    each option of `add_server_arguments` that differs from its default."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_server_arguments(defaults)
    options: list[str] = []
    for dest, default in vars(defaults.parse_args([])).items():
        value = getattr(args, dest)
        if value != default:
            flag = "--" + dest.replace("_", "-")
            options += [flag] if value is True else [flag, str(value)]
    return options


def k8s_command(args: argparse.Namespace) -> int:
    """`isthmus k8s render`: the manifests of a fleet (deploy/kubernetes.py)."""
    from isthmus.deploy.kubernetes import FleetShape, render, to_yaml

    try:
        shape = FleetShape(args.slices, args.hosts_per_slice, args.devices_per_host,
                           args.platform, args.image, args.name, args.namespace,
                           compile_cache=args.compile_cache,
                           tenants_secret=args.tenants_secret,
                           service_tls_secret=args.service_tls_secret,
                           tpu_accelerator=args.tpu_accelerator,
                           tpu_topology=args.tpu_topology)
        text = to_yaml(render(shape, args.variant))
    except ValueError as e:
        options.refuse(str(e))
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
    return 0
