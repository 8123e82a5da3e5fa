"""Scenario 16: secret hygiene. Every daemon of this suite runs with a token-shaped HF_TOKEN and
DEBUG logs, and every log and error body is grepped for ``hf_[A-Za-z0-9]{30,}`` (the pool does it
at teardown; ``all.secrets_found`` is the suite-wide count). Here: the token goes to /resolve
only, never to the CDN URL; a refused token (401) does not echo it; /v1/status and /metrics do
not show it."""

from __future__ import annotations

import pytest

from cachecd.errors import Unauthorized
from tests.faults.figures import FIGURES
from tests.faults.support import FAKE_TOKEN, SECRET_RE, Model, fetch_verified, http_request


def test_token_only_to_resolve_and_never_echoed(small: Model, pool) -> None:  # type: ignore[no-untyped-def]
    hub = pool.hub(small)
    hub.faults.require_token = FAKE_TOKEN
    d = pool.daemon(hub, [small])
    first, second = small.entry(small.layers[0], 0), small.entry(small.layers[-1], 31)
    assert first.ranges[0].file != second.ranges[0].file
    with d.client() as c:
        fetch_verified(c, small, first.layer, [first.expert])
        hub.faults.require_token = "hf_" + "Other" * 7  # the daemon's token is now refused
        with pytest.raises(Unauthorized) as info:
            fetch_verified(c, small, second.layer, [second.expert])
    assert not SECRET_RE.search(info.value.message)
    auth = [(r.kind, r.headers.get("Authorization")) for r in hub.records]
    assert ("resolve_head", f"Bearer {FAKE_TOKEN}") in auth
    assert all(a is None for kind, a in auth if kind.startswith("cdn")), auth
    FIGURES.set("s16.cdn_requests_with_a_token", sum(1 for k, a in auth if k.startswith("cdn") and a))
    for path in ("/v1/status", "/metrics", "/v1/models"):
        _, _, body = http_request(d.socket, "GET", path)
        found = SECRET_RE.findall(body.decode("utf-8", "replace"))
        FIGURES.add("all.secrets_found", len(found))
        assert not found, path
    FIGURES.setting("s16.token_in_env",
                    f"hf_ + {len(FAKE_TOKEN) - 3} chars, DEBUG logs, every daemon of the suite")
