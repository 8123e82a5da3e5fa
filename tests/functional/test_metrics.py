"""``/metrics`` of a real daemon, fetched with curl as a Prometheus scrape would, parsed with
prometheus_client's own parser and checked against ``/v1/status`` of the same daemon."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.harness import TINY_REPO


def _get(daemon: Any, path: str, *extra: str) -> str:
    return subprocess.run(["curl", "-sS", *extra, "--unix-socket", str(daemon.socket),
                           f"http://d{path}"], capture_output=True, text=True, check=True).stdout


def _scrape(daemon: Any) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(_get(daemon, "/metrics"))}


def _value(families: dict[str, Any], family: str, **labels: str) -> float:
    found = [s.value for s in families[family].samples if s.labels == labels]
    assert len(found) == 1, (family, labels, families[family].samples)
    return float(found[0])


def test_metrics_are_prometheus_exposition(daemon, tiny_manifest) -> None:
    layer = tiny_manifest.moe_layers[0]
    with daemon.client() as c:
        c.experts(TINY_REPO, layer, [0, 1, 2])
        c.experts(TINY_REPO, layer, [1, 2, 3])
        c.experts(TINY_REPO, layer, [1, 2])  # all hits
    head = _get(daemon, "/metrics", "-sSI")
    assert "content-type: text/plain; version=" in head.lower(), head
    first = _scrape(daemon)
    status = json.loads(_get(daemon, "/v1/status"))

    for f in first.values():
        assert f.documentation.strip(), f"{f.name} has no HELP"
        if f.type == "counter":
            assert all(s.name == f.name + "_total" for s in f.samples), f.samples
        assert not {"expert", "layer", "digest"} & {k for s in f.samples for k in s.labels}

    # Counts are counters, figures that go up and down gauges, each with the status' exact value.
    counters = {"expert_requests": 8, "expert_hits": 4, "expert_misses": 4, "fetched_experts": 4}
    for key, want in counters.items():
        assert first[f"cachecd_{key}"].type == "counter"
        assert _value(first, f"cachecd_{key}") == status["counters"][key] == want
    assert first["cachecd_fetched_bytes"].type == "counter"
    assert _value(first, "cachecd_fetched_bytes") == status["counters"]["fetched_bytes"]
    # The policy's uses, not to be mistaken for the requests' hits (cachecd_expert_hits_total).
    assert "cachecd_store_hits" not in first and "cachecd_store_misses" not in first
    assert first["cachecd_store_policy_uses"].type == "counter"
    assert _value(first, "cachecd_commit_failed") == 0  # a known counter is there before it counts
    assert first["cachecd_upstream_requests_range"].type == "counter"
    assert _value(first, "cachecd_upstream_bytes") == status["upstream"]["bytes"] > 0
    assert first["cachecd_scrub_failures"].type == "counter"
    for gauge in ("cachecd_store_entries", "cachecd_store_bytes", "cachecd_inflight_fetches",
                  "cachecd_upstream_in_flight", "cachecd_uptime_seconds"):
        assert first[gauge].type == "gauge", gauge
    assert _value(first, "cachecd_store_entries") == status["store"]["entries"] == 4
    # 67108864 under %g was 6.71089e+07: every digit must survive.
    assert status["store"]["index_map_size"] >= 10**7
    assert (_value(first, "cachecd_store_index_map_size_bytes")
            == status["store"]["index_map_size"])

    # Labels where they carry meaning: the cache dir, the model.
    [free] = first["cachecd_cache_dir_free_bytes"].samples
    assert free.labels == {"cache_dir": str(daemon.cache_dir)} and free.value > 0
    assert _value(first, "cachecd_model_experts", model=TINY_REPO,
                  revision=tiny_manifest.revision) == tiny_manifest.n_experts
    [info] = first["cachecd_model_info"].samples
    assert info.labels["model"] == TINY_REPO and info.labels["revision"] == tiny_manifest.revision

    # Monotonic: more work, then every counter is at least what it was.
    with daemon.client() as c:
        c.experts(TINY_REPO, layer, [4, 5])
    second = _scrape(daemon)
    for name, f in first.items():
        if f.type == "counter":
            for s in f.samples:
                assert _value(second, name, **s.labels) >= s.value, name
    assert _value(second, "cachecd_fetched_experts") == 6


def _sample(families: dict[str, Any], family: str, suffix: str, **labels: str) -> float:
    found = [s.value for s in families[family].samples
             if s.name == family + suffix and s.labels == labels]
    assert len(found) == 1, (family, suffix, labels)
    return float(found[0])


def test_metric_names_follow_prometheus_conventions(daemon, tiny_manifest) -> None:
    """Units as suffixes, Unix times as _timestamp_seconds, and latency histograms for hits,
    misses and upstream requests, counted as the requests were made."""
    layer = tiny_manifest.moe_layers[0]
    with daemon.client() as c:
        c.experts(TINY_REPO, layer, [0, 1])  # a miss
        c.experts(TINY_REPO, layer, [0, 1])  # a hit
        c.experts(TINY_REPO, layer, [1])  # a hit
    families = _scrape(daemon)
    status = json.loads(_get(daemon, "/v1/status"))
    bare = ("budget", "reserved", "size", "rate", "seconds_done", "bytes_done", "bytes_served")
    for name, f in families.items():
        if not name.startswith("cachecd_"):
            continue
        assert not name.endswith(bare), f"{name}: a unit belongs at the end"
        if "bytes" in name:
            assert name.endswith(("_bytes", "_bytes_per_second")), name
        if f.documentation.startswith("Unix time"):
            assert name.endswith("_timestamp_seconds"), name
    for name in ("cachecd_store_budget_bytes", "cachecd_store_reserved_bytes",
                 "cachecd_store_quarantine_bytes", "cachecd_scrub_rate_bytes_per_second"):
        assert families[name].type == "gauge", name
    assert _value(families, "cachecd_scrub_rate_bytes_per_second") == status["scrub"]["rate"]

    hit, miss = families["cachecd_hit_latency_seconds"], families["cachecd_miss_latency_seconds"]
    assert hit.type == miss.type == "histogram"
    assert _sample(families, "cachecd_hit_latency_seconds", "_count") == 2
    assert _sample(families, "cachecd_miss_latency_seconds", "_count") == 1
    assert 0 < _sample(families, "cachecd_hit_latency_seconds", "_sum") < 5
    upstream = "cachecd_upstream_request_duration_seconds"
    assert families[upstream].type == "histogram"
    # The hub keeps the shards in Xet: the experts came as signed xorb ranges, proven.
    assert (_sample(families, upstream, "_count", kind="xet_xorb")
            == status["upstream"]["requests_xet_xorb"] > 0)
    assert _value(families, "cachecd_upstream_xet_windows") == status["upstream"]["xet_windows"]
    assert (_sample(families, upstream, "_count", kind="resolve")
            == status["upstream"]["requests_resolve"] > 0)
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)
