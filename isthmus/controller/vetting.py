"""The trust boundary for programs: a client's program bytes are parsed first in a disposable
process, and the processes others depend on (the controller, the embedded backend, the
workers) only ever parse bytes that process wrote.

MLIR's bytecode reader and XLA's compiler are not hardened against hostile input: a portable
artifact with a few bytes changed can crash the process that reads it, or (still a valid
module) the one that compiles it. `ProgramVetter` keeps one child process (`python -m
isthmus.controller.vetting`) that deserializes each new program, verifies it, writes it
again as a StableHLO portable artifact, with the SHA-256 of its canonical form (no debug
information: what names a program for the compile caches and for refusing it), and, for a
CPU fleet, compiles it once with its compile options on CPU devices of its own (`trial`; the
result is thrown away: a GPU fleet's programs only get parsed and written). A child that
dies or hangs on a program answers INVALID_ARGUMENT naming the program; those bytes are
refused from then on, and the next program gets a fresh child. A program the trial compile
refuses is the client's CompileError, as the workers would have answered. Results are kept
by the SHA-256 of the client's program and options, so a program compiled again (a warm
compile) costs a dictionary lookup.

The child speaks length-prefixed frames on its stdin and stdout: a request is the program's
bytes and then its compile options (empty: no trial compile); a reply is a status byte (0:
vetted and compiled on trial, 1: refused, 2: vetted, and compiled on trial before) and then
the vetted artifact, its digest, its `main`'s signature (read in the same parse, so that the
hosts need not parse it again) and the serialized executable (`_pack`), or the reason as
UTF-8. The hosts load that executable on their own devices instead of compiling the program
again (`Controller.loads_vetted`: the embedded backend, and a fleet that is not a shared
service; a host that cannot load it compiles).

With a persistent compilation cache, what the child concluded outlives the server
(`vetted_record.py`): the same client bytes need no child after a restart, and a program
compiled on trial before (by its canonical form and options) is not compiled on trial again,
so the hosts' cache hits save the compile's time again.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hashlib
import logging
import os
import struct
import sys
from typing import Any, BinaryIO, Protocol

from isthmus import errors, forking
from isthmus.controller.vetted_record import VettedRecord, marked
from isthmus.transport.records import CODEC, Signature
from isthmus.worker.compile_cache import CacheConfig

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
VETTED, REFUSED, KNOWN = 0, 1, 2  # KNOWN: vetted, and compiled on trial before
REMEMBERED = 1024  # vetted programs kept by the SHA-256 of the client's bytes


class Child(Protocol):
    """The vetting process as the server holds it: `asyncio.subprocess.Process`, or
    `forking.ForkedChild`."""

    stdin: asyncio.StreamWriter | None
    stdout: asyncio.StreamReader | None

    @property
    def returncode(self) -> int | None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int: ...


FORK = "ISTHMUS_VETTING_FORK"  # "0": the vetting process is always a fresh interpreter


def _forks_here() -> bool:
    """Whether the vetting process may be forked from this one rather than started afresh
    (`forking.may_fork`)."""
    return os.environ.get(FORK, "1") != "0" and forking.may_fork()


class ProgramVetter:
    """Parses client programs in a disposable child process; see the module docstring."""

    def __init__(self, trial: bool = True, timeout: float = 600.0,
                 record: VettedRecord | None = None) -> None:
        self.trial = trial  # compile on CPU as well (a CPU fleet's programs)
        self.timeout = timeout  # seconds one program may take
        self.record = record  # what earlier servers concluded (with a compile cache)
        self.trial_compiles = 0  # programs compiled on trial (a test counts the work saved)
        self.trials_skipped = 0  # programs not compiled on trial: compiled on trial before
        self._child: Child | None = None
        self._devices = 8  # CPU devices of the child, for trial compiles
        self._ready = False  # the child has said it is ready (`_wait_ready`)
        self._lock = asyncio.Lock()  # one program at a time through the child
        self._vetted: collections.OrderedDict[bytes, Vetted] = (
            collections.OrderedDict())  # by the client's bytes (no executable)
        self._refused: dict[bytes, str] = {}
        self.children = 0  # started so far (a test sees a crash replaced)
        self.forked = 0  # of them, forked from this process (`spawn(fork=True)`)

    async def vet(self, module: bytes, options: bytes = b"", devices: int = 1,
                  name: str = "") -> Vetted:
        """The program as this server writes it, the SHA-256 of its canonical form, and
        (the first time, after a trial compile) the serialized executable. `options`: the
        vetted CompileOptionsProto for a trial compile on `devices` CPU devices. Raises
        CompileError for a program that does not parse, verify or compile, and
        InvalidRequest (refused from then on) for one that took the child down."""
        if not self.trial:
            options = b""
        raw = hashlib.sha256(module).digest() + hashlib.sha256(options).digest()
        known = self._vetted.get(raw)
        if known is not None:
            self._vetted.move_to_end(raw)
            return known
        refused = self._refused.get(raw)
        if refused is not None:
            raise errors.InvalidRequest(refused)
        if self.record is not None:
            remembered = await asyncio.to_thread(self.record.program, raw)
            if remembered is not None:
                return self._keep(raw, Vetted(*remembered))
        async with self._lock:
            known = self._vetted.get(raw)
            if known is not None:
                return known
            result, compiled = await self._ask(module, options, devices, raw, name)
        self._keep(raw, dataclasses.replace(result, executable=b""))  # executables: not kept
        if compiled:
            self.trial_compiles += 1
        elif options:
            self.trials_skipped += 1
        if self.record is not None:
            await asyncio.to_thread(self._record, raw, result, options if compiled else b"")
        return result

    def _keep(self, raw: bytes, vetted: Vetted) -> Vetted:
        self._vetted[raw] = vetted
        while len(self._vetted) > REMEMBERED:
            self._vetted.popitem(last=False)
        return vetted

    def _record(self, raw: bytes, result: Vetted, compiled_with: bytes) -> None:
        assert self.record is not None
        if compiled_with:
            self.record.mark(result.digest, compiled_with)
        self.record.remember(raw, result.module, result.digest)

    async def spawn(self, fork: bool = False) -> None:
        """Starts the child, without waiting for it: called first thing in a server process,
        its imports overlap the server's own. `fork`: the caller has imported jax and started
        nothing yet, so the child may be forked from it (`_forks_here` checks); a child
        started later (after a crash) is always a fresh interpreter."""
        async with self._lock:
            await self._ensure_child(fork=fork)

    async def start(self) -> None:
        """Starts the child ahead of the first program (its imports take a second) and
        returns when it is ready for one."""
        async with self._lock:
            await self._ensure_child()
            await self._wait_ready()

    async def close(self) -> None:
        child, self._child = self._child, None
        if child is not None and child.returncode is None:
            child.kill()
            await child.wait()

    async def _ensure_child(self, devices: int = 0, fork: bool = False) -> Child:
        child = self._child
        if devices > self._devices:  # a program over more devices than the child has
            await self.close()
            self._devices = max(devices, 2 * self._devices)
            child = None
        if child is None or child.returncode is not None:
            environ = {"JAX_PLATFORMS": "cpu", "ISTHMUS_VETTING_DEVICES": str(self._devices),
                       "ISTHMUS_VETTING_RECORD": self.record.location if self.record else ""}
            if fork and _forks_here():
                child = await forking.fork_child(functools.partial(_forked, environ))
                self.forked += 1
            else:
                child = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "isthmus.controller.vetting",
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL,  # MLIR prints each refusal; we say it
                    env={**os.environ, **environ})
            self._child = child
            self._ready = False
            self.children += 1
        return child

    async def _wait_ready(self) -> None:
        """Reads the byte the child writes once its imports and warm-up are done."""
        child = self._child
        if child is None or self._ready:
            return
        assert child.stdout is not None
        await asyncio.wait_for(child.stdout.readexactly(1), self.timeout)
        self._ready = True

    async def _ask(self, module: bytes, options: bytes, devices: int, raw: bytes, name: str
                   ) -> tuple[Vetted, bool]:
        """What the child made of the program, and whether it compiled it on trial now."""
        child = await self._ensure_child(devices if options else 0)
        assert child.stdin is not None and child.stdout is not None
        what = f"program {name or raw.hex()[:16]}"
        try:
            await self._wait_ready()
            child.stdin.write(_LENGTH.pack(len(module)) + module
                              + _LENGTH.pack(len(options)) + options)
            await child.stdin.drain()
            reply = await asyncio.wait_for(_read_frame(child.stdout), self.timeout)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
            timed_out = isinstance(e, (TimeoutError, asyncio.TimeoutError))
            await self.close()
            reason = (f"did not parse and compile within {self.timeout:.0f} s" if timed_out
                      else f"crashed the process that parses programs (exit "
                      f"{child.returncode})")
            self._refused[raw] = message = (
                f"{what} {reason}: its bytes are not a program this server can read. This "
                "server refuses these bytes from now on; send a program lowered by jax.")
            logger.warning("%s", message)
            raise errors.InvalidRequest(message) from None
        if reply[:1] == bytes([REFUSED]):
            raise errors.CompileError(reply[1:].decode("utf-8", "replace"))
        return _unpack(reply[1:]), bool(options) and reply[:1] == bytes([VETTED])


def vetter_for(compile_cache: CacheConfig | None) -> ProgramVetter:
    """A server's vetter, not started yet; with a compilation cache, what its process
    concludes is kept beside the cache (`vetted_record.py`)."""
    return ProgramVetter(record=VettedRecord(compile_cache) if compile_cache is not None
                         else None)


@dataclasses.dataclass(frozen=True, slots=True)
class Vetted:
    """What the disposable process made of a client's program."""

    module: bytes  # the program as it wrote it
    digest: bytes  # SHA-256 of its form without debug information
    executable: bytes = b""  # its trial compile, serialized (empty: none, or seen before)
    # Its `main`'s signature, read from the same parse (None: a program remembered across a
    # restart, whose hosts parse it again).
    signature: Signature | None = None


