"""Crash records: which program a worker process was dispatching when a fatal signal ended it.

The supervisor of a worker process (a local fleet's launcher slot, the supervising
`isthmus worker`) gives every process it starts in one slot the same record path
(`CRASH_RECORD_ENV`), so a worker finds what its predecessor in the slot left there:

    <path>.fatal    faulthandler's text. Python writes it only on a fatal signal (SIGSEGV,
                    SIGABRT, SIGBUS, SIGFPE, SIGILL), never on SIGKILL or SIGTERM: a process
                    killed from outside is never taken for a crash.
    <path>.program  32 mapped bytes, four little-endian u64: the incarnation of the
                    controller served (written when the worker joins), the executable being
                    dispatched (written before jaxlib is called, 0 again once it returned),
                    the process id, and the id of the thread that dispatches.

A worker whose predecessor left a non-empty `.fatal` reports it in its `Register`
(`messages.CrashReport`) and clears the records; the controller then refuses that program.
Only a crash *inside* the dispatch of a program blames it: in the dispatching thread (the
one faulthandler calls "Current thread"), while the record names the program. jaxlib's
argument checks and crashes in the call itself are such; a fatal signal from another thread
(a gloo abort after a peer died, the distributed client ending the process) is not, even
while a dispatch waits, nor is a program that brings the process down later, from jaxlib's
own threads.

The testing aid `TEST_CRASH_ENV` makes a worker crash for real (a segmentation fault) when it
is about to run a program whose name contains the given text, so that tests exercise this
path end to end.
"""

from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import functools
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable
from typing import IO

from isthmus.transport import messages as m

logger = logging.getLogger(__name__)

# The record path a supervisor gives the worker processes of one slot.
CRASH_RECORD_ENV = "ISTHMUS_CRASH_RECORD"
# Testing aid: a worker segfaults when about to run a program whose name contains this.
TEST_CRASH_ENV = "ISTHMUS_TEST_CRASH_PROGRAM"
# Testing aid: a worker raises (as a bug in isthmus would) while preparing to run a program
# whose name contains this, before it applies the Execute (`CrashRecord.fault`).
TEST_RAISE_ENV = "ISTHMUS_TEST_RAISE_PROGRAM"

_FIELDS = struct.Struct("<QQQQ")  # controller incarnation, executable, pid, thread
_U64 = struct.Struct("<Q")
_CONTROLLER, _EXECUTABLE, _PID, _THREAD = 0, 8, 16, 24  # offsets in `.program`


@dataclasses.dataclass(frozen=True, slots=True)
class CrashConfig:
    """Where a worker keeps its crash records, and the testing aid."""

    record: str | None = None  # the slot's record path (None: no records, nothing reported)
    test_crash_program: str = ""  # testing only: crash on programs whose name contains it
    test_raise_program: str = ""  # testing only: raise on programs whose name contains it


def fatal_line(text: str) -> str:
    """The first non-empty line of faulthandler's text ("Fatal Python error: ...")."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


class CrashRecord:
    """One worker process's crash records (see the module docstring).

    `take` reads what the predecessor left, `arm` starts this process's records; then
    `running(executable_id)` (0: none) is what the worker calls around each dispatch, a
    write into a mapped page (about 100 ns), and `joined(controller)` when it joins one.
    """

    def __init__(self, config: CrashConfig) -> None:
        self.config = config
        self._fatal: IO[bytes] | None = None
        self._map: mmap.mmap | None = None
        self._doomed: set[int] = set()  # the testing aids' programs: to crash on
        self._faulty: set[int] = set()  # ... and to raise on
        self.running: Callable[[int], None] = _nothing

    @property
    def _paths(self) -> tuple[str, str]:
        assert self.config.record is not None
        return self.config.record + ".fatal", self.config.record + ".program"

    def take(self) -> m.CrashReport | None:
        """What the last process of this slot left if a fatal signal ended it, or None; the
        records are cleared either way. Logs the fatal text (the crashed process could not)."""
        if self.config.record is None:
            return None
        fatal_path, program_path = self._paths
        try:
            with open(fatal_path, "rb") as f:
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            text = ""
        controller = executable = pid = thread = 0
        try:
            with open(program_path, "rb") as f:
                raw = f.read(_FIELDS.size)
            if len(raw) == _FIELDS.size:
                controller, executable, pid, thread = _FIELDS.unpack(raw)
        except FileNotFoundError:
            pass
        _clear(fatal_path)
        _clear(program_path)
        if not text.strip():
            return None
        if f"Current thread 0x{thread:016x} " not in text:
            executable = 0  # the signal came from another thread than the dispatch
        logger.warning("the last worker process of this slot (pid %s) died of a fatal signal "
                       "while dispatching %s:\n%s", pid or "unknown",
                       f"executable {executable}" if executable else "no program", text.rstrip())
        return m.CrashReport(controller, executable, pid, fatal_line(text))

    def arm(self) -> None:
        """Starts this process's records: faulthandler writes to `.fatal`, and `.program`
        is mapped for `running`. Call it on the thread that will dispatch programs."""
        if self.config.record is not None:
            fatal_path, program_path = self._paths
            os.makedirs(os.path.dirname(fatal_path) or ".", exist_ok=True)
            self._fatal = open(fatal_path, "wb")
            faulthandler.enable(self._fatal, all_threads=True)
            fd = os.open(program_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, _FIELDS.size)
                self._map = mmap.mmap(fd, _FIELDS.size)
            finally:
                os.close(fd)
            _U64.pack_into(self._map, _PID, os.getpid())
            _U64.pack_into(self._map, _THREAD, threading.get_ident())
            self.running = _marker(self._map)
        if self.config.test_crash_program:
            mark = self.running

            def running(executable_id: int) -> None:
                mark(executable_id)
                if executable_id in self._doomed:
                    logger.warning("crashing on purpose before executable %s (%s=%s)",
                                   executable_id, TEST_CRASH_ENV,
                                   self.config.test_crash_program)
                    for handler in logging.getLogger().handlers:
                        handler.flush()
                    ctypes.string_at(0)  # a real segmentation fault

            self.running = running

    def joined(self, controller: int) -> None:
        """This process serves the controller of incarnation `controller` from now on."""
        if self._map is not None:
            _U64.pack_into(self._map, _CONTROLLER, controller)

    def compiled(self, executable_id: int, name: str) -> None:
        """A program is loaded under `executable_id` (for the testing aid)."""
        crash = self.config.test_crash_program
        if crash and crash in name:
            self._doomed.add(executable_id)
        fault = self.config.test_raise_program
        if fault and fault in name:
            self._faulty.add(executable_id)

    def fault(self, executable_id: int) -> None:
        """The testing aid `TEST_RAISE_ENV`: raises for its programs, as a bug would."""
        if executable_id in self._faulty:
            raise RuntimeError(f"raising on purpose before executable {executable_id} "
                               f"({TEST_RAISE_ENV}={self.config.test_raise_program})")


def _nothing(executable_id: int) -> None:
    """`running` when there are no records."""


def _marker(page: mmap.mmap) -> Callable[[int], None]:
    """`running` with records: one `pack_into` on the mapped page, called straight from C."""
    return functools.partial(_U64.pack_into, page, _EXECUTABLE)


def _clear(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
