"""`isthmus k8s render`: the manifests validate against the Kubernetes schemas
(kubernetes-validate, strict), the JobSet's job templates validate as batch/v1 Jobs and its
own fields against the JobSet v1alpha2 fields it uses, every container runs a command line
that isthmus's own parser accepts, and bad shapes are refused with one line."""

import subprocess
import sys

import pytest

from isthmus.cli import build_parser
from isthmus.deploy.kubernetes import FleetShape, render, to_yaml

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


def shapes():
    return [FleetShape(2, 2, 4), FleetShape(3, 1, 8, "cuda", "example.com/isthmus:1",
                                            "train", "ml", compile_cache="gs://b/cache")]


@pytest.mark.parametrize("variant", ["jobset", "plain"])
@pytest.mark.parametrize("shape", shapes(), ids=["cpu", "cuda"])
def test_manifests_validate(shape, variant):
    import jsonschema

    manifests = render(shape, variant)
    kinds = [m["kind"] for m in manifests]
    expected = (["Secret", "Service", "NetworkPolicy", "JobSet"] if variant == "jobset" else
                ["Secret", "Service", "NetworkPolicy", "Deployment"] +
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


def test_bad_shapes_are_refused_with_one_line(tmp_path):
    for args, message in ((["--slices", "0"], "--slices must be at least 1"),
                          (["--name", "Bad_Name"], "--name 'Bad_Name' must be a lowercase")):
        result = subprocess.run([sys.executable, "-m", "isthmus.cli", "k8s", "render", *args],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
        assert message in result.stderr, result.stderr
    out = tmp_path / "fleet.yaml"
    result = subprocess.run([sys.executable, "-m", "isthmus.cli", "k8s", "render", "-o",
                             str(out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and out.read_text().startswith("---\napiVersion: v1")