def _pack(vetted: Vetted) -> bytes:
    signature = CODEC.encode(vetted.signature)
    return (_LENGTH.pack(len(vetted.module)) + vetted.module + vetted.digest
            + _LENGTH.pack(len(signature)) + signature + vetted.executable)


def _unpack(data: bytes) -> Vetted:
    (size,) = _LENGTH.unpack_from(data)
    end = _LENGTH.size + size
    module, digest = data[_LENGTH.size:end], data[end:end + 32]
    (size,) = _LENGTH.unpack_from(data, end + 32)
    start = end + 32 + _LENGTH.size
    signature = CODEC.decode(data[start:start + size])
    if signature is not None and not isinstance(signature, Signature):
        raise errors.InternalError("the process that parses programs wrote no signature; "
                                   "this is a bug in isthmus: please report it.")
    return Vetted(module, digest, data[start + size:], signature)


async def _read_frame(stream: asyncio.StreamReader) -> bytes:
    (size,) = _LENGTH.unpack(await stream.readexactly(_LENGTH.size))
    return await stream.readexactly(size)


# ---- the child ---------------------------------------------------------------------------

class _Contexts:
    """The child's MLIR context, shared by `USES` programs in turn: making one (jax's
    dialects registered) costs more than parsing a small program (1.6 ms against 0.8 here,
    twice that on a TPU machine's sandbox). A fresh one now and then keeps what the
    context interns across programs bounded."""

    USES = 64

    def __init__(self) -> None:
        self._context: Any = None
        self._uses = 0

    def get(self) -> Any:
        from isthmus.compat import jax as jax_compat

        if self._context is None or self._uses >= self.USES:
            self._context, self._uses = jax_compat.make_ir_context(), 0
        self._uses += 1
        return self._context


