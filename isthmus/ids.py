"""Typed identifiers shared by the controller, the front end and the workers."""

from __future__ import annotations

from typing import NewType

DeviceId = NewType("DeviceId", int)  # global device id, as the client sees it
# The id of an accelerator's colocated CPU device is this plus the accelerator's.
COMPANION_BASE = 1 << 20
ArrayHandle = NewType("ArrayHandle", int)  # IFRT array handle within one session
BufferId = NewType("BufferId", int)  # one shard's bytes on one worker, unique per controller
ExecutableId = NewType("ExecutableId", int)  # a loaded executable, unique per controller
HostBufferHandle = NewType("HostBufferHandle", int)  # a host buffer within one session
SessionId = NewType("SessionId", int)
WorkerId = NewType("WorkerId", int)
SliceId = NewType("SliceId", int)
