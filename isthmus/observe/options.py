"""The observer's command-line options and configuration (cheap to import: the CLI does)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os


@dataclasses.dataclass(frozen=True, slots=True)
class ObserveConfig:
    """Where the metrics and the web view are served."""

    host: str = "127.0.0.1"  # address to listen on
    port: int = 0  # 0: a free port (the CLI prints the one it got)
    events: int = 200  # recent events the view keeps


def add_observe_arguments(parser: argparse.ArgumentParser) -> None:
    """--metrics-port and --metrics-host, for `isthmus up` and `isthmus run`."""
    parser.add_argument(
        "--metrics-port", type=int, default=os.environ.get("ISTHMUS_METRICS_PORT") or None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics and a live view of the "
             "fleet at http://HOST:PORT/ (0: a free port, printed at start; default: off, "
             "or $ISTHMUS_METRICS_PORT)")
    parser.add_argument(
        "--metrics-host", default=os.environ.get("ISTHMUS_METRICS_HOST", "127.0.0.1"),
        help="address the metrics port listens on (default: 127.0.0.1; the view shows the "
             "fleet, its sessions and leases: bind it elsewhere only on a trusted network)")


def observe_config(args: argparse.Namespace) -> ObserveConfig | None:
    """The configuration the options ask for, or None (metrics off)."""
    port = getattr(args, "metrics_port", None)
    if port is None:
        return None
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port must be 0 to 65535, not {port}")
    return ObserveConfig(host=args.metrics_host, port=port)


def keep_event_records(args: argparse.Namespace) -> None:
    """With metrics on, the isthmus loggers make their INFO records (the fleet's events) for
    the view, while the console keeps its level: the level moves from the root logger to
    its handlers. Call after the process's logging is configured."""
    if getattr(args, "metrics_port", None) is None:
        return
    root = logging.getLogger()
    if root.level <= logging.INFO:
        return
    for handler in root.handlers:
        if handler.level == logging.NOTSET:
            handler.setLevel(root.level)
    logging.getLogger("isthmus").setLevel(logging.INFO)
