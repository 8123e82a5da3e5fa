"""``/metrics``: the daemon's figures in the Prometheus text format, via prometheus_client.

Each scrape reads ``Daemon.status()`` (what ``cachecd status --json`` shows) through a collector
on the daemon's own registry, so the exposition and the status never disagree.

Names follow Prometheus' conventions: the unit is the name's suffix (``_bytes``, ``_seconds``,
``_bytes_per_second``; Unix times ``_timestamp_seconds``), counts of things name the thing
(``_experts``, ``_blobs``). Latencies are histograms (``Latencies``): a request for experts
answered from the cache (``cachecd_hit_latency_seconds``) or after a fetch
(``cachecd_miss_latency_seconds``), and each request sent upstream
(``cachecd_upstream_request_duration_seconds{kind}``).

Invariants:
- A count that only grows while the process lives is a counter, exposed as ``..._total`` (it
  restarts at 0 with the daemon, which ``rate()`` handles); a figure that can go down is a gauge.
- Every family has HELP. Values are exact: prometheus_client writes a float's shortest repr
  (an integer below 2**53 parses back to itself), never a rounded ``%g``.
- Labels carry what a dashboard groups by: ``cache_dir``, ``model``, an error ``code``, a fault
  ``kind``. Never an expert id or digest (unbounded series).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST

# status()["store"]: figures of the cache now (gauges) and counts since start (counters).
_STORE_GAUGES = {  # key -> (name after cachecd_store_, HELP)
    "entries": ("entries", "Experts in the cache."),
    "bytes": ("bytes", "Bytes of expert blobs in the cache."),
    "budget": ("budget_bytes", "The cache's byte budget (0: no budget)."),
    "reserved": ("reserved_bytes", "Bytes reserved for fetches under way."),
    "quarantine_bytes": ("quarantine_bytes", "Bytes quarantine/ keeps (counted in the budget)."),
    "pinned": ("pinned_experts", "Pinned experts."),
    "pinned_bytes": ("pinned_bytes", "Bytes of pinned experts."),
    "index_map_size": ("index_map_size_bytes", "Size of the LMDB index's map."),
}
_STORE_COUNTERS = {  # key -> (name after cachecd_store_, HELP)
    "inserts": ("inserts", "Experts committed to the cache."),
    "evictions": ("evictions", "Experts evicted."),
    "bytes_evicted": ("evicted_bytes", "Bytes evicted."),
    "quarantined": ("quarantined", "Blobs quarantined (failed their hash, or short)."),
    "verified_on_open": ("verified_on_open", "Blobs hashed on open that matched."),
    "bit_rot_on_open": ("bit_rot_on_open", "Blobs hashed on open that did not match (bit rot)."),
    "bit_rot_on_read": ("bit_rot_on_read", "Blobs a reader found wrong whose hash here failed "
                                           "too (bit rot caught as read; quarantined)."),
    "rechecked_good": ("rechecked_good", "Blobs a reader found wrong whose hash here matched "
                                         "(the reader's bytes were wrong, not the blob's)."),
    "missing_on_open": ("missing_on_open", "Blobs found missing, short or not a file when "
                                           "opened (their rows dropped)."),
}
# The store's "uses_cached" and "uses_gone" are the eviction policy's uses, by whether the blob
# was still cached when the use was recorded (after the answer: a miss fetched and committed by
# then is a cached use): not the requests' hits (cachecd_expert_hits_total).
_POLICY_USES = {"uses_cached": "cached", "uses_gone": "gone"}
# status()["counters"]: the daemon's own counts, all counters; ``fetch_error_<code>`` is labelled.
_DAEMON_COUNTERS = {
    "expert_requests": "Distinct experts asked for, per request.",
    "expert_hits": "Experts asked for that were cached.",
    "expert_misses": "Experts asked for that had to be fetched.",
    "fetched_experts": "Experts fetched from the upstream, verified and committed.",
    "fetched_bytes": "Bytes of experts fetched, verified and committed.",
    "coalesced_waiters": "Requests that waited for a fetch another request had started.",
    "prefetch_hints": "Prefetch hints received.",
    "commit_failed": "Verified experts whose commit to the store failed.",
    "warm_fetched_experts": "Experts fetched by `cachecd warm`.",
    "control_connections_refused": "Control connections refused at the connection limit.",
    "control_connections_dropped": "Slow control connections closed to make room.",
    "control_connections_idle_closed": "Idle control connections closed to make room.",
    "data_connections_refused": "Data path connections refused at the connection limit.",
}
# status()["upstream"]: gauges; the rest are counters, ``faults_<kind>`` labelled.
_UPSTREAM_GAUGES = {
    "in_flight": "Upstream HTTP requests under way.",
    "peak_in_flight": "Most upstream HTTP requests under way at once since start.",
    "peer_skipped": ("Peers skipped now: down (could not be reached or did not answer: "
                     "skipped a while, longer at each fault in a row), served wrong bytes or "
                     "sent too slowly (--peer)."),
    "peer_in_flight": "Requests to peers under way (--peer).",
}
_UPSTREAM_COUNTERS = {
    "requests_resolve": "Resolve (HEAD) requests sent upstream.",
    "resolves": "Files resolved to a location.",
    "requests_range": "Range GET requests sent upstream.",
    "bytes": "Bytes received in range answers.",
    "retries": "Upstream requests retried after a transient fault.",
    "requests_xet_proof": "Xet proof requests (/v2/file-chunk-hashes) sent upstream.",
    "requests_xet_reconstruction": "Xet reconstruction requests sent upstream.",
    "requests_xet_xorb": "Signed xorb range GETs sent upstream.",
    "xet_windows": "Windows read through Xet and proven against the file's Xet hash.",
    "xet_window_bytes": "Bytes of the windows proven (the ranges asked, widened to chunks).",
    "xet_range_bytes": "Bytes of the ranges asked that were handed on, proven.",
    "xet_proof_bytes": "Bytes of the proofs received.",
    "xet_xorb_bytes": "Bytes of xorb ranges received (chunks as stored, compressed or not).",
    "xet_urls_expired": "Signed xorb URLs refused (403): the reconstruction was asked again.",
    "xet_tokens_refused": "Xet tokens the content store refused (401): a new one was asked.",
    "xet_token_requests": "Xet read tokens asked of the endpoint.",
    "peer_experts": "Experts peers served that verified (--peer).",
    "peer_bytes": "Bytes of verified experts peers served (--peer).",
    "peer_lies": "Times a peer served wrong bytes (it is then skipped for a while).",
    "peer_slow": "Times a peer sent under the minimum rate (it is then skipped for a while).",
}
# status()["share"]: what --share served and refused.
_SHARE_COUNTERS = {
    "served_experts": "Experts served to peers (--share).",
    "served_bytes": "Bytes of experts served to peers (--share).",
    "connections_refused": "Share connections closed at once: the door was full of busy ones.",
    "connections_dropped": "Share connections that never showed the token, closed for a "
                           "newcomer.",
    "connections_idle_closed": "Idle share connections closed for a newcomer.",
    "connections_header_timed_out": "Share connections closed: no request head in time.",
    "connections_idle_timed_out": "Kept-alive share connections closed after their idle "
                                  "deadline.",
    "connections_body_timed_out": "Share requests whose body did not arrive in time.",
    "connections_malformed": "Share requests that could not be parsed (answered 400).",
}
_SHARE_GAUGES = {
    "connections": "Open share connections (--share).",
    "connection_limit": "Most share connections held at once (--share).",
    "requests_in_flight": "Peer requests being answered (--share).",
    "bytes_in_flight": "Bytes of experts being sent to peers (--share).",
}
# status()["scrub"]: the background re-hash.
_SCRUB_COUNTERS = {
    "blobs": "Blobs the scrub hashed.",
    "bytes": "Bytes the scrub hashed.",
    "failures": "Blobs that failed their hash in the scrub.",
    "missing": "Blobs the scrub found missing.",
    "passes": "Full scrub passes finished.",
    "yields": "Times the scrub slowed down for fetches in flight.",
}
_SCRUB_PASS = {  # key in status()["scrub"]["pass"] -> (metric suffix, HELP)
    "started": ("pass_started_timestamp_seconds", "Unix time the scrub pass under way started."),
    "blobs_total": ("pass_blobs", "Blobs in the scrub pass under way."),
    "bytes_total": ("pass_bytes", "Bytes in the scrub pass under way."),
    "blobs_done": ("pass_done_blobs", "Blobs done in the scrub pass under way."),
    "bytes_done": ("pass_done_bytes", "Bytes done in the scrub pass under way."),
    "failures": ("pass_failures", "Failures in the scrub pass under way."),
}
_SCRUB_LAST = {  # key in status()["scrub"]["last_pass"]
    "finished": ("last_pass_finished_timestamp_seconds",
                 "Unix time the last full scrub pass finished."),
    "seconds": ("last_pass_duration_seconds", "How long the last full scrub pass took."),
    "blobs": ("last_pass_blobs", "Blobs the last full scrub pass hashed."),
    "bytes": ("last_pass_bytes", "Bytes the last full scrub pass hashed."),
    "failures": ("last_pass_failures", "Failures in the last full scrub pass."),
}
_MODEL_GAUGES = {
    "experts_total": ("model_experts", "Experts in the model's manifest."),
    "expert_bytes_total": ("model_expert_bytes", "Bytes of all the model's experts."),
    "resident_bytes_total": ("model_resident_bytes", "Bytes of the model's resident tensors."),
    "experts_served": ("model_served_experts", "Experts this daemon serves (its layers)."),
    "expert_bytes_served": ("model_served_expert_bytes", "Bytes of the experts it serves."),
}
# Seconds: a hit is answered in tens of microseconds (fds, no copy), a miss waits for the Hub.
_HIT_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_MISS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Latencies:
    """The daemon's latency histograms; registered on its own registry by ``registry_for``."""

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: counters restart with the daemon
        self.hit = Histogram(
            "cachecd_hit_latency_seconds", "Seconds from a request for experts to its answer, "
            "every expert cached.", buckets=_HIT_BUCKETS, registry=None)
        self.miss = Histogram(
            "cachecd_miss_latency_seconds", "Seconds from a request for experts to its answer, "
            "some fetched from the upstream for it.", buckets=_MISS_BUCKETS, registry=None)
        self.upstream = Histogram(
            "cachecd_upstream_request_duration_seconds", "Seconds each request sent upstream "
            "took (a resolve, or a range GET with its body), by kind.", ["kind"],
            buckets=_MISS_BUCKETS, registry=None)

    def request(self, seconds: float, missed: bool) -> None:
        (self.miss if missed else self.hit).observe(seconds)

    def upstream_request(self, kind: str, seconds: float) -> None:
        self.upstream.labels(kind).observe(seconds)

    def all(self) -> tuple[Histogram, ...]:
        return self.hit, self.miss, self.upstream


