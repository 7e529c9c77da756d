"""Kubernetes manifests for a fleet: `isthmus k8s render`.

Two variants, the same fleet:

- `jobset` (default): a JobSet (jobset.x-k8s.io/v1alpha2) with a `controller` replicated
  job of one pod and a `slice` replicated job with one Job per slice, each of
  `hosts_per_slice` pods (Indexed); a worker's slice is its Job's index in the JobSet.
- `plain`, for clusters without JobSet: a Deployment for the controller and a StatefulSet
  per slice.

Both come with a headless Service in front of the controller (the workers find it by name),
a Secret holding the fleet token (mounted as a file by every pod), and a NetworkPolicy that
lets only the fleet's pods, and pods labelled as its clients, reach it: the stock client
speaks plain gRPC, so the client port must not be open to the whole cluster. GPU workers
request `nvidia.com/gpu`.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

GRPC_PORT = 8470
FLEET_PORT = 8471
TOKEN_DIR = "/etc/isthmus"


@dataclasses.dataclass(frozen=True, slots=True)
class FleetShape:
    slices: int
    hosts_per_slice: int
    devices_per_host: int
    platform: str = "cpu"
    image: str = "python:3.12-slim"
    name: str = "isthmus"
    namespace: str | None = None
    token: str | None = None  # None: a fresh one in the Secret
    compile_cache: str | None = None  # a URL every pod can reach (gs://...), or None

    def __post_init__(self) -> None:
        for field in ("slices", "hosts_per_slice", "devices_per_host"):
            if getattr(self, field) < 1:
                raise ValueError(f"--{field.replace('_', '-')} must be at least 1")
        if self.platform not in ("cpu", "cuda"):
            raise ValueError(f"--platform must be cpu or cuda, not {self.platform!r}")
        if not self.name.replace("-", "").isalnum() or not self.name[0].isalpha() or (
                self.name != self.name.lower()) or len(self.name) > 40:
            raise ValueError(f"--name {self.name!r} must be a lowercase DNS label of at most "
                             "40 characters")


def render(shape: FleetShape, variant: str = "jobset") -> list[dict[str, Any]]:
    """The manifests, in the order to apply them."""
    if variant not in ("jobset", "plain"):
        raise ValueError(f"--variant must be jobset or plain, not {variant!r}")
    common = [_secret(shape), _service(shape), _network_policy(shape)]
    if variant == "jobset":
        return [*common, _jobset(shape)]
    return [*common, _controller_deployment(shape),
            *(_slice_statefulset(shape, s) for s in range(shape.slices))]


# ---- pieces --------------------------------------------------------------------------------

def _metadata(shape: FleetShape, name: str, role: str | None = None) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "isthmus", "isthmus/fleet": shape.name}
    if role is not None:
        labels["isthmus/role"] = role
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if shape.namespace:
        meta["namespace"] = shape.namespace
    return meta


def _selector(shape: FleetShape, role: str) -> dict[str, str]:
    return {"isthmus/fleet": shape.name, "isthmus/role": role}


def _secret(shape: FleetShape) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": _metadata(shape, f"{shape.name}-token"), "type": "Opaque",
            "stringData": {"token": shape.token or secrets.token_hex(32)}}


def _service(shape: FleetShape) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(shape, f"{shape.name}-controller"),
            "spec": {"clusterIP": "None", "selector": _selector(shape, "controller"),
                     "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT},
                               {"name": "fleet", "port": FLEET_PORT,
                                "targetPort": FLEET_PORT}]}}


def _network_policy(shape: FleetShape) -> dict[str, Any]:
    fleet = {"podSelector": {"matchLabels": {"isthmus/fleet": shape.name}}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _metadata(shape, f"{shape.name}-fleet-only"),
            "spec": {"podSelector": {"matchLabels": {"isthmus/fleet": shape.name}},
                     "policyTypes": ["Ingress"],
                     # Only pods of this fleet (label a client pod `isthmus/fleet: NAME` to
                     # let it in) reach the controller and the workers.
                     "ingress": [{"from": [fleet]}]}}


def _token_volume(shape: FleetShape) -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {"name": "token", "secret": {"secretName": f"{shape.name}-token",
                                          "defaultMode": 0o400}}
    mount = {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}
    return volume, mount


def _cache_args(shape: FleetShape) -> list[str]:
    return ["--compile-cache", shape.compile_cache] if shape.compile_cache else []


def _controller_container(shape: FleetShape) -> dict[str, Any]:
    _, mount = _token_volume(shape)
    command = ["isthmus", "up", "--no-launch", "--host", "0.0.0.0",
               "--advertise-host", f"{shape.name}-controller", "--port", str(GRPC_PORT),
               "--fleet-port", str(FLEET_PORT), "--slices", str(shape.slices),
               "--hosts-per-slice", str(shape.hosts_per_slice),
               "--devices-per-host", str(shape.devices_per_host), "--platform", shape.platform,
               "--token-file", f"{TOKEN_DIR}/token", "--fleet-timeout", "900",
               "--log-level", "INFO", *_cache_args(shape)]
    return {"name": "controller", "image": shape.image, "command": command,
            "ports": [{"name": "grpc", "containerPort": GRPC_PORT},
                      {"name": "fleet", "containerPort": FLEET_PORT}],
            "volumeMounts": [mount],
            "readinessProbe": {"tcpSocket": {"port": GRPC_PORT}, "periodSeconds": 5},
            "resources": {"requests": {"cpu": "1", "memory": "2Gi"}}}


def _worker_container(shape: FleetShape, slice_value: str) -> dict[str, Any]:
    _, mount = _token_volume(shape)
    command = ["isthmus", "worker", "--controller", f"{shape.name}-controller:{GRPC_PORT}",
               "--slice", slice_value, "--devices", str(shape.devices_per_host),
               "--platform", shape.platform, "--listen", "0.0.0.0", "--advertise",
               "$(POD_IP)", "--token-file", f"{TOKEN_DIR}/token", "--connect-timeout", "900",
               "--log-level", "INFO", *_cache_args(shape)]
    resources: dict[str, Any] = {"requests": {"cpu": "1", "memory": "4Gi"}}
    if shape.platform == "cuda":
        resources["limits"] = {"nvidia.com/gpu": str(shape.devices_per_host)}
    return {"name": "worker", "image": shape.image, "command": command,
            "env": [{"name": "POD_IP",
                     "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "volumeMounts": [mount], "resources": resources}


def _pod_spec(shape: FleetShape, container: dict[str, Any], restart: str) -> dict[str, Any]:
    volume, _ = _token_volume(shape)
    return {"restartPolicy": restart, "containers": [container], "volumes": [volume]}


def _jobset(shape: FleetShape) -> dict[str, Any]:
    controller_pod = {"metadata": {"labels": _selector(shape, "controller")},
                      "spec": _pod_spec(shape, _controller_container(shape), "Never")}
    worker = _worker_container(shape, "$(SLICE)")
    worker["env"].append({"name": "SLICE", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}})
    worker_pod = {"metadata": {"labels": _selector(shape, "worker")},
                  # A worker that crashes restarts in place and rejoins its slice.
                  "spec": _pod_spec(shape, worker, "OnFailure")}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": _metadata(shape, shape.name),
            "spec": {"failurePolicy": {"maxRestarts": 3},
                     "replicatedJobs": [
                         {"name": "controller", "replicas": 1,
                          "template": {"spec": {"parallelism": 1, "completions": 1,
                                                "backoffLimit": 0,
                                                "template": controller_pod}}},
                         {"name": "slice", "replicas": shape.slices,
                          "template": {"spec": {"parallelism": shape.hosts_per_slice,
                                                "completions": shape.hosts_per_slice,
                                                "completionMode": "Indexed",
                                                "backoffLimit": 10,
                                                "template": worker_pod}}}]}}


def _controller_deployment(shape: FleetShape) -> dict[str, Any]:
    labels = _selector(shape, "controller")
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _metadata(shape, f"{shape.name}-controller", "controller"),
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                     "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": _pod_spec(shape, _controller_container(shape),
                                                    "Always")}}}


def _slice_statefulset(shape: FleetShape, slice_index: int) -> dict[str, Any]:
    labels = {**_selector(shape, "worker"), "isthmus/slice": str(slice_index)}
    name = f"{shape.name}-slice-{slice_index}"
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": _metadata(shape, name, "worker"),
            "spec": {"replicas": shape.hosts_per_slice, "serviceName": f"{shape.name}-controller",
                     "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": _pod_spec(shape, _worker_container(
                                      shape, str(slice_index)), "Always")}}}


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    import yaml

    return "".join("---\n" + yaml.safe_dump(m, sort_keys=False) for m in manifests)
