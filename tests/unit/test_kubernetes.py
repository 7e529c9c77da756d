"""`isthmus k8s render`: the manifests validate against the Kubernetes schemas
(kubernetes-validate, strict), the JobSet's job templates validate as batch/v1 Jobs and its
own fields against the JobSet v1alpha2 fields it uses, every container runs a command line
that isthmus's own parser accepts, and bad shapes are refused with one line. A shared
service's controller runs `isthmus up --tenants` from its Secrets' mounts, which load as the
controller loads them, and only its client port is opened beyond the fleet."""

import shutil
import subprocess
import sys

import pytest

from isthmus.cli import build_parser
from isthmus.deploy.kubernetes import SERVICE_TLS_DIR, TENANTS_DIR, FleetShape, render, to_yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
VERSION = "1.30.0"

# The JobSet fields the renderer uses (jobset.x-k8s.io/v1alpha2, from its API reference).
JOBSET_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"}, "kind": {"const": "JobSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["replicatedJobs"], "additionalProperties": False,
            "properties": {
                "failurePolicy": {"type": "object", "additionalProperties": False,
                                  "properties": {"maxRestarts": {"type": "integer",
                                                                 "minimum": 0}}},
                "replicatedJobs": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["name", "template"],
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"},
                        "replicas": {"type": "integer", "minimum": 1},
                        "template": {"type": "object", "required": ["spec"]}}}}}}}}


SHARED = FleetShape(2, 2, 4, name="svc", namespace="ml", tenants_secret="svc-tenants",
                    service_tls_secret="svc-tls")


def shapes():
    return [FleetShape(2, 2, 4), FleetShape(3, 1, 8, "cuda", "example.com/isthmus:1",
                                            "train", "ml", compile_cache="gs://b/cache"),
            SHARED, TPU]


TPU = FleetShape(2, 4, 4, "tpu", "example.com/isthmus:tpu", "pods", tpu_topology="4x4")


@pytest.mark.parametrize("variant", ["jobset", "plain"])
@pytest.mark.parametrize("shape", shapes(), ids=["cpu", "cuda", "shared", "tpu"])
def test_manifests_validate(shape, variant):
    import jsonschema

    manifests = render(shape, variant)
    kinds = [m["kind"] for m in manifests]
    policies = ["NetworkPolicy"] * (2 if shape.tenants_secret else 1)
    expected = (["Secret", "Service", *policies, "JobSet"] if variant == "jobset" else
                ["Secret", "Service", *policies, "Deployment"] +
                ["StatefulSet"] * shape.slices)
    assert kinds == expected
    for manifest in manifests:
        if manifest["kind"] == "JobSet":
            jsonschema.validate(manifest, JOBSET_SCHEMA)
            for job in manifest["spec"]["replicatedJobs"]:
                kubernetes_validate.validate(
                    {"apiVersion": "batch/v1", "kind": "Job",
                     "metadata": {"name": job["name"]}, **job["template"]}, VERSION,
                    strict=True)
        else:
            kubernetes_validate.validate(manifest, VERSION, strict=True)
    assert to_yaml(manifests).count("\n---\n") == len(manifests) - 1


def containers(manifests):
    for manifest in manifests:
        spec = manifest.get("spec", {})
        if manifest["kind"] == "JobSet":
            pods = [j["template"]["spec"]["template"] for j in spec["replicatedJobs"]]
        elif "template" in spec:
            pods = [spec["template"]]
        else:
            continue
        for pod in pods:
            yield pod, pod["spec"]["containers"][0]


