"""Setup's checks before it fetches or hashes anything, each refusing with what to do instead.

- A cache dir the daemon could not write is refused first (before the Hub is asked anything).
- A daemon already answering on the socket with another endpoint than this setup's is refused:
  the model would be installed from one endpoint and its experts fetched from the other.
- A budget too small for one prefill step of the model (``manifest.step_need``) is refused, once
  the model's config.json (its top-k) is installed and before its resident weights are fetched;
  the budget is the running daemon's where one answers, else the one setup would start it with.

After registering, setup says which recorded settings the daemon already running does not run
with (``not_yet_running``): they apply from its next start, never silently.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from cachecd.config import Settings
from cachecd.errors import CachecdError, ConfigInvalid, EndpointMismatch


def running(settings: Settings) -> dict[str, Any] | None:
    """The status of the daemon answering on the settings' socket, None when none answers."""
    from cachecd_client import Client

    try:
        with Client(settings.socket, timeout=10) as client:
            return dict(client.stats())
    except CachecdError:
        return None


def check_writable(dirs: list[Path], key: str = "--cache-dir") -> None:
    """Made if missing (as the daemon would), then a file created and removed in each."""
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".cachecd-write-check.", dir=d)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ConfigInvalid(
                f"{key} {d}: cannot write there ({exc.strerror}); the daemon keeps the experts "
                "it fetches in it, so give a directory on a writable disk you own (cachecd "
                "makes it if missing), or make this one writable") from None


def check_endpoint(settings: Settings, status: dict[str, Any] | None) -> None:
    if status is None:
        return
    theirs = str(status.get("endpoint") or "")
    if theirs.rstrip("/") == settings.endpoint.rstrip("/"):
        return
    raise EndpointMismatch(
        f"the daemon on {settings.socket} (pid {status.get('pid')}) fetches from {theirs}, and "
        f"this setup installs from {settings.endpoint}: its experts would come from elsewhere "
        f"than the model; stop it (cachecd stop) and run setup again to start one on "
        f"{settings.endpoint}, or pass --endpoint {theirs}")


def check_budget(settings: Settings, status: dict[str, Any] | None, manifest: Any,
                 local: Path, layers: Any = None) -> None:
    from cachecd.manifest.step_need import step_need, too_small, top_k_in
    from cachecd.report.coverage import served_mask

    budget = int((status or {}).get("store", {}).get("budget", settings.budget) or 0)
    if not budget:
        return
    served = served_mask(manifest, layers) if layers is not None else None
    need = step_need(manifest, top_k_in(local), served=served)
    if need.nbytes > budget:
        where = (f"the daemon on {settings.socket} runs with it; stop it (cachecd stop) and run "
                 "setup again with a larger --budget" if status else "")
        raise ConfigInvalid(too_small(budget, need, manifest.key) + (f"; {where}" if where else ""))


def not_yet_running(settings: Settings, status: dict[str, Any] | None,
                    told: dict[str, Any]) -> list[str]:
    """What setup recorded that the daemon already running does not run with (it started
    before): those apply from its next start."""
    from cachecd.config import settings_summary

    running_with = (status or {}).get("settings") or {}
    wanted = settings_summary(settings)
    return [f"{key} {wanted[key]} (it runs with {running_with[key]})" for key in sorted(told)
            if key in running_with and key in wanted and running_with[key] != wanted[key]]
