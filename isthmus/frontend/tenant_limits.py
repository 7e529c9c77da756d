"""What one tenant of a shared service may hold and ask, over all its sessions: the bytes of
its uploaded host buffers not yet used (`max_upload_bytes`), and its requests a second
(`max_requests_per_second`). Both are fields of its table in the tenants file, their
defaults settings at the file's top (`controller/tenants.py`).

A flood costs the flooder first: uploads over the cap are refused (the request that would
use one fails with RESOURCE_EXHAUSTED naming the setting; the session and its other arrays
go on), and requests beyond the rate wait in the tenant's own connection (its sessions stop
reading until the rate allows), so other tenants' requests are not queued behind them.
"""

from __future__ import annotations

import time

from isthmus import errors
from isthmus.controller.tenants import Tenant

QUANTUM_SECONDS = 0.01  # a tenant over its rate waits at least this long, then goes on


class UploadBudget:
    """The bytes a tenant's uploads hold until a request takes them, and its cap."""

    def __init__(self, tenant: Tenant, path: str) -> None:
        self.tenant = tenant
        self.path = path  # the tenants file, named in refusals
        self.held = 0

    def take(self, size: int) -> None:
        """Counts an upload of `size` bytes; TooLarge (RESOURCE_EXHAUSTED) over the cap."""
        limit = self.tenant.max_upload_bytes
        if self.held + size > limit:
            raise errors.TooLarge(
                f"tenant {self.tenant.name}'s uploaded host buffers not yet used would hold "
                f"{self.held + size} bytes, over its max_upload_bytes of {limit} (the tenants "
                f"file {self.path or ''}); use the arrays it uploads before uploading more, "
                "or ask the service's operator to raise max_upload_bytes.")
        self.held += size

    def give(self, size: int) -> None:
        self.held -= size


class Pace:
    """A token bucket of one second's worth of a tenant's requests."""

    def __init__(self, rate: float) -> None:
        self.rate = rate  # requests a second
        self.tokens = rate
        self.at = time.monotonic()
        self.waited = 0  # requests that had to wait

    def spend(self) -> float:
        """One request: the seconds to wait before the next one is read (0: none)."""
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate) - 1.0
        self.at = now
        if self.tokens >= 0:
            return 0.0
        self.waited += 1
        # Until the debt is paid and a quantum's worth is back: the next ones then go in a
        # burst (a wait per request would be a timer's resolution each, well below the rate).
        return -self.tokens / self.rate + QUANTUM_SECONDS


class TenantLimits:
    """One tenant's budget and pace, shared by all its sessions."""

    def __init__(self, tenant: Tenant, path: str) -> None:
        self.uploads = UploadBudget(tenant, path)
        self.pace = Pace(tenant.max_requests_per_second)
