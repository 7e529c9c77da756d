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
request `nvidia.com/gpu`; TPU workers (one per TPU host of a GKE TPU node pool, owning its
chips) request `google.com/tpu` and select the pool by its accelerator type and topology
(docs/tpu.md says which of this has run).

With `tenants_secret` the controller serves a shared service (`isthmus up --tenants`,
docs/shared.md): the tenants file and its tokens come from that Secret, the client port's
certificate from a TLS Secret (`service_tls_secret`, e.g. cert-manager's), and a second
NetworkPolicy opens the client port, and only it, to every source: tenants come through TLS
with their own tokens, not as members of the fleet.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from typing import Any

GRPC_PORT = 8470
FLEET_PORT = 8471
TOKEN_DIR = "/etc/isthmus"
# Beside TOKEN_DIR, not in it: a mount inside a Secret's mount needs a directory the
# read-only Secret volume cannot make.
TENANTS_DIR = "/etc/isthmus-tenants"  # the tenants Secret: tenants.toml, its token files
TENANTS_FILE = "tenants.toml"  # the key of the tenants file in that Secret
SERVICE_TLS_DIR = "/etc/isthmus-service"  # the TLS Secret: tls.crt, tls.key


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
    # A shared service: the Secret with tenants.toml and the token files it names, and the
    # kubernetes.io/tls Secret of the client port's certificate. Both or neither: the
    # controller cannot write a self-signed certificate into a Secret's read-only mount.
    tenants_secret: str | None = None
    service_tls_secret: str | None = None
    # TPU slices (GKE's node labels): the accelerator type of the pool, and the topology of
    # one slice ("" : devices_per_host x hosts_per_slice chips as "AxB", e.g. 2x4).
    tpu_accelerator: str = "tpu-v5-lite-podslice"
    tpu_topology: str = ""

    def __post_init__(self) -> None:
        for field in ("slices", "hosts_per_slice", "devices_per_host"):
            if getattr(self, field) < 1:
                raise ValueError(f"--{field.replace('_', '-')} must be at least 1")
        if self.platform not in ("cpu", "cuda", "tpu"):
            raise ValueError(f"--platform must be cpu, cuda or tpu, not {self.platform!r}")
        if self.platform == "tpu":
            chips = self.hosts_per_slice * self.devices_per_host
            sides = self.topology.split("x")
            if not all(side.isdigit() and int(side) > 0 for side in sides) or \
                    _product(int(side) for side in sides) != chips:
                raise ValueError(f"--tpu-topology {self.topology!r} must name the slice's "
                                 f"{chips} chips ({self.hosts_per_slice} hosts x "
                                 f"{self.devices_per_host} chips), e.g. 2x4")
        if not self.name.replace("-", "").isalnum() or not self.name[0].isalpha() or (
                self.name != self.name.lower()) or len(self.name) > 40:
            raise ValueError(f"--name {self.name!r} must be a lowercase DNS label of at most "
                             "40 characters")
        for flag, value in (("--tenants-secret", self.tenants_secret),
                            ("--service-tls-secret", self.service_tls_secret)):
            if value is not None and not _is_object_name(value):
                raise ValueError(f"{flag} {value!r} must name a Secret: lowercase letters, "
                                 "digits, '-' and '.', at most 253 characters")
        if f"{self.name}-token" in (self.tenants_secret, self.service_tls_secret):
            raise ValueError(f"{self.name}-token is the fleet token's Secret, made by the "
                             "render: give the shared service's Secrets other names")
        if self.tenants_secret and not self.service_tls_secret:
            raise ValueError("--tenants-secret needs --service-tls-secret NAME: a "
                             "kubernetes.io/tls Secret (e.g. cert-manager's) whose certificate "
                             f"names {self.name}-controller (docs/kubernetes.md)")
        if self.service_tls_secret and not self.tenants_secret:
            raise ValueError("--service-tls-secret is for a shared service: add "
                             "--tenants-secret NAME")

    @property
    def topology(self) -> str:
        """The slice's TPU topology, as GKE labels its nodes."""
        return self.tpu_topology or f"{self.devices_per_host}x{self.hosts_per_slice}"

    @property
    def shared(self) -> bool:
        return self.tenants_secret is not None


# A DNS subdomain (RFC 1123), as Kubernetes names Secrets.
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _is_object_name(value: str) -> bool:
    return len(value) <= 253 and _OBJECT_NAME.fullmatch(value) is not None


def render(shape: FleetShape, variant: str = "jobset") -> list[dict[str, Any]]:
    """The manifests, in the order to apply them."""
    if variant not in ("jobset", "plain"):
        raise ValueError(f"--variant must be jobset or plain, not {variant!r}")
    common = [_secret(shape), _service(shape), _network_policy(shape)]
    if shape.shared:
        common.append(_service_network_policy(shape))
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


def _service_network_policy(shape: FleetShape) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _metadata(shape, f"{shape.name}-service"),
            "spec": {"podSelector": {"matchLabels": _selector(shape, "controller")},
                     "policyTypes": ["Ingress"],
                     # A shared service's tenants, from anywhere, to the client port alone:
                     # it serves programs there only under a tenant's lease, over TLS.
                     "ingress": [{"ports": [{"protocol": "TCP", "port": GRPC_PORT}]}]}}


