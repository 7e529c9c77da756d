"""Runs JAX's own test files through isthmus and on local jax, and compares the outcomes.

    python tools/conformance.py --jax-repo /path/to/jax [--files array_test.py ...]

The tests come from the jax-ml/jax repository at the tag of the installed jax version
(`jax-vX.Y.Z`): from a local clone (`--jax-repo`, any git directory that has the tag) or,
without one, from a shallow clone of GitHub. They are extracted under `.conformance/` (git
ignores it; never commit them). Each file runs twice with pytest, in fresh processes:
locally (JAX_PLATFORMS=cpu, 8 CPU devices) and through an embedded isthmus server with 8
devices (JAX_PLATFORMS=proxy,cpu: the proxy is the default backend, and tests that ask for
the host's own CPU by name find it). The report counts, per file, how many tests that pass
locally also pass through isthmus, and lists the ones that do not (also written to
.conformance/report.json).

Without `--files` it runs DEFAULT_FILES: array_test, random_test, lax_control_flow_test,
pmap_test, shard_map_test, batching_test, layout_test, memories_test, pjit_test and api_test
(each whole; on 2 cores pjit_test and api_test take about 7 and 9 minutes for both runs,
shard_map_test about 18). docs/conformance.md has the results and every test lost, and why.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_FILES = [
    "array_test.py", "random_test.py", "lax_control_flow_test.py", "pmap_test.py",
    "shard_map_test.py", "batching_test.py", "layout_test.py", "memories_test.py",
    "pjit_test.py", "api_test.py",
]


def jax_tag() -> str:
    import importlib.metadata

    return "jax-v" + importlib.metadata.version("jax")


def extract(repo: str | None, tag: str, dest: pathlib.Path) -> pathlib.Path:
    target = dest / tag
    if (target / "tests").is_dir():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if repo is None:
            repo = os.path.join(tmp, "jax")
            subprocess.run(["git", "clone", "--quiet", "--depth", "1", "--branch", tag,
                            "https://github.com/jax-ml/jax", repo], check=True)
        git_dir = repo if os.path.basename(repo.rstrip("/")) in ("repo", ".git") or \
            repo.endswith(".git") else repo
        archive = os.path.join(tmp, "tests.tar")
        subprocess.run(["git", f"--git-dir={_git_dir(git_dir)}", "archive", "-o", archive, tag,
                        "tests", "conftest.py", "pyproject.toml"], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(target, filter="data")
    return target


def _git_dir(path: str) -> str:
    candidate = pathlib.Path(path)
    if (candidate / ".git").exists():
        return str(candidate / ".git")
    return str(candidate)


def run_pytest(source: pathlib.Path, test_file: str, env: dict[str, str], report: pathlib.Path,
               timeout: float, extra: list[str]) -> dict[str, str]:
    command = [sys.executable, "-m", "pytest", f"tests/{test_file}", "-q", "-p",
               "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}",
               "--rootdir", str(source), *extra]
    try:
        subprocess.run(command, cwd=source, env=env, timeout=timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        print(f"  {test_file}: timed out after {timeout:.0f} s", file=sys.stderr)
    outcomes: dict[str, str] = {}
    if not report.exists():
        return outcomes
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        outcomes[name] = outcome
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jax-repo", help="a git clone of jax-ml/jax that has the tag")
    parser.add_argument("--files", nargs="*", default=DEFAULT_FILES)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per file and run")
    parser.add_argument("--out", default=str(ROOT / ".conformance"))
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--fleet", default=None, metavar="S,H,D",
                        help="run through a local fleet of S slices x H hosts x D devices "
                             "(S*H*D must be 8) instead of the embedded backend; 'default' "
                             "for the default fleet")
    args = parser.parse_args(argv)

    from isthmus.serve import child_environment
    from isthmus.testing import LocalServer

    out = pathlib.Path(args.out).resolve()
    source = extract(args.jax_repo, jax_tag(), out)
    extra = ["-k", args.keyword] if args.keyword else []
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_BACKEND_TARGET")}
    local_env = {**base, "JAX_PLATFORMS": "cpu",
                 "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    results = {}
    if args.fleet is None:
        server = LocalServer(devices=8)
    elif args.fleet == "default":
        server = LocalServer(devices=None)
    else:
        shape = tuple(int(n) for n in args.fleet.split(","))
        server = LocalServer(devices=None, fleet=shape)  # type: ignore[arg-type]
    with server:
        remote_env = child_environment(server.address, base)
        # The proxy is the default backend; a local "cpu" backend is there too, for the tests
        # that move data to the host's own CPU on purpose (jax.devices("cpu")).
        remote_env["JAX_PLATFORMS"] = "proxy,cpu"
        for test_file in args.files:
            start = time.monotonic()
            local = run_pytest(source, test_file, local_env, out / f"{test_file}.local.xml",
                               args.timeout, extra)
            mid = time.monotonic()
            remote = run_pytest(source, test_file, remote_env,
                                out / f"{test_file}.isthmus.xml", args.timeout, extra)
            passed_local = sorted(t for t, o in local.items() if o == "passed")
            also = [t for t in passed_local if remote.get(t) == "passed"]
            results[test_file] = {
                "local_passed": len(passed_local),
                "isthmus_passed_of_those": len(also),
                "isthmus_only_passed": sum(1 for t, o in remote.items()
                                           if o == "passed" and local.get(t) != "passed"),
                "local_seconds": round(mid - start, 1),
                "isthmus_seconds": round(time.monotonic() - mid, 1),
                "not_passing_through_isthmus": {
                    t: remote.get(t, "missing") for t in passed_local if t not in also},
            }
            r = results[test_file]
            print(f"{test_file}: {r['isthmus_passed_of_those']}/{r['local_passed']} local "
                  f"passes also pass through isthmus ({r['local_seconds']} s local, "
                  f"{r['isthmus_seconds']} s isthmus)", flush=True)
        if not server.alive():
            print("the server died during the run:\n" + server.log(), file=sys.stderr)
    (out / "report.json").write_text(json.dumps(results, indent=2))
    print("\n| file | local passes | also through isthmus | rate |\n|---|---|---|---|")
    total_l = total_r = 0
    for name, r in results.items():
        total_l += r["local_passed"]
        total_r += r["isthmus_passed_of_those"]
        rate = r["isthmus_passed_of_those"] / r["local_passed"] if r["local_passed"] else 1
        print(f"| {name} | {r['local_passed']} | {r['isthmus_passed_of_those']} | {rate:.1%} |")
    if total_l:
        print(f"| total | {total_l} | {total_r} | {total_r / total_l:.1%} |")
    print(f"\nDetails: {out / 'report.json'}")
    shutil.rmtree(out / "__pycache__", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
