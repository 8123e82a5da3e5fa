"""The soak's leak bound (tests/faults/test_s17_soak.py) on made-up checkpoints: a leak of 7 KB a
request fails it in a 60 s run (it passed the old "8 MiB + 5 %" of growth), jitter alone does not,
and ten minutes tighten it."""

from __future__ import annotations

import random

from tests.faults.test_s17_soak import LEAK_PER_REQUEST, rss_per_request

MIB = 1 << 20


def _points(leak: float, requests: int, jitter: float, seed: int = 0) -> list[dict[str, float]]:
    rng = random.Random(seed)
    base, step = 75 * MIB, requests // 4
    return [{"requests": 400 + i * step, "rss": base + leak * i * step + rng.uniform(-jitter, jitter)}
            for i in range(5)]


def test_a_leak_of_7_kb_a_request_fails_in_a_minute() -> None:
    points = _points(7000, 1300, 1 * MIB)
    slope, bound = rss_per_request(points)
    assert slope > bound
    growth = points[-1]["rss"] - points[0]["rss"]
    assert growth <= 8 * MIB + 0.05 * points[0]["rss"]  # what the old criterion let through


def test_jitter_alone_passes_and_ten_minutes_tighten_the_bound() -> None:
    for seed in range(20):
        slope, bound = rss_per_request(_points(0, 1300, 1 * MIB, seed))
        assert slope <= bound, (seed, slope, bound)
    _, minute = rss_per_request(_points(0, 1300, 0))
    _, ten = rss_per_request(_points(0, 13000, 0))
    assert ten < minute and ten < 2.5 * LEAK_PER_REQUEST
    slope, bound = rss_per_request(_points(1000, 13000, 1 * MIB))
    assert slope > bound  # 1 KB a request shows in ten minutes
