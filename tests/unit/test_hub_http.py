"""The pure rules of talking to a Hub: Content-Range, waits, backoff, signed URLs, error mapping,
and the coalescing plan."""

from __future__ import annotations

import random
from dataclasses import dataclass
from email.utils import formatdate

import pytest

from cachecd import errors
from cachecd.upstream import hub_http as hh
from cachecd.upstream.hub_plan import plan_requests


def test_content_range_parsing() -> None:
    assert hh.parse_content_range("bytes 0-99/1000") == (0, 100, 1000)
    assert hh.parse_content_range("bytes 5-5/*") == (5, 6, None)
    for bad in (None, "", "bytes 0-99", "bytes=0-99/1000", "items 0-1/2", "bytes 0-99/1000, 1"):
        assert hh.parse_content_range(bad) is None


def test_retry_after_seconds_and_http_date() -> None:
    assert hh.parse_retry_after("2") == 2.0
    now = 1_800_000_000.0
    assert hh.parse_retry_after(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(
        30, abs=1
    )
    assert hh.parse_retry_after(formatdate(now - 30, usegmt=True), now=now) == 0.0
    assert hh.parse_retry_after("soon") is None and hh.parse_retry_after(None) is None


def test_server_wait_takes_the_longest_hint() -> None:
    assert hh.server_wait({"Retry-After": "2", "RateLimit": '"api";r=0;t=40'}) == 40.0
    assert hh.server_wait({"RateLimit-Reset": "7"}) == 7.0
    assert hh.server_wait({"RateLimit": '"api";r=10;t=0'}) == 0.0
    assert hh.server_wait({}) is None


def test_backoff_is_capped_full_jitter() -> None:
    rng = random.Random(1)
    delays = [hh.backoff_delay(a, 0.5, 4.0, rng) for a in range(10) for _ in range(50)]
    assert all(0.0 <= d <= 4.0 for d in delays)
    assert max(hh.backoff_delay(0, 0.5, 4.0, rng) for _ in range(200)) <= 0.5
    assert max(delays) > 3.0  # reaches the cap's neighbourhood, so it is not constant


def test_signed_url_expiry_forms() -> None:
    assert hh.signed_url_expiry("https://cdn/x?Expires=1800000000&Signature=s") == 1_800_000_000
    amz = "https://s3/x?X-Amz-Date=20270101T000000Z&X-Amz-Expires=3600&X-Amz-Signature=s"
    assert hh.signed_url_expiry(amz) == 1_798_761_600 + 3600
    assert hh.signed_url_expiry("https://cdn/x?sig=1") is None


@pytest.mark.parametrize(
    ("status", "on_resolve", "cls"),
    [
        (401, True, errors.Unauthorized),
        (403, True, errors.Gated),
        (403, False, errors.UpstreamError),
        (404, False, errors.NotFound),
        (416, False, errors.BadUpstreamRange),
        (429, False, errors.UpstreamRateLimited),
        (503, False, errors.UpstreamError),
    ],
)
def test_status_to_error_keeps_message_and_request_id(
    status: int, on_resolve: bool, cls: type[errors.CachecdError]
) -> None:
    err = hh.error_for_status(
        status, b"Repo is gated", "Root=1-abc", "GET f", on_resolve=on_resolve
    )
    assert type(err) is cls
    assert "Repo is gated" in err.message and "Root=1-abc" in err.message
    assert err.request_id == "Root=1-abc"
    assert hh.is_retryable_status(status) == (status in (429, 503))


@dataclass(frozen=True)
class R:
    file: str
    start: int
    end: int


@dataclass(frozen=True)
class E:
    layer: int
    expert: int
    nbytes: int
    xxh3: bytes
    ranges: tuple[R, ...]


def entries(spans: list[tuple[str, int, int]]) -> list[E]:
    return [E(0, i, e - s, b"", (R(f, s, e),)) for i, (f, s, e) in enumerate(spans)]


def test_plan_merges_neighbours_within_gap_and_bounds() -> None:
    es = entries([("a", 0, 10), ("a", 10, 20), ("a", 25, 30), ("a", 100, 110), ("b", 0, 5)])
    reqs = plan_requests(es, max_bytes=1000, max_experts=10, max_gap=5)
    assert [(r.file, r.start, r.end) for r in reqs] == [("a", 0, 30), ("a", 100, 110), ("b", 0, 5)]
    assert [sorted(r.experts()) for r in reqs] == [[0, 1, 2], [3], [4]]
    by_count = plan_requests(es, max_bytes=1000, max_experts=2, max_gap=5)
    assert [(r.start, r.end) for r in by_count if r.file == "a"] == [(0, 20), (25, 30), (100, 110)]
    by_bytes = plan_requests(es, max_bytes=15, max_experts=10, max_gap=5)
    assert [(r.start, r.end) for r in by_bytes if r.file == "a"] == [
        (0, 10),
        (10, 20),
        (25, 30),
        (100, 110),
    ]


def test_plan_keeps_the_pieces_of_a_split_expert_in_order() -> None:
    split = E(1, 7, 15, b"", (R("a", 90, 100), R("b", 0, 5)))
    reqs = plan_requests([split, *entries([("a", 80, 90)])], max_bytes=100, max_experts=4)
    pieces = sorted(
        (p.part, r.file, p.start, p.end) for r in reqs for p in r.pieces if p.entry == 0
    )
    assert pieces == [(0, "a", 90, 100), (1, "b", 0, 5)]
    assert sum(len(r.pieces) for r in reqs) == 3


def test_plan_a_range_bigger_than_the_limit_is_alone() -> None:
    es = entries([("a", 0, 500), ("a", 500, 510)])
    reqs = plan_requests(es, max_bytes=100, max_experts=4)
    assert [(r.start, r.end) for r in reqs] == [(0, 500), (500, 510)]


def test_plan_keeps_enough_requests_for_parallel_streams() -> None:
    es = entries([("a", i * 10, i * 10 + 10) for i in range(16)])
    assert len(plan_requests(es, max_bytes=10_000, max_experts=16)) == 1
    spread = plan_requests(es, max_bytes=10_000, max_experts=16, parallel=8)
    assert [len(r.experts()) for r in spread] == [2] * 8
    big = entries([("a", i * 10, i * 10 + 10) for i in range(200)])
    counts = [
        len(r.experts()) for r in plan_requests(big, max_bytes=10_000, max_experts=16, parallel=8)
    ]
    assert counts == [16] * 12 + [8]  # plenty of requests: the usual bound applies


PROXIES = {"http": "http://u:p@proxy:3128", "https": "proxy:3128",
           "no": "localhost, .corp.example,10.1.2.3:8080"}


@pytest.mark.parametrize(("url", "proxies", "want"), [
    ("http://127.0.0.1:9000/x", PROXIES, "http://u:p@proxy:3128"),
    ("https://huggingface.co/x", PROXIES, "http://proxy:3128"),  # curl's reading of host:port
    ("http://localhost:7/x", PROXIES, None),
    ("https://cdn.corp.example/x", PROXIES, None),  # a domain suffix
    ("http://10.1.2.3:8080/x", PROXIES, None),  # host and port
    ("http://10.1.2.3:9090/x", PROXIES, "http://u:p@proxy:3128"),  # another port
    ("https://huggingface.co/x", {"all": "http://any:1"}, "http://any:1"),
    ("https://huggingface.co/x", {"https": "http://p:1", "no": "*"}, None),
    ("https://huggingface.co/x", {"http": "http://p:1"}, None),  # no proxy for https
    ("https://huggingface.co/x", {}, None),
])
def test_proxy_for_follows_the_environments_rules(
    url: str, proxies: dict[str, str], want: str | None
) -> None:
    assert hh.proxy_for(url, proxies) == want


def test_a_socks_proxy_is_named_not_bypassed() -> None:
    with pytest.raises(errors.UpstreamError, match="socks5:// proxy") as info:
        hh.proxy_for("https://huggingface.co/x", {"all": "socks5://u:secret@h:1080"})
    assert "secret" not in info.value.message
