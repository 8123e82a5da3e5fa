"""Faults the hub's Xet side can be told to make, for tests of a client's checks (the daemon's
proofs, its token and URL refresh). Settings of the running app: ``hub.xet.faults`` in process,
``--xet-fault NAME[=VALUE]`` on ``cachecd hub serve``. Off by default; never for real use.

Each byte or proof fault applies to ``times`` answers (None: every answer), then stops, so a
client that retries can be shown to recover.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field, fields

FLAGS = ("flip_xorb_byte", "bad_chunk_header", "proof_node_flip", "swap_xorb", "expired_url",
         "expired_token")


@dataclass
class XetFaults:
    flip_xorb_byte: bool = False  # a byte of the first chunk's payload in each xorb range served
    bad_chunk_header: bool = False  # the first chunk header of a xorb range: a wrong size
    proof_node_flip: bool = False  # /v2/file-chunk-hashes: one node hash of a gap tree changed
    proof_offset: int = 0  # /v2/file-chunk-hashes answered for the range moved by this many bytes
    swap_xorb: bool = False  # /v{1,2}/reconstructions: the first two terms in swapped order
    expired_url: bool = False  # /v{1,2}/reconstructions: every xorb URL signed already expired
    expired_token: bool = False  # xet-read-token: a token already expired (exp in the past)
    times: int | None = None
    # Requests seen, by kind (token, reconstruction_v1/_v2, xorb, chunk_hashes, and the
    # refusals: xorb_expired, token_refused).
    counts: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fire(self, name: str) -> bool:
        """Whether fault ``name`` applies to this answer (one of ``times`` used if so)."""
        on = bool(getattr(self, name))
        with self._lock:
            if not on or self.times == 0:
                return False
            if self.times is not None:
                self.times -= 1
            return True

    def set(self, spec: str) -> None:
        """``NAME`` (a flag on), ``NAME=VALUE``; ``times=N``."""
        name, _, value = spec.partition("=")
        known = {f.name: f for f in fields(self) if not f.name.startswith("_") and f.name != "counts"}
        if name not in known:
            raise ValueError(f"unknown xet fault {name!r}: one of {', '.join(sorted(known))}")
        if name in FLAGS:
            setattr(self, name, value.lower() not in ("0", "false", "no") if value else True)
        else:
            setattr(self, name, int(value))
