"""The token the upstream sends to the endpoint, and the headers built from it.

Invariants:
- A token given explicitly (a string) is sent as-is and never replaced; ``False`` sends none.
- Otherwise (``None``) the token is asked of huggingface_hub (``get_token``: ``HF_TOKEN``, then
  the token file ``hf auth login`` writes) again before each resolve and after a 401, so a login
  after the daemon started counts at its next fetch, without a restart.
- The token is never logged; only whether one is set.
"""

from __future__ import annotations

import asyncio
import logging

from huggingface_hub import get_token
from huggingface_hub.utils import build_hf_headers

from cachecd import constants
from cachecd.secrets import register

log = logging.getLogger(__name__)


def _headers(token: str | None) -> dict[str, str]:
    # False, not None: build_hf_headers would look the token up itself.
    return build_hf_headers(
        token=token or False, library_name=constants.APP, library_version=constants.VERSION
    )


class HubAuth:
    """``headers`` for the endpoint (with the token), ``plain`` for anyone else (a CDN).

    Built in a thread at first (huggingface_hub may read files, even the network, for a token or
    its headers), and ``refresh`` keeps that off the event loop too."""

    def __init__(self, token: str | bool | None) -> None:
        self._follow = token is None
        self._token: str | None = token if isinstance(token, str) else None
        if self._follow:
            self._token = get_token()
        if self._token:
            register(self._token)  # scrubbed from every log line and error from now on
        self.headers = _headers(self._token)
        self.plain = {"user-agent": self.headers["user-agent"]}

    async def refresh(self) -> bool:
        """Ask huggingface_hub for the token again; True if it changed (the headers with it)."""
        if not self._follow:
            return False
        try:
            token = await asyncio.to_thread(get_token)
        except Exception as exc:  # an OIDC exchange or refresh that failed: keep the last one
            log.warning("event=token_lookup_failed err=%s", exc.__class__.__name__)
            return False
        if token == self._token:
            return False
        if token:
            register(token)
        self.headers = await asyncio.to_thread(_headers, token)
        self._token = token
        log.info("event=token_changed token=%s", "set" if token else "none")
        return True
