"""The zero-copy data path's wire format, shared by the daemon and the client.

Hits must not be copied through HTTP, so expert bytes travel as open file descriptors: the
client sends one frame ``{"op": "experts", "model": ..., "layer": L, "ids": [...]}`` (with
``"warm": true`` when the reads warm the cache: counted as warm fetches, not as use) and the
daemon answers one frame ``{"ok": true, "experts": [{"expert": E, "size": N, "fetched": bool}]}``
(``fetched``: this request waited for an upstream fetch of that expert)
with one fd per expert attached (SCM_RIGHTS) to the answer's first byte, in the same order. The
client ``preadv``s each fd from offset 0 and closes it. An error answer is the wire error form
``{"ok": false, "error": code, "message": ..., "retryable": bool}`` with no fds.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from cachecd.errors import InvalidRequest

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 20
# The kernel caps fds per message (SCM_MAX_FD is 253 on Linux); batches stay under it.
MAX_FDS_PER_FRAME = 240


def encode(payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise InvalidRequest(f"frame of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return HEADER.pack(len(body)) + body


def encode_experts(experts: list[tuple[int, int, bool]]) -> bytes:
    """The ``ok`` answer for (expert, size, fetched) rows: the same bytes as ``encode`` of the
    equivalent dict, built without the generic encoder (a hit is hot)."""
    rows = ",".join(
        f'{{"expert":{int(e)},"size":{int(n)},"fetched":{"true" if f else "false"}}}'
        for e, n, f in experts
    )
    body = f'{{"ok":true,"experts":[{rows}]}}'.encode()
    if len(body) > MAX_FRAME:
        raise InvalidRequest(f"frame of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise InvalidRequest(f"frame of {length} bytes is over the {MAX_FRAME}-byte limit")
    return length


class FrameReader:
    """Frames out of a byte stream as it arrives: the one reader the daemon and the client share.
    ``feed`` what a receive brought, take each whole frame's body from ``next``; ``want`` is how
    many more bytes the frame under way needs, so one receive usually brings a whole frame."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need = HEADER.size  # the bytes the frame under way takes, header included
        self._length = -1  # its body's length, once its header is in

    def feed(self, data: bytes) -> None:
        self._buf += data

    def want(self) -> int:
        return max(1, self._need - len(self._buf))

    def next(self) -> bytes | None:
        """The next whole frame's body (bytes after it stay for the one after); None for now."""
        if self._length < 0 and len(self._buf) >= self._need:
            self._length = frame_length(bytes(self._buf[: HEADER.size]))
            self._need += self._length
        if self._length < 0 or len(self._buf) < self._need:
            return None
        body = bytes(self._buf[HEADER.size : self._need])
        del self._buf[: self._need]
        self._need, self._length = HEADER.size, -1
        return body


def decode(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"frame is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("frame must be a JSON object")
    return payload
