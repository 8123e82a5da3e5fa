"""The daemon and the user's environment: the proxy it names, a token set after the daemon started.

Each test starts `cachecd serve` with the environment it is about (and every proxy variable of
the test's own environment blanked, so a CI's ``no_proxy=localhost,127.0.0.1`` decides nothing).
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from cachecd.errors import Unauthorized
from tests.fakes.forward_proxy import ForwardProxy
from tests.harness import (
    TINY_REPO,
    DaemonProcess,
    HubProcess,
    expert_bytes_from_files,
    short_tmp,
)


def _proxy_env(**values: str) -> dict[str, str]:
    """Every proxy variable in both cases: blank, or ``values[name]`` (urllib lets an empty
    lowercase one cancel its uppercase twin, so both are set alike)."""
    env = {}
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        env[name] = env[name.upper()] = values.get(name, "")
    return env


def _fetch_checked(d: DaemonProcess, manifest: Any, tiny_dir: Any, ids: list[int]) -> None:
    layer = manifest.moe_layers[0]
    with d.client() as c:
        got = c.experts(TINY_REPO, layer, ids)
    for e, arr in zip(ids, got, strict=True):
        assert arr.tobytes() == expert_bytes_from_files(tiny_dir, manifest.expert(layer, e))


def _hub_requests(proxy: ForwardProxy, hub_url: str) -> list[tuple[str, str]]:
    """What went through the proxy to the hub: resolves (HEAD), range GETs of its CDN, and its
    Xet content store's requests (the hub keeps the shards in Xet)."""
    return [(m, u) for m, u in proxy.requests
            if u.startswith(hub_url) and any(p in u for p in ("/resolve/", "/_cdn/", "/_xet/",
                                                                "/_xorb/"))]


def test_expert_fetches_go_through_the_environments_proxy(
    hub, tiny_manifest_path, tiny_manifest, tiny_dir
) -> None:
    with ForwardProxy() as proxy:
        d = DaemonProcess(hub.url, [tiny_manifest_path], env=_proxy_env(http_proxy=proxy.url))
        try:
            d.start()
            _fetch_checked(d, tiny_manifest, tiny_dir, [0, 5])
            with d.client() as c:
                counters = c.stats()["counters"]
        finally:
            d.cleanup()
        through = _hub_requests(proxy, hub.url)
        print("through the proxy:", *proxy.requests, sep="\n  ")
    assert counters["fetched_experts"] == 2
    assert any(m == "HEAD" and "/resolve/" in u for m, u in through), proxy.requests
    assert any(m == "GET" and "/_xorb/" in u for m, u in through), proxy.requests


def test_no_proxy_names_hosts_that_bypass_it(
    hub, tiny_manifest_path, tiny_manifest, tiny_dir
) -> None:
    with ForwardProxy() as proxy:
        env = _proxy_env(http_proxy=proxy.url, no_proxy="localhost,127.0.0.1")
        d = DaemonProcess(hub.url, [tiny_manifest_path], env=env)
        try:
            d.start()
            _fetch_checked(d, tiny_manifest, tiny_dir, [1])
        finally:
            d.cleanup()
        assert _hub_requests(proxy, hub.url) == []


def test_a_login_after_start_counts_without_a_restart(
    hub_root, tiny_manifest_path, tiny_manifest, tiny_dir
) -> None:
    token = "hf_" + "Lg9" * 12
    private = HubProcess(hub_root, token=token)  # every request but the signed CDN's needs it
    home = short_tmp("cdtok")
    token_file = home / "token"  # does not exist yet: nobody is logged in
    env = {"HF_TOKEN": "", "HUGGING_FACE_HUB_TOKEN": "", "HF_TOKEN_PATH": str(token_file),
           **_proxy_env()}
    d = DaemonProcess(private.url, [tiny_manifest_path], env=env)
    try:
        d.start()
        with d.client() as c:
            pid = c.health()["pid"]
        with d.client() as c, pytest.raises(Unauthorized, match="hf auth login"):
            c.experts(TINY_REPO, tiny_manifest.moe_layers[0], [2])
        token_file.write_text(token + "\n")  # what `hf auth login` writes
        _fetch_checked(d, tiny_manifest, tiny_dir, [2, 3])
        with d.client() as c:
            assert c.health()["pid"] == pid  # the same daemon, not restarted
        assert token not in d.log()
    finally:
        d.cleanup()
        private.stop()
        shutil.rmtree(home, ignore_errors=True)