@pytest.mark.parametrize("variant", ["jobset", "plain"])
def test_containers_run_valid_isthmus_commands(variant):
    shape = shapes()[1]
    parser = build_parser()
    roles = []
    for pod, container in containers(render(shape, variant)):
        command = [c.replace("$(SLICE)", "1").replace("$(POD_IP)", "10.0.0.7")
                   for c in container["command"]]
        assert command[0] == "isthmus"
        args = parser.parse_args(command[1:])
        roles.append(args.subcommand)
        assert args.token_file == "/etc/isthmus/token"
        assert args.platform == "cuda" and args.compile_cache == "gs://b/cache"
        if args.subcommand == "up":
            assert (args.slices, args.hosts_per_slice, args.devices_per_host) == (3, 1, 8)
            assert args.no_launch and args.host == "0.0.0.0"
        else:
            assert args.controller == "train-controller:8470" and args.devices == 8
            assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
            assert pod["metadata"]["labels"]["isthmus/role"] == "worker"
    assert sorted(set(roles)) == ["up", "worker"]


def test_jobset_workers_take_their_slice_from_the_job_index():
    jobset = render(FleetShape(2, 2, 4))[-1]
    worker = jobset["spec"]["replicatedJobs"][1]
    assert worker["replicas"] == 2
    assert worker["template"]["spec"]["completionMode"] == "Indexed"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
           for e in worker["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SLICE"] == "metadata.annotations['jobset.sigs.k8s.io/job-index']"


def secret_volumes(pod):
    return {v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"]}


@pytest.mark.parametrize("variant", ["jobset", "plain"])
def test_a_shared_service_runs_its_controller_from_the_secrets(variant, tmp_path):
    from isthmus.controller.tenants import load
    from isthmus.lease_cli import shared_config
    from isthmus.transport.service_tls import self_signed

    # The Secrets' files where the pod mounts them, here under tmp_path.
    tenants_dir = tmp_path / TENANTS_DIR.lstrip("/")
    tenants_dir.mkdir(parents=True)
    (tenants_dir / "tenants.toml").write_text(
        'admins = ["ops"]\n[tenants.alice]\ntoken_file = "alice.token"\nmax_slices = 2\n'
        '[tenants.ops]\ntoken_file = "ops.token"\nmax_slices = 0\n')
    (tenants_dir / "alice.token").write_text("alice-secret\n")
    (tenants_dir / "ops.token").write_text("ops-secret\n")
    made = self_signed(str(tmp_path / "made"), ["svc-controller"])
    tls_dir = tmp_path / SERVICE_TLS_DIR.lstrip("/")
    tls_dir.mkdir(parents=True)
    shutil.copy(made.cert, tls_dir / "tls.crt")
    shutil.copy(made.key, tls_dir / "tls.key")

    parser = build_parser()
    manifests = render(SHARED, variant)
    seen = set()
    for pod, container in containers(manifests):
        command = [c.replace("$(SLICE)", "1").replace("$(POD_IP)", "10.0.0.7")
                   for c in container["command"]]
        args = parser.parse_args(command[1:])
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert all(m["readOnly"] for m in container["volumeMounts"])
        seen.add(args.subcommand)
        if args.subcommand == "worker":  # workers see neither the tenants nor the key
            assert secret_volumes(pod) == {"token": "svc-token"}
            assert mounts == {"token": "/etc/isthmus"}
            assert args.controller == "svc-controller:8470"
            continue
        assert secret_volumes(pod) == {"token": "svc-token", "tenants": "svc-tenants",
                                       "service-tls": "svc-tls"}
        assert mounts == {"token": "/etc/isthmus", "tenants": TENANTS_DIR,
                          "service-tls": SERVICE_TLS_DIR}
        assert args.tenants == f"{TENANTS_DIR}/tenants.toml"
        assert (args.service_cert, args.service_key) == (f"{SERVICE_TLS_DIR}/tls.crt",
                                                         f"{SERVICE_TLS_DIR}/tls.key")
        assert not args.allow_plain_connect and args.unix_socket is None
        assert args.port == 8470 and args.no_launch and args.host == "0.0.0.0"
        # The same options, pointed at the files laid out as the Secrets are, load as the
        # controller loads them.
        local = parser.parse_args([str(tmp_path) + c if c.startswith(
            (TENANTS_DIR, SERVICE_TLS_DIR)) else c for c in command[1:]])
        shared = shared_config(local)
        assert shared.tenants == str(tenants_dir / "tenants.toml")
        assert (shared.cert, shared.key) == (str(tls_dir / "tls.crt"),
                                             str(tls_dir / "tls.key"))
        tenants = load(shared.tenants)
        assert tenants.authenticate("", "alice-secret").name == "alice"
        assert tenants.by_name["ops"].admin
    assert seen == {"up", "worker"}

    # The one address users are given stays the Service's client port, and only that port
    # is opened beyond the fleet.
    service = next(m for m in manifests if m["kind"] == "Service")
    assert service["metadata"]["name"] == "svc-controller"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 8470,
                                                                       "fleet": 8471}
    policies = {m["metadata"]["name"]: m["spec"] for m in manifests
                if m["kind"] == "NetworkPolicy"}
    assert policies["svc-fleet-only"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"isthmus/fleet": "svc"}}}]}]
    assert policies["svc-service"]["podSelector"] == {
        "matchLabels": {"isthmus/fleet": "svc", "isthmus/role": "controller"}}
    assert policies["svc-service"]["ingress"] == [{"ports": [{"protocol": "TCP",
                                                             "port": 8470}]}]
    # Without a shared service nothing of it is rendered.
    plain = render(FleetShape(2, 2, 4, name="svc"), variant)
    assert "svc-service" not in {m["metadata"]["name"] for m in plain}
    assert "--tenants" not in to_yaml(plain)


