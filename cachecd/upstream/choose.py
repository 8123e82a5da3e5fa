"""Which source of expert bytes the settings name, and the upstream over it: the one constructor
``cachecd serve`` and ``cachecd setup`` both call.

The endpoint's scheme picks the source kind (``KINDS``); one not listed is the Hub's (what every
endpoint meant before there were others). A new kind is one module (``source.ExpertSource``)
and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from cachecd.secrets import Secret
from cachecd.upstream.fetch import Upstream
from cachecd.upstream.source import ExpertSource

Token = str | bool | None


def _hub(settings: Any, token: Token) -> ExpertSource:
    # The Hub: files it keeps in Xet read through it and proven, the others by exact Range GETs.
    from cachecd.upstream.xet_source import XetSource

    return XetSource.from_settings(settings, token)


def _local_folder(settings: Any, token: Token) -> ExpertSource:
    from cachecd.upstream.local_folder import LocalFolder

    return LocalFolder.from_settings(settings)


KINDS: dict[str, Callable[[Any, Token], ExpertSource]] = {
    "http": _hub,
    "https": _hub,
    "file": _local_folder,  # a folder of repos (tests): file:///path/to/folder
}


def open_source(settings: Any, token: Token = None) -> ExpertSource:
    """The source ``settings.endpoint`` names (``settings``: a ``config.Settings``). ``token``:
    as ``HubClient`` takes it (None: the one huggingface_hub finds, asked at each resolve)."""
    return KINDS.get(urlsplit(settings.endpoint).scheme, _hub)(settings, token)


def open_upstream(settings: Any, token: Token = None,
                  peer_token: Secret | str | None = None) -> Upstream:
    """Verified fetches over ``open_source(settings, token)``, asking ``settings.peers`` first
    when ``peer_token`` is given. huggingface_hub may read a small registry synchronously the
    first time it builds headers: call it off the event loop."""
    peers = None
    if settings.peers and peer_token:
        from cachecd.upstream.peers import Peers

        peers = Peers.from_settings(settings, peer_token)
    return Upstream(open_source(settings, token), peers=peers)
