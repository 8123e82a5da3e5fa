"""What ``cachecd setup`` was told, recorded for every later start of the same daemon.

Invariants:
- The record (``config.recorded_path``: beside the config file, one per daemon socket) holds only
  ``config.RECORDED_KEYS``, and of those only what a setup's command line gave: a later setup
  that names fewer keeps the others, so a second model's setup does not drop the first one's
  endpoint or peers. Paths are written absolute.
- It is replaced with ``durable.write_atomic``: a crash leaves the old record or the new one. It
  is written only after the model is registered, so a setup that failed changes nothing there.
- It is TOML that reads back to exactly what was written (checked before it replaces the old
  one), so ``config.load_settings`` validates it like any other layer.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from cachecd.config import RECORDED_KEYS, Settings, active_config_file, recorded_path
from cachecd.durable import write_atomic
from cachecd.errors import ConfigInvalid


def told(settings: Settings, given: dict[str, Any]) -> dict[str, Any]:
    """The recorded keys the command line gave (``given``: argparse dests -> values or None),
    as the settings resolved them."""
    out: dict[str, Any] = {}
    for key in RECORDED_KEYS:
        if given.get(key) in (None, []):
            continue
        value = getattr(settings, key)
        if isinstance(value, list):
            out[key] = [str(Path(v).absolute()) if isinstance(v, Path) else str(v) for v in value]
        elif isinstance(value, Path):
            out[key] = str(value.absolute())
        else:
            out[key] = value
    return out


def record(socket: Path, values: dict[str, Any]) -> Path:
    """Merge ``values`` into the record of the daemon on ``socket``; returns its path."""
    path = recorded_path(active_config_file(), socket)
    try:
        kept = tomllib.loads(path.read_text()) if path.exists() else {}
    except (OSError, tomllib.TOMLDecodeError):
        kept = {}  # unreadable: the new record replaces it whole
    merged = {k: v for k, v in {**kept, **values}.items() if k in RECORDED_KEYS}
    text = render(merged, socket)
    if tomllib.loads(text) != merged:
        raise ConfigInvalid(f"cannot record {merged!r} as TOML in {path}")
    write_atomic(path, text.encode("utf-8"), mode=0o600)
    return path


def render(values: dict[str, Any], socket: Path) -> str:
    lines = [f"# Written by `cachecd setup` for the daemon on {socket}: what setup was told,",
             "# read by every later start of that daemon below CACHECD_* and the command line",
             "# (docs/daemon.md, Settings). Edit or delete it to change what sticks.", ""]
    for key in sorted(values):
        lines.append(f"{key} = {_toml_value(values[key])}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    # A JSON string is a TOML basic string for what a path or URL holds (render's caller
    # checks the round trip for anything else).
    return json.dumps(str(value), ensure_ascii=False)
