"""A fuzzer for the IFRT proxy protocol that holds valid handles (issue 23).

Random bytes mostly bounce off the first parse; the requests that crash, hang or corrupt a
server are well-formed ones that name real arrays and executables in a combination the
server did not expect. So the fuzzer builds real state first (arrays uploaded in every
sharding form the stock client uses, programs lowered by jax and compiled on the server) and
then sends a seeded mix of well-formed requests and mutations of them over several sessions,
pipelined, with uploads sometimes sent after the requests that use them.

It keeps a numpy model of every array it made and checks, for every request:

    hang           no answer within the timeout
    internal       status INTERNAL, or a message saying "bug in isthmus"
    no_body        an OK response whose oneof is unset
    spurious_error a well-formed request (or a read of an array the model holds valid)
                   failed
    wrong_result   a read (CopyToHostBuffer + HostBufferLookup) differs from the model
    read_gone      an array that must be gone (deleted, donated, refused) read back data
    accepted       a request that must be refused was accepted (e.g. a 16 MiB array made
                   from a 4-byte buffer)
    session_closed the server ended a session stream
    process_died   the server or a worker process is gone

    fuzzer = Fuzzer(server.address, seed=1, pids=[server.process.pid])
    summary = fuzzer.run(requests=2000)
    assert not summary.findings, summary.report()

The records (array model, findings, summary) are in `fuzz_model.py`, a session and its
building blocks in `fuzz_session.py`. Episodes (one scenario each, a few requests) live in
`fuzz_cases.py` (well-formed) and
`fuzz_mutations.py` (mutated; it holds the table of all of them); programs in
`fuzz_programs.py`.
"""

from __future__ import annotations

import collections
import itertools
import random
import time
from collections.abc import Callable, Sequence

import grpc

from isthmus.testing import process_alive
from tests.integration import fuzz_programs
from tests.integration.fuzz_model import (
    ALWAYS_COPY,
    DONATE_INPUT,
    F32,
    INTERNAL,
    REUSE_INPUT,
    S32,
    Arr,
    Exe,
    Finding,
    State,
    Summary,
    shard_groups,
    shard_values,
    short,
)
from tests.integration.fuzz_session import Pending, Sess
from tests.integration.rawclient import RawSession

__all__ = ["ALWAYS_COPY", "DONATE_INPUT", "F32", "INTERNAL", "REUSE_INPUT", "S32", "Arr",
           "Episode", "Exe", "Finding", "Fuzzer", "Pending", "Sess", "State", "Summary",
           "shard_groups", "shard_values"]


class Stop(Exception):
    """The run cannot go on (a process died, too many hangs)."""


Episode = Callable[[Sess], None]


class Fuzzer:
    """Runs seeded episodes against one server over `sessions` sessions."""

    def __init__(self, address: str, *, seed: int = 0, sessions: int = 3,
                 timeout: float = 10.0, pids: Sequence[int] = (),
                 episodes: dict[str, tuple[float, Episode]] | None = None,
                 exclude: Sequence[str] = (), only: Sequence[str] = (),
                 max_hangs: int = 3) -> None:
        """`pids`: processes that must stay alive (the server, its workers). `exclude` /
        `only`: episode-label prefixes to skip / to keep. `max_hangs`: stop after that many
        (each costs a timeout)."""
        from tests.integration import fuzz_mutations

        self.address, self.seed, self.timeout = address, seed, timeout
        self.rng = random.Random(seed)
        self.pids = list(pids)
        self.n_sessions, self.max_hangs = sessions, max_hangs
        table = episodes if episodes is not None else fuzz_mutations.EPISODES
        self.episodes = {k: v for k, v in table.items()
                         if not any(k.startswith(x) for x in exclude)
                         and (not only or any(k.startswith(x) for x in only))}
        if not self.episodes:
            raise ValueError("no episodes left to run")
        self.programs = fuzz_programs.lowered()
        self._handles = itertools.count(1000)
        self.sent = self.reads = 0
        self.kinds: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[int] = collections.Counter()
        self.errors: collections.Counter[tuple[str, int]] = collections.Counter()  # by episode
        self.error_examples: dict[tuple[str, int], str] = {}  # the first of each
        self.ran: collections.Counter[str] = collections.Counter()
        self.findings: list[Finding] = []
        self.episode_log: list[str] = []  # the requests of the current episode
        self.tainted: set[int] = set()  # families with a wrong value reported already
        self.sessions: list[Sess] = []
        self.on_progress: Callable[[Fuzzer], None] | None = None
        self.trace: list[str] | None = None  # a list: every request is logged there

    def new_handle(self) -> int:
        """Client-minted handles are unique across the fuzzer's sessions, so a handle of one
        session is surely unknown to the others."""
        return next(self._handles)

    def find(self, kind: str, label: str, request: str, response: str) -> None:
        self.findings.append(Finding(kind, label, short(request, 3000 if kind ==
                                                          "process_died" else 600),
                                     short(response)))

    def check_processes(self, label: str) -> None:
        for pid in self.pids:
            if not process_alive(pid):
                self.find("process_died", label, f"pid {pid}; the episode sent: " +
                          " | ".join(self.episode_log[-8:]), "the process is gone")
                raise Stop(f"process {pid} died during {label}")

    def open(self) -> Sess:
        return Sess(self, RawSession(self.address, timeout=self.timeout))

    def run(self, requests: int = 1000, seconds: float | None = None,
            progress_every: int = 0) -> Summary:
        """Runs episodes until `requests` requests were sent (or `seconds` passed)."""
        start = time.monotonic()
        stopped = ""
        labels = list(self.episodes)
        weights = [self.episodes[k][0] for k in labels]
        next_progress = progress_every
        try:
            self.sessions = [self.open() for _ in range(self.n_sessions)]
            while self.sent < requests and (seconds is None or
                                            time.monotonic() - start < seconds):
                index = self.rng.randrange(len(self.sessions))
                sess = self.sessions[index]
                label = self.rng.choices(labels, weights)[0]
                sess.label = label
                self.episode_log = []
                self.ran[label] += 1
                self.episodes[label][1](sess)
                sess.settle()
                if not sess.broken:
                    sess.trim()
                if sess.broken or self.rng.random() < 0.01:  # churn: a fresh session
                    sess.close()
                    self.sessions[index] = self.open()
                self.check_processes(label)
                if sum(f.kind == "hang" for f in self.findings) >= self.max_hangs:
                    raise Stop(f"{self.max_hangs} hangs")
                if progress_every and self.sent >= next_progress and self.on_progress:
                    next_progress += progress_every
                    self.on_progress(self)
        except Stop as e:
            stopped = str(e)
        except grpc.RpcError as e:  # opening a session failed: the server is in trouble
            try:
                self.check_processes("open")
            except Stop as s:
                stopped = str(s)
            else:
                self.find("session_closed", "open", "InitRequest",
                          f"{e.code().name}: {e.details()}")
                stopped = "a new session failed"
        finally:
            for sess in self.sessions:
                sess.close()
        return Summary(self.sent, time.monotonic() - start, self.ran, self.statuses,
                       list(self.findings), stopped)
