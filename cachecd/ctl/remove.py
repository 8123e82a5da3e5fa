"""``cachecd remove --model ORG/NAME [--experts]``: take a model off a running daemon.

The daemon does the work (``cachecd.daemon.removal``): it owns the registrations, the models dir
and the cache. This command says what was freed and what was kept, and why.
"""

from __future__ import annotations

import argparse
from typing import Any

from cachecd.config import add_common_arguments, load_settings
from cachecd.sizes import format_size


def register(sub: Any) -> None:
    p = sub.add_parser("remove", help="unregister a model and delete its resident files "
                                      "(--experts: its cached experts too)")
    p.add_argument("--model", required=True,
                   help="ORG/NAME to remove (always named: removing is not guessed)")
    p.add_argument("--experts", action="store_true",
                   help="evict its cached experts now (those another registered model shares stay)")
    add_common_arguments(p)
    p.set_defaults(func=remove)


def remove(args: argparse.Namespace) -> int:
    from cachecd_client import Client

    with Client(args.socket or load_settings().socket) as client:
        done = client.remove(args.model, experts=args.experts)
    print("\n".join(render_removal(done, args.experts)))
    return 0


def render_removal(done: dict[str, Any], experts: bool) -> list[str]:
    rev = (done.get("revision") or "")[:12]
    lines = [f"removed {done['repo']}{'@' + rev if rev else ''} from the daemon"]
    where, kept = done.get("resident_dir"), done.get("resident_kept")
    if kept:
        lines.append(f"kept its resident files in {where}: {kept}")
    elif where:
        lines.append(f"freed {format_size(done['resident_bytes_freed'])} of resident files "
                     f"({where})")
    if done.get("experts_unknown"):
        lines.append("its manifest could not be read, so which cached experts were its is "
                     "unknown: the eviction policy frees them when it needs room")
    elif experts:
        lines.append(f"freed {format_size(done['expert_bytes_freed'])}: "
                     f"{done['experts_evicted']} cached experts evicted" + _kept(done))
    elif done["experts_cached"]:
        lines.append(f"left its {done['experts_cached']} cached experts "
                     f"({format_size(done['expert_bytes_cached'])}) in the cache: the eviction "
                     "policy frees them when it needs room (--experts evicts them with the model)"
                     + _kept(done))
    if done.get("experts_unpinned"):
        lines.append(f"unpinned {done['experts_unpinned']} of its experts")
    if done.get("manifest"):
        lines.append(f"kept its manifest {done['manifest']}: `cachecd setup --stream "
                     f"{done['repo']}@{done.get('revision')} --manifest {done['manifest']}` "
                     "installs it again")
    if done.get("registered_at_start"):
        lines.append("the daemon registers it again at its next start (serve --manifest): "
                     "take that --manifest off its command line or config")
    return lines


def _kept(done: dict[str, Any]) -> str:
    parts = []
    if done.get("experts_shared"):
        parts.append(f"{done['experts_shared']} kept: another registered model has the same "
                     "bytes")
    if done.get("experts_in_use"):
        parts.append(f"{done['experts_in_use']} being read right now, left to the policy")
    return f" ({'; '.join(parts)})" if parts else ""
