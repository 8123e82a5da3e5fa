"""The one interface for sources of expert bytes: what ``fetch.Upstream`` reads through.

A source gives exact byte ranges of a file at a manifest's pinned commit. It does not verify:
``fetch.Upstream`` above it coalesces neighbouring experts, hashes every expert against the
manifest and hands over only verified bytes, whatever the source. So a source that serves wrong
bytes costs refetches and a ``checksum_mismatch``, never a wrong byte served.

What every source keeps:
- ``get_range`` returns exactly ``end - start`` bytes of ``file`` at ``manifest.revision``, or
  raises a typed ``CachecdError`` (``retryable`` saying whether asking again may help). With a
  ``consumer`` the bytes go to it as they arrive (``restart`` before every attempt, then ``feed``
  in order) and an empty buffer is returned.
- ``offline`` sources refuse every range with ``offline_error``; hits are still served.
- ``use_checks`` names the checks run on a manifest before any expert of it flows (the check on
  use, ``daemon.registry`` and ``daemon.layout_gate``): the manifest's files against what the
  source holds at that commit, and its ranges against the shards' own safetensors headers.
- ``stats`` are counters for ``cachecd status`` and ``/metrics`` (``requests_range``,
  ``bytes``, ``faults_<kind>``, ``in_flight``...); ``count`` adds to them.

A new kind of source is one module with a class that has these methods and a ``from_settings``,
and one line in ``choose.KINDS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cachecd import errors

# A check on use: returns when the manifest agrees, raises ManifestMismatch (or why it could not
# ask) otherwise. Called on a thread: it may block.
Check = Callable[[Any], None]


class Consumer(Protocol):
    """Takes a body as it arrives instead of a buffer: ``restart`` before every attempt (a
    retry starts over at offset 0), then ``feed`` with each chunk in order and its offset."""

    async def restart(self) -> None: ...

    def feed(self, chunk: bytes, pos: int) -> None: ...


@dataclass(frozen=True)
class UseChecks:
    """The checks on use of one source. ``metadata`` None: none can be asked (offline); the
    upstream then compares each file as it first reads it. ``layout`` is never skipped: no
    expert flows until it has passed (it may use headers kept from an earlier pass)."""

    metadata: Check | None
    layout: Check


class ExpertSource(Protocol):
    """Exact byte ranges of files at a pinned commit (the module docstring has the rules)."""

    where: str  # names the source in messages and status: an endpoint URL, a folder
    offline: bool
    max_parallel: int  # ranges it serves at once; the upstream plans its requests for as many

    async def get_range(
        self, manifest: Any, file: str, start: int, end: int, consumer: Consumer | None = None
    ) -> bytearray: ...

    def use_checks(self, keep: Path, deadline_s: float) -> UseChecks: ...

    def stats(self) -> dict[str, int]: ...

    def count(self, name: str, n: int = 1) -> None: ...

    def observe_requests(self, observe: Callable[[str, float], None]) -> None: ...

    def offline_error(self, what: str) -> errors.Offline: ...

    async def close(self) -> None: ...


def offline_error(what: str) -> errors.Offline:
    """What an offline source answers for bytes it would have to fetch."""
    return errors.Offline(
        f"offline mode (HF_HUB_OFFLINE) is on and {what} is not cached; unset HF_HUB_OFFLINE "
        "to fetch it, or warm the cache while online (`cachecd warm`)"
    )