def _secret_volume(name: str, secret: str, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {"name": name, "secret": {"secretName": secret, "defaultMode": 0o400}}
    mount = {"name": name, "mountPath": path, "readOnly": True}
    return volume, mount


def _token_volume(shape: FleetShape) -> tuple[dict[str, Any], dict[str, Any]]:
    return _secret_volume("token", f"{shape.name}-token", TOKEN_DIR)


def _controller_volumes(shape: FleetShape) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    volumes = [_token_volume(shape)]
    if shape.tenants_secret and shape.service_tls_secret:
        volumes += [_secret_volume("tenants", shape.tenants_secret, TENANTS_DIR),
                    _secret_volume("service-tls", shape.service_tls_secret, SERVICE_TLS_DIR)]
    return volumes


def _product(values: Any) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def _service_args(shape: FleetShape) -> list[str]:
    if not shape.shared:
        return []
    return ["--tenants", f"{TENANTS_DIR}/{TENANTS_FILE}",
            "--service-cert", f"{SERVICE_TLS_DIR}/tls.crt",
            "--service-key", f"{SERVICE_TLS_DIR}/tls.key"]


def _cache_args(shape: FleetShape) -> list[str]:
    return ["--compile-cache", shape.compile_cache] if shape.compile_cache else []


def _controller_container(shape: FleetShape) -> dict[str, Any]:
    command = ["isthmus", "up", "--no-launch", "--host", "0.0.0.0",
               "--advertise-host", f"{shape.name}-controller", "--port", str(GRPC_PORT),
               "--fleet-port", str(FLEET_PORT), "--slices", str(shape.slices),
               "--hosts-per-slice", str(shape.hosts_per_slice),
               "--devices-per-host", str(shape.devices_per_host), "--platform", shape.platform,
               "--token-file", f"{TOKEN_DIR}/token", "--fleet-timeout", "900",
               "--log-level", "INFO", *_cache_args(shape), *_service_args(shape)]
    return {"name": "controller", "image": shape.image, "command": command,
            "ports": [{"name": "grpc", "containerPort": GRPC_PORT},
                      {"name": "fleet", "containerPort": FLEET_PORT}],
            "volumeMounts": [mount for _, mount in _controller_volumes(shape)],
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
    if shape.platform == "tpu":  # a TPU host's chips, all of them: libtpu's unit
        resources["requests"]["google.com/tpu"] = str(shape.devices_per_host)
        resources["limits"] = {"google.com/tpu": str(shape.devices_per_host)}
    return {"name": "worker", "image": shape.image, "command": command,
            "env": [{"name": "POD_IP",
                     "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "volumeMounts": [mount], "resources": resources}


def _pod_spec(container: dict[str, Any], restart: str,
              volumes: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    return {"restartPolicy": restart, "containers": [container],
            "volumes": [volume for volume, _ in volumes]}


def _controller_pod_spec(shape: FleetShape, restart: str) -> dict[str, Any]:
    return _pod_spec(_controller_container(shape), restart, _controller_volumes(shape))


def _worker_pod_spec(shape: FleetShape, container: dict[str, Any],
                     restart: str) -> dict[str, Any]:
    spec = _pod_spec(container, restart, [_token_volume(shape)])
    if shape.platform == "tpu":  # the GKE TPU node pool of the slice's type and shape
        spec["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": shape.tpu_accelerator,
                                "cloud.google.com/gke-tpu-topology": shape.topology}
    return spec


def _jobset(shape: FleetShape) -> dict[str, Any]:
    controller_pod = {"metadata": {"labels": _selector(shape, "controller")},
                      "spec": _controller_pod_spec(shape, "Never")}
    worker = _worker_container(shape, "$(SLICE)")
    worker["env"].append({"name": "SLICE", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}})
    worker_pod = {"metadata": {"labels": _selector(shape, "worker")},
                  # A worker that crashes restarts in place and rejoins its slice.
                  "spec": _worker_pod_spec(shape, worker, "OnFailure")}
    metadata = _metadata(shape, shape.name)
    if shape.platform == "tpu":  # each slice's Job on a node pool of its own
        metadata["annotations"] = {
            "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": metadata,
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
                                  "spec": _controller_pod_spec(shape, "Always")}}}


def _slice_statefulset(shape: FleetShape, slice_index: int) -> dict[str, Any]:
    labels = {**_selector(shape, "worker"), "isthmus/slice": str(slice_index)}
    name = f"{shape.name}-slice-{slice_index}"
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": _metadata(shape, name, "worker"),
            "spec": {"replicas": shape.hosts_per_slice, "serviceName": f"{shape.name}-controller",
                     "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": _worker_pod_spec(shape, _worker_container(
                                      shape, str(slice_index)), "Always")}}}


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    import yaml

    return "".join("---\n" + yaml.safe_dump(m, sort_keys=False) for m in manifests)
