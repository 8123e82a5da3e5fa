"""Client library for the cachecd daemon.

    from cachecd_client import Client
    with Client() as c:
        bufs = c.experts("org/name", layer=3, ids=[5, 17])

Errors are cachecd's typed errors (``cachecd.errors``); ``DaemonUnavailable`` when no daemon runs.
"""

from cachecd.errors import CachecdError, DaemonUnavailable
from cachecd_client.api import AsyncClient, Client, default_socket, resolve_model

__all__ = ["AsyncClient", "CachecdError", "Client", "DaemonUnavailable", "default_socket",
           "resolve_model"]
