"""Reading a server's metrics in tests: the URL it printed, a page fetched, and Prometheus
families scraped until a condition holds (`test_observe.py`, `test_kept_executables.py`)."""

import re
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from isthmus.serve import METRICS_PREFIX
from isthmus.testing import LocalServer


def metrics_url(server: LocalServer, timeout: float = 10.0) -> str:
    """The base URL the server printed (`isthmus: metrics at URL/metrics`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(re.escape(METRICS_PREFIX) + r"(http://\S+)/metrics", server.log())
        if match:
            return match.group(1)
        time.sleep(0.1)
    raise AssertionError(f"the server printed no metrics URL:\n{server.log()}")


def get(url: str, timeout: float = 10.0) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def families(base: str) -> dict:
    status, content_type, body = get(base + "/metrics")
    assert status == 200 and content_type.startswith("text/plain"), (status, content_type)
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def value(family, **labels) -> float:
    for sample in family.samples:
        if all(sample.labels.get(k) == v for k, v in labels.items()) and (
                sample.name == family.name or sample.name == family.name + "_total"):
            return sample.value
    raise AssertionError(f"no sample {labels} in {family.samples}")


def scrape_when(base: str, condition, what: str, timeout: float = 30.0) -> dict:
    """Scrapes until `condition(families)` holds; returns those families. A family the
    condition reads that is not there yet (KeyError: a worker's counters appear with its first
    report) is waited for like any other."""
    deadline = time.monotonic() + timeout
    while True:
        found = families(base)
        try:
            holds = condition(found)
        except KeyError:
            holds = False
        if holds:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s: {sorted(found.items())}")
        time.sleep(0.1)