def _number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bool included: running, offline are 0/1


class DaemonCollector(Collector):
    """Reads the daemon's figures at scrape time; holds nothing between scrapes."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        s = self.daemon.status()
        yield from _process(s)
        yield from _store(s["store"])
        yield from _labelled_counts(s["counters"], "cachecd_", _DAEMON_COUNTERS, {}, "fetch_error_",
                                    ("fetch_errors", "Expert fetches that failed, by error code.",
                                     "code"))
        yield from _labelled_counts(s["upstream"], "cachecd_upstream_", _UPSTREAM_COUNTERS,
                                    _UPSTREAM_GAUGES, "faults_",
                                    ("upstream_faults", "Upstream faults, by kind (each retried "
                                     "or ended in an error).", "kind"))
        if s.get("share") is not None:
            yield from _labelled_counts(s["share"], "cachecd_share_", _SHARE_COUNTERS,
                                        _SHARE_GAUGES, "refused_",
                                        ("share_refused", "Peer requests or experts refused "
                                         "(--share), by reason.", "reason"))
        yield from _scrub(s["scrub"])
        yield from _models(s["models"], s["refused_models"])


def _process(s: dict[str, Any]) -> Iterator[Metric]:
    yield InfoMetricFamily("cachecd", "The daemon's version and eviction policy.",
                           value={"version": str(s["version"]),
                                  "policy": str(s["store"].get("policy", ""))})
    yield GaugeMetricFamily("cachecd_uptime_seconds", "Seconds since the daemon started.",
                            value=s["uptime_s"])
    yield GaugeMetricFamily("cachecd_offline", "1 if offline mode (HF_HUB_OFFLINE) is on.",
                            value=int(bool(s["offline"])))
    yield GaugeMetricFamily("cachecd_inflight_fetches", "Expert fetches under way.",
                            value=s["inflight"])
    yield GaugeMetricFamily("cachecd_blob_fds", "Open blob fds the daemon keeps for hits.",
                            value=s.get("debug", {}).get("blob_fds", 0))


def _store(store: dict[str, Any]) -> Iterator[Metric]:
    uses = CounterMetricFamily("cachecd_store_policy_uses", "Uses recorded for the eviction "
                               "policy, by whether the blob was still cached then.",
                               labels=["blob"])
    for key, value in store.items():
        if key in _STORE_GAUGES:
            name, help_ = _STORE_GAUGES[key]
            yield GaugeMetricFamily(f"cachecd_store_{name}", help_, value=value)
        elif key in _POLICY_USES:
            uses.add_metric([_POLICY_USES[key]], value)
        elif _number(value):  # every other number the ledger keeps is a count since start
            name, help_ = _STORE_COUNTERS.get(key, (key, f"Store count {key!r} since start."))
            yield CounterMetricFamily(f"cachecd_store_{name}", help_, value=value)
    yield uses
    free = GaugeMetricFamily("cachecd_cache_dir_free_bytes",
                             "Free bytes on each cache dir's file system.", labels=["cache_dir"])
    for d in store.get("dirs", []):
        free.add_metric([d["path"]], d["free_bytes"])
    yield free


def _labelled_counts(
    counts: dict[str, Any],
    prefix: str,
    helps: dict[str, str],
    gauges: dict[str, str],
    labelled: str,
    family: tuple[str, str, str],
) -> Iterator[Metric]:
    """A counter per key (a gauge for ``gauges``), keys starting ``labelled`` gathered into one
    counter family with the rest of the key as its label. Known counters not yet counted are 0,
    so a series exists from the first scrape on."""
    name, help_, label = family
    by_label = CounterMetricFamily(f"cachecd_{name}", help_, labels=[label])
    for key in sorted(set(counts) | set(helps)):
        value = counts.get(key, 0)
        if key.startswith(labelled):
            by_label.add_metric([key.removeprefix(labelled)], value)
        elif key in gauges:
            yield GaugeMetricFamily(prefix + key, gauges[key], value=value)
        elif _number(value):
            yield CounterMetricFamily(prefix + key, helps.get(key, f"Count {key!r} since start."),
                                      value=value)
    yield by_label


def _scrub(scrub: dict[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily("cachecd_scrub_rate_bytes_per_second",
                            "The scrub's pace (0: off).", value=scrub["rate"])
    yield GaugeMetricFamily("cachecd_scrub_running", "1 while the scrub thread runs.",
                            value=int(bool(scrub["running"])))
    for key, help_ in _SCRUB_COUNTERS.items():
        yield CounterMetricFamily(f"cachecd_scrub_{key}", help_, value=scrub.get(key, 0))
    for section, table in (("pass", _SCRUB_PASS), ("last_pass", _SCRUB_LAST)):
        for key, (suffix, help_) in table.items():
            value = scrub.get(section, {}).get(key)
            if value is not None:
                yield GaugeMetricFamily(f"cachecd_scrub_{suffix}", help_, value=value)
    failure = scrub.get("last_failure")
    if failure is not None:
        yield GaugeMetricFamily("cachecd_scrub_last_failure_timestamp_seconds",
                                "Unix time of the scrub's last failed hash.", value=failure["at"])


def _models(models: list[dict[str, Any]], refused: dict[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily("cachecd_models_registered", "Models registered.", value=len(models))
    yield GaugeMetricFamily("cachecd_models_refused", "Manifests refused at start.",
                            value=len(refused))
    info = InfoMetricFamily("cachecd_model", "A registered model's pinned commit and format.",
                            labels=["model"])
    # Several revisions of one repo may be registered: a series per (repo, commit).
    gauges = {key: GaugeMetricFamily(f"cachecd_{name}", help_, labels=["model", "revision"])
              for key, (name, help_) in _MODEL_GAUGES.items()}
    for m in models:
        info.add_metric([m["repo"]], {"revision": m["revision"], "model_type": str(m["model_type"]),
                                      "quant_format": str(m["quant_format"])})
        for key, family in gauges.items():
            family.add_metric([m["repo"], m["revision"]], m[key])
    yield info
    yield from gauges.values()


def registry_for(daemon: Any) -> CollectorRegistry:
    """The daemon's own registry (never the global one): its figures and the process's."""
    registry = CollectorRegistry()
    registry.register(DaemonCollector(daemon))
    for histogram in daemon.latency.all():
        registry.register(histogram)
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_open_fds, ...
    return registry


# What the share's own /metrics shows a token holder (docs/sharing.md): no cache path, no model.
PEER_VISIBLE = ("cachecd_share_", "cachecd_upstream_peer_")


class _PeerVisible(Collector):
    def __init__(self, daemon: Any) -> None:
        self._all = DaemonCollector(daemon)

    def collect(self) -> Iterator[Metric]:
        return (m for m in self._all.collect() if m.name.startswith(PEER_VISIBLE))


def peer_registry_for(daemon: Any) -> CollectorRegistry:
    """The registry the share answers token holders with: its own and the peers' series only."""
    registry = CollectorRegistry()
    registry.register(_PeerVisible(daemon))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
