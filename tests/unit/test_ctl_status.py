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


def test_the_scrub_shows_its_pass_its_last_full_pass_and_what_it_found() -> None:
    import time

    scrub = {"rate": 4 << 20, "running": True, "blobs": 900, "bytes": 9 << 30, "failures": 1,
             "missing": 0, "passes": 2, "yields": 3,
             "pass": {"blobs_done": 10, "blobs_total": 400, "bytes_done": 1 << 30,
                      "bytes_total": 4 << 30, "started": time.time() - 60, "failures": 0},
             "last_pass": {"finished": time.time() - 7200, "seconds": 1000.0, "blobs": 400,
                           "bytes": 4 << 30, "failures": 1}}
    text = render_status({**BASE, "scrub": scrub})
    assert "scrub       pass 3: 10/400 blobs, 1.0 GiB of 4.0 GiB, at 4.0 MiB/s" in text
    assert "last scrub  full pass 2.0 h ago (400 blobs in 1000 s), 1 failed their hash" in text
    attention = [line for line in text.splitlines() if line.startswith("attention")]
    assert len(attention) == 1 and "background scrub" in attention[0]
    off = render_status({**BASE, "scrub": {"rate": 0}})
    assert "scrub       off (--scrub-rate 0)" in off and "attention" not in off


def test_each_model_shows_its_coverage_of_what_the_daemon_serves() -> None:
    whole = {"repo": "org/a", "revision": "a" * 40, "experts_total": 256,
             "expert_bytes_total": 256 << 20, "experts_served": 256,
             "expert_bytes_served": 256 << 20, "experts_cached": 64,
             "expert_bytes_cached": 64 << 20}
    rank = {**whole, "repo": "org/b", "layers": [1, 3], "pipeline": {"rank": 0, "size": 2},
            "experts_served": 128, "expert_bytes_served": 128 << 20, "experts_cached": 128,
            "expert_bytes_cached": 128 << 20}
    text = render_status({**BASE, "models": [whole, rank]}).splitlines()
    at = text.index(next(line for line in text if line.startswith("model       org/a")))
    assert text[at + 1] == "  cached    64/256 experts, 64.0 MiB of 256.0 MiB (25.0%)"
    assert "  cached    128/128 experts, 128.0 MiB of 128.0 MiB (100.0%)" in text
