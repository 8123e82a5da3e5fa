"""What differs between the daemon a service unit would run and the daemon running now.

``service install --dry-run`` prints it, so a user sees before installing what the switch
changes (an endpoint, peers, a budget...). Both sides are ``config.settings_summary``: the unit's
from the settings it is rendered from, the daemon's from its status (an older daemon without one:
the few keys its status had).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cachecd.config import Settings, settings_summary
from cachecd.errors import CachecdError


def running_status(socket: Path) -> dict[str, Any] | None:
    from cachecd_client import Client

    try:
        with Client(socket, timeout=5) as client:
            return dict(client.stats())
    except CachecdError:
        return None


def differences(settings: Settings, status: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, the running daemon's value, the unit's value) for each setting that differs."""
    have = status.get("settings") or {
        "endpoint": status.get("endpoint"), "cache_dirs": status.get("cache_dirs"),
        "models_dir": status.get("models_dir"), "offline": status.get("offline"),
        "budget": status.get("store", {}).get("budget")}
    want = settings_summary(settings)
    return [(k, have[k], v) for k, v in want.items() if k in have and _same(have[k]) != _same(v)]


def _same(value: Any) -> Any:
    if isinstance(value, str):
        return value.rstrip("/")
    if isinstance(value, list):
        return [_same(v) for v in value]
    return value


def describe(settings: Settings, socket: Path) -> list[str]:
    """``# ``-lines for the dry run: each difference, or that there is none or no daemon."""
    status = running_status(socket)
    if status is None:
        return [f"# no daemon answers on {socket}: nothing running to compare with"]
    who = f"the daemon running on {socket} (pid {status.get('pid')})"
    diff = differences(settings, status)
    if not diff:
        return [f"# {who} runs with the same settings as this unit"]
    return [f"# {who} differs from this unit in {len(diff)} setting(s):",
            *(f"#   {key}: running {_show(old)}, unit {_show(new)}" for key, old, new in diff)]


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]" if value else "none"
    return str(value) if value not in ("", None) else "none"
