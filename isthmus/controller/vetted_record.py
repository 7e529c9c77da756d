"""What the vetting process concluded, kept beside the persistent compilation cache, so that
a restarted server compiles nothing it compiled before.

`ProgramVetter` (vetting.py) parses every new program in a disposable process and, on a CPU
fleet, compiles it there on trial before any host sees it. With `--compile-cache`, the hosts
then load their executables from the cache, but the trial compile came first and cost as
much as the compile the cache saved. Two kinds of entries, under `.vetted/` at the cache's
root (no namespace can start with a dot, so none collides with it):

- *programs/*: by the SHA-256 of the client's bytes and of the trial's options, the program
  as the vetting process wrote it and its canonical digest. A client that sends the same
  bytes again (a notebook restarted) needs no vetting process at all, not even its start.
- *compiled/*: by the canonical digest (the program without debug information) and the
  options, a mark that the trial compile of that program with those options succeeded. The
  same program from an edited script is parsed again, but not compiled on trial again.

Why a hit is safe: the trial compile protects the processes others depend on from a program
that crashes XLA's compiler. A mark says that exactly this program (the canonical form is
what XLA compiles: debug information only names things) already compiled with exactly these
options under this jaxlib, in a disposable process, so compiling it again cannot take a
host down where the trial would not have. And after a hit the hosts normally load the
cache's executable, compiling nothing. On a shared service whose tenants fill one cache, an
entry is a function of the bytes or the program its key names (SHA-256): a tenant finds
only what it would have computed from what it sent, never another tenant's code (the
executables stay in each tenant's namespace). What a hit tells a tenant is that the same
program was compiled before, which the time of a warm compile told already.

Entries are written whole (a temporary name renamed into place, or one object write) and
checked when read (a magic line and the SHA-256 of the payload); a bad one is a miss.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from typing import Any

from isthmus.worker.compile_cache import CacheConfig, filesystem, write_whole

logger = logging.getLogger(__name__)

FORMAT = b"isthmus-vetted 1\n"
_LENGTH = struct.Struct("<Q")


class VettedRecord:
    """The vetting process's conclusions for one compilation cache location."""

    def __init__(self, config: CacheConfig) -> None:
        import jaxlib

        self._url = f"{config.location.rstrip('/')}/.vetted"
        self._fs, self._dir = filesystem(self._url)
        self._version = jaxlib.__version__.encode()  # another jaxlib writes and compiles anew
        for part in ("programs", "compiled"):
            self._fs.makedirs(f"{self._dir}/{part}", exist_ok=True)
        self.hits = 0  # programs found here instead of asking the vetting process

    @property
    def location(self) -> str:
        """Where the marks are, for the vetting process to look (a path or an fsspec URL)."""
        return self._url

    # ---- programs, by the client's bytes --------------------------------------------------

    def program(self, raw: bytes) -> tuple[bytes, bytes] | None:
        """(the vetted program, its canonical digest) for the client's bytes and trial
        options named by `raw` (their SHA-256s), or None."""
        payload = self._read(f"{self._dir}/programs/{self._name(raw)}")
        if payload is None or len(payload) < _LENGTH.size + 32:
            return None
        (size,) = _LENGTH.unpack_from(payload)
        module = payload[_LENGTH.size:_LENGTH.size + size]
        digest = payload[_LENGTH.size + size:]
        if len(module) != size or len(digest) != 32:
            return None
        self.hits += 1
        return module, digest

    def remember(self, raw: bytes, module: bytes, digest: bytes) -> None:
        self._write(f"{self._dir}/programs/{self._name(raw)}",
                    _LENGTH.pack(len(module)) + module + digest)

    # ---- trial compiles, by the canonical program -----------------------------------------

    def mark(self, digest: bytes, options: bytes) -> None:
        """Notes that the program of canonical `digest` compiled on trial with `options`."""
        self._write(mark_path(self._dir, self._version, digest, options), b"")

    def _name(self, raw: bytes) -> str:
        return hashlib.sha256(self._version + b"\0" + raw).hexdigest()

    # ---- entries --------------------------------------------------------------------------

    def _read(self, path: str) -> bytes | None:
        try:
            with self._fs.open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("vetted record: cannot read %s (%s)", path, e)
            return None
        head = len(FORMAT) + 32
        if not data.startswith(FORMAT) or len(data) < head or \
                hashlib.sha256(data[head:]).digest() != data[len(FORMAT):head]:
            return None
        return data[head:]

    def _write(self, path: str, payload: bytes) -> None:
        try:
            write_whole(self._fs, path, FORMAT + hashlib.sha256(payload).digest() + payload)
        except OSError as e:  # the record is an optimisation
            logger.warning("vetted record: cannot write %s (%s)", path, e)


def mark_path(directory: str, version: bytes, digest: bytes, options: bytes) -> str:
    """Where the mark of a trial compile lies (`VettedRecord.mark`)."""
    name = hashlib.sha256(version + b"\0" + digest + hashlib.sha256(options).digest())
    return f"{directory}/compiled/{name.hexdigest()}"


def marked(location: str, digest: bytes, options: bytes) -> bool:
    """In the vetting process: whether `digest` compiled on trial with `options` before
    (`location`: `VettedRecord.location`)."""
    import jaxlib

    fs: Any
    fs, directory = filesystem(location)
    try:
        return bool(fs.exists(mark_path(directory, jaxlib.__version__.encode(), digest,
                                        options)))
    except OSError:
        return False