_CONTEXTS = _Contexts()


def vet_program(module: bytes, options: bytes = b"", record: str = "") -> tuple[Vetted, bool]:
    """In the child: the program parsed, verified and written again, and its digest; with
    `options`, compiled once on this process's CPU devices, and that executable, unless the
    record at `record` says it compiled on trial before. The flag: it compiled now."""
    import io

    from jaxlib.mlir import passmanager
    from jaxlib.mlir.dialects import stablehlo

    from isthmus.worker.programs import parse_program, signature_of

    context = _CONTEXTS.get()
    with context:
        parsed = parse_program(context, module)
        try:
            parsed.operation.verify()
        except Exception as e:  # noqa: BLE001 - MLIR's verifier raises MLIRError
            raise errors.CompileError(
                f"the program is not valid StableHLO ({_first_line(e)}); send a program "
                "lowered by jax.") from None
        signature = signature_of(parsed)
        # Shardy's dialect (sdy) travels beside StableHLO's, as the client's serializer
        # writes it.
        vetted = stablehlo.serialize_portable_artifact(
            parsed, stablehlo.get_current_version(), allow_other_dialects=True)
        passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(parsed.operation)
        stripped = io.BytesIO()
        parsed.operation.write_bytecode(file=stripped)
    digest = hashlib.sha256(stripped.getvalue()).digest()
    if not options or (record and marked(record, digest, options)):
        return Vetted(vetted, digest, signature=signature), False
    return Vetted(vetted, digest, trial_compile(vetted, options, signature), signature), True


