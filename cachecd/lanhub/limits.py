"""The Hub's rate limit on ``/resolve``, for a hub that should answer as the Hub does at scale.

The Hub counts resolves per caller over fixed windows of 5 minutes (3,000 anonymous, 5,000 signed
in, https://huggingface.co/docs/hub/rate-limits) and tells the caller where it stands in the
IETF draft's headers, on every answer: ``RateLimit: "resolvers";r=REMAINING;t=SECONDS`` and
``RateLimit-Policy: "fixed window";"resolvers";q=LIMIT;w=WINDOW``; past the limit it answers 429.

Invariants:
- A caller is its token when it sends one (signed in), else its address (anonymous); each has
  its own count, reset when its window ends. Windows start at the caller's first request.
- ``t`` is rounded up to whole seconds, so a caller that waits ``t`` finds a fresh window.
- No more than the limit is ever answered (anything but 429) in one window of one caller.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass

BUCKET = "resolvers"
HUB_WINDOW_S = 300.0
HUB_ANONYMOUS = 3000
HUB_SIGNED_IN = 5000
_MAX_CALLERS = 10_000


@dataclass
class _Window:
    start: float
    used: int = 0


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    headers: dict[str, str]


class ResolveLimit:
    """Fixed-window counts of ``/resolve`` per caller; ``check`` counts one request."""

    def __init__(self, anonymous: int, signed_in: int, window_s: float = HUB_WINDOW_S) -> None:
        self.anonymous, self.signed_in, self.window_s = anonymous, signed_in, window_s
        self._windows: dict[str, _Window] = {}

    def check(self, address: str, authorization: str) -> Verdict:
        now = time.monotonic()
        signed = bool(authorization)
        caller = ("t:" + hashlib.sha256(authorization.encode()).hexdigest()) if signed \
            else "a:" + address
        limit = self.signed_in if signed else self.anonymous
        window = self._windows.get(caller)
        if window is None or now >= window.start + self.window_s:
            if len(self._windows) >= _MAX_CALLERS:
                self._forget_ended(now)
            window = self._windows[caller] = _Window(now)
        allowed = window.used < limit
        window.used += allowed
        reset = max(1, math.ceil(window.start + self.window_s - now))
        headers = {
            "RateLimit": f'"{BUCKET}";r={max(0, limit - window.used)};t={reset}',
            "RateLimit-Policy": f'"fixed window";"{BUCKET}";q={limit};w={math.ceil(self.window_s)}',
        }
        return Verdict(allowed, headers)

    def _forget_ended(self, now: float) -> None:
        for caller in [c for c, w in self._windows.items() if now >= w.start + self.window_s]:
            del self._windows[caller]
