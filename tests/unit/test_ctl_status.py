"""``cachecd status``'s text: the attention lines appear only for what needs looking into."""

from __future__ import annotations

from cachecd.ctl.cache import render_status

BASE = {"pid": 1, "uptime_s": 3.0, "version": "x", "socket": "/s", "endpoint": "http://h",
        "cache_dirs": ["/c"], "store": {"bytes": 0, "entries": 0}, "counters": {}}


def test_a_quiet_daemon_has_no_attention_lines() -> None:
    assert "attention" not in render_status(BASE)


def test_rot_and_refused_connections_are_called_out() -> None:
    info = {**BASE, "store": {**BASE["store"], "bit_rot_on_open": 2},
            "counters": {"control_connections_refused": 5}}
    lines = [line for line in render_status(info).splitlines() if line.startswith("attention")]
    assert len(lines) == 2
    assert "2 cached experts failed their hash" in lines[0] and "cachecd fsck" in lines[0]
    assert "5 control connections were refused" in lines[1]