def trial_compile(module: bytes, options: bytes, signature: Signature | None = None) -> bytes:
    """Compiles `module` as the workers will, on this process's own CPU devices; returns
    the executable serialized (the hosts load it on their own devices instead of
    compiling). Raises CompileError with XLA's reason."""
    from isthmus.protocol.schema import schema
    from isthmus.transport.records import CompileRequest
    from isthmus.worker.programs import compile_program

    assignment = schema()["xla.CompileOptionsProto"].FromString(
        options).executable_build_options.device_assignment
    replicas = max(assignment.replica_count, 1)
    count = replicas * max(len(assignment.computation_devices), 1)
    devices = _client().local_devices()[:count]
    if len(devices) < count:
        raise errors.InternalError(f"the trial compile has {len(devices)} of {count} devices")
    executable, _ = compile_program(devices[0].client, devices, CompileRequest(
        module, options, tuple(d.id for d in devices), replicas, signature=signature))
    try:
        return bytes(executable.serialize())
    except Exception:  # noqa: BLE001 - a program jaxlib cannot serialize is compiled again
        return b""


_CLIENTS: list[object] = []


def _client() -> Any:
    """This process's CPU client, made as the hosts make theirs (`make_cpu_client`), with
    the devices the server asked for (`ISTHMUS_VETTING_DEVICES`)."""
    if not _CLIENTS:
        from isthmus.worker.slots import make_cpu_client

        _CLIENTS.append(make_cpu_client(int(os.environ.get("ISTHMUS_VETTING_DEVICES", "8"))))
    return _CLIENTS[0]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    record = os.environ.get("ISTHMUS_VETTING_RECORD", "")
    while True:
        header = requests.read(_LENGTH.size)
        if len(header) < _LENGTH.size:
            return  # the server closed our stdin
        (size,) = _LENGTH.unpack(header)
        module = requests.read(size)
        (size,) = _LENGTH.unpack(requests.read(_LENGTH.size))
        options = requests.read(size)
        _crash_on_marker(module)
        try:
            vetted, compiled = vet_program(module, options, record)
            reply = bytes([VETTED if compiled or not options else KNOWN]) + _pack(vetted)
        except errors.IsthmusError as e:
            reply = bytes([REFUSED]) + e.message.encode()
        except Exception as e:  # noqa: BLE001 - any other refusal is the program's too
            reply = bytes([REFUSED]) + (
                f"the program does not parse as StableHLO ({_first_line(e)}); send a program "
                "lowered by jax.").encode()
        replies.write(_LENGTH.pack(len(reply)) + reply)
        replies.flush()


def _crash_on_marker(module: bytes) -> None:
    """Testing aid: `ISTHMUS_TEST_CRASH_VETTING=TEXT` makes this process abort on a program
    whose bytes contain TEXT, as the bytecode reader can on damaged bytes."""
    marker = os.environ.get("ISTHMUS_TEST_CRASH_VETTING")
    if marker and marker.encode() in module:
        os.abort()


def _warm_up() -> None:
    """Parses, writes and compiles a small program once, so that the first client program
    does not pay MLIR's and XLA's first use in this process (about 50 ms of a cold compile)."""
    try:
        import jax
        import numpy as np

        lowered = jax.jit(lambda x: jax.numpy.tanh(x @ x) + 1).lower(np.ones((8, 8), "f4"))
        vetted, _ = vet_program(lowered.as_text().encode())
        vet_program(vetted.module)  # the portable artifact's reader too
        lowered.compile()
        from isthmus.protocol.schema import schema

        schema()  # what trial compiles read their options with
    except Exception as e:  # noqa: BLE001 - only a head start; the programs still get vetted
        logger.info("the vetting process's warm-up failed: %s", _first_line(e))


def _main() -> None:
    from isthmus.compat import jax as jax_compat

    jax_compat.preload()  # the imports and the client, before the first program waits
    _client()
    _warm_up()
    sys.stdout.buffer.write(b"\0")  # ready (`ProgramVetter._wait_ready`)
    sys.stdout.buffer.flush()
    _serve(sys.stdin.buffer, sys.stdout.buffer)


def _forked(environ: dict[str, str]) -> None:
    """The vetting process forked from the server (`_forks_here`): its environment, and
    jax's CPU platform (jax was imported with the server's, and has no backend yet)."""
    import jax

    os.environ.update(environ)
    jax.config.update("jax_platforms", "cpu")
    _main()


if __name__ == "__main__":
    _main()
