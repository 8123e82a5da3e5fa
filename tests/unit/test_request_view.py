"""A request's window over the engine's counters, and how overlapping requests are told apart."""

from __future__ import annotations

from cachecd_engine.request_view import FIELDS, RequestViews


class Counters:
    def __init__(self) -> None:
        self.now = {key: 0 for key in (*FIELDS.values(), "staged")}

    def add(self, **kw: float) -> None:
        for key, value in kw.items():
            self.now[key] += value

    def __call__(self) -> dict[str, float]:
        return dict(self.now)


def test_a_lone_request_gets_exactly_its_counts() -> None:
    counters = Counters()
    views = RequestViews(counters)
    counters.add(fetched=5, source_hits=9)  # before the request: not its own
    w = views.open()
    counters.add(fetched=3, source_hits=4, source_bytes=4096, staged_hits=2, ram_hits=1, wait_s=0.25,
                 staged=3, experts_routed=7, rows=12)
    view = views.view(w)
    assert views.view(w, prompt_tokens=30, cached_tokens=21) == {
        **view, "prompt_tokens_cached": 21, "prompt_tokens_prefilled": 9}
    views.close(w)
    assert view == {"experts_fetched": 3, "experts_from_daemon": 4, "experts_read_ahead": 2,
                    "experts_from_ram": 1, "bytes_from_daemon": 4096, "expert_wait_s": 0.25,
                    "experts_routed": 7, "expert_rows": 12, "experts_read": 4 + 3,
                    "other_requests": 0}


def test_overlapping_requests_say_so_both_ways() -> None:
    counters = Counters()
    views = RequestViews(counters)
    a = views.open()
    counters.add(fetched=2)
    b = views.open()  # arrives while a is in flight
    counters.add(fetched=3)
    assert views.view(b)["experts_fetched"] == 3 and views.view(b)["other_requests"] == 1
    views.close(b)
    c = views.open()  # after b: overlaps a only
    views.close(c)
    assert views.view(a)["experts_fetched"] == 5 and views.view(a)["other_requests"] == 2
    views.close(a)
    assert views.view(c)["other_requests"] == 1
    d = views.open()  # alone again
    assert views.view(d)["other_requests"] == 0