def test_bad_shapes_are_refused_with_one_line(tmp_path):
    for args, message in ((["--slices", "0"], "--slices must be at least 1"),
                          (["--name", "Bad_Name"], "--name 'Bad_Name' must be a lowercase"),
                          (["--tenants-secret", "t"], "--tenants-secret needs "
                                                      "--service-tls-secret NAME"),
                          (["--service-tls-secret", "t"], "--service-tls-secret is for a "
                                                          "shared service"),
                          (["--tenants-secret", "Tenants", "--service-tls-secret", "t"],
                           "--tenants-secret 'Tenants' must name a Secret"),
                          (["--tenants-secret", "isthmus-token", "--service-tls-secret", "t"],
                           "isthmus-token is the fleet token's Secret")):
        result = subprocess.run([sys.executable, "-m", "isthmus.cli", "k8s", "render", *args],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
        assert message in result.stderr, result.stderr
    out = tmp_path / "fleet.yaml"
    result = subprocess.run([sys.executable, "-m", "isthmus.cli", "k8s", "render", "-o",
                             str(out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and out.read_text().startswith("---\napiVersion: v1")


@pytest.mark.parametrize("variant", ["jobset", "plain"])
def test_tpu_workers_ask_for_their_hosts_chips_on_a_tpu_node_pool(variant):
    """One worker per TPU host of a GKE TPU node pool: google.com/tpu for every chip of the
    host, the pool chosen by accelerator type and slice topology; each slice's Job alone on
    its pool (JobSet's exclusive topology)."""
    manifests = render(TPU, variant)
    pods = []
    for m in manifests:
        if m["kind"] == "JobSet":
            assert m["metadata"]["annotations"] == {
                "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
            pods += [j["template"]["spec"]["template"] for j in m["spec"]["replicatedJobs"]
                     if j["name"] == "slice"]
        elif m["kind"] == "StatefulSet":
            pods.append(m["spec"]["template"])
    assert pods
    for pod in pods:
        spec = pod["spec"]
        assert spec["nodeSelector"] == {
            "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
            "cloud.google.com/gke-tpu-topology": "4x4"}
        (container,) = spec["containers"]
        assert container["resources"]["limits"] == {"google.com/tpu": "4"}
        command = container["command"]
        assert command[command.index("--platform") + 1] == "tpu"
        assert command[command.index("--devices") + 1] == "4"


def test_a_tpu_topology_must_hold_the_slices_chips():
    with pytest.raises(ValueError, match="must name the slice's 16 chips"):
        FleetShape(1, 4, 4, "tpu", tpu_topology="2x4")
    assert FleetShape(1, 2, 4, "tpu").topology == "4x2"
