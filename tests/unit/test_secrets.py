"""The one way secrets are handled (``cachecd.secrets``): a token's type shows nothing, and the
scrubber takes tokens out of text whatever carried them there."""

from __future__ import annotations

import io
import logging

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from cachecd import errors
from cachecd.manifest.bounded_http import check_redirect, host_kind
from cachecd.secrets import ScrubFilter, Secret, scrub

LAN = "0123456789abcdef" * 4


def test_a_secret_shows_nothing_of_itself() -> None:
    s = Secret(LAN)
    assert LAN not in repr(s) + str(s) + f"{s} {s!r} {[s]} {({'t': s})}"
    assert s.reveal() == LAN and s == Secret(LAN) and bool(s)


def test_an_aiohttp_errors_repr_loses_its_authorization_header() -> None:
    Secret(LAN)
    headers = CIMultiDictProxy(CIMultiDict({"Authorization": f"Bearer {LAN}", "Host": "x"}))
    info = aiohttp.RequestInfo(URL("http://x/v2/blobs"), "POST", headers, URL("http://x/v2/blobs"))
    text = scrub(repr(aiohttp.ClientResponseError(info, (), status=503, message="busy")))
    assert LAN not in text and "status=503" in text and "'Host': 'x'" in text


@pytest.mark.parametrize(("text", "gone"), [
    ("Authorization: Bearer abcdefghijklmnop1234", "abcdefghijklmnop1234"),
    ("{'cookie': 'session=s3cr3tvalue'}", "s3cr3tvalue"),
    ("GET https://cdn/x?Expires=1&Signature=abc%2Fdef&Key-Pair-Id=K2AB&Policy=eyJwb2x", "abc%2Fdef"),
    ("https://s3/x?X-Amz-Credential=AKIA/2024&X-Amz-Signature=deadbeef99", "deadbeef99"),
    ("https://h/x?a=1&token=tok123456", "tok123456"),
    ("hf_" + "Ab1" * 11 + " at start", "Ab1Ab1Ab1"),
    ("proxy http://user:pa55word@proxy:3128", "pa55word"),
])
def test_the_scrubber_removes_what_a_token_looks_like(text: str, gone: str) -> None:
    assert gone not in scrub(text)


def test_prose_about_tokens_stays_readable() -> None:
    line = "share_token_file: /x/t is readable by its group (mode 640); `chmod 600 /x/t`"
    assert scrub(line) == line


def test_every_error_message_is_scrubbed() -> None:
    Secret(LAN)
    err = errors.Internal(f"upstream failed: headers={{'Authorization': 'Bearer {LAN}'}} {LAN}")
    assert LAN not in err.message + str(err) + str(err.to_wire())


def test_the_log_filter_scrubs_messages_arguments_and_tracebacks() -> None:
    Secret(LAN)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(ScrubFilter())
    log = logging.getLogger("test_secrets")
    log.addHandler(handler)
    try:
        log.warning("peer err=%r", {"Authorization": f"Bearer {LAN}"})
        try:
            raise RuntimeError(f"failed with {LAN}")
        except RuntimeError:
            log.exception("boom")
    finally:
        log.removeHandler(handler)
    assert LAN not in out.getvalue() and "RuntimeError: failed with ***" in out.getvalue()


@pytest.mark.parametrize(("endpoint", "target", "ok"), [
    ("https://huggingface.co", "https://cas-bridge.xethub.hf.co/x?sig=1", True),
    ("https://huggingface.co", "file:///etc/passwd", False),
    ("https://huggingface.co", "http://169.254.169.254/latest/meta-data/", False),
    ("https://huggingface.co", "http://127.0.0.1:8080/x", False),
    ("https://huggingface.co", "http://[::ffff:127.0.0.1]/x", False),
    ("https://huggingface.co", "http://localhost/x", False),
    ("http://127.0.0.1:7000", "http://127.0.0.1:7001/_cdn/x", True),
    ("http://127.0.0.1:7000", "http://169.254.169.254/", False),
    ("http://169.254.10.1:7000", "http://169.254.10.1:7000/_cdn/x", True),
])
def test_a_redirect_goes_only_to_the_web_or_from_a_local_endpoint_to_local(
        endpoint: str, target: str, ok: bool) -> None:
    if ok:
        assert check_redirect(endpoint, target, "resolve x") == target
    else:
        with pytest.raises(errors.RedirectRefused) as info:
            check_redirect(endpoint, target, "resolve x")
        assert "resolve x" in info.value.message


def test_host_kinds() -> None:
    assert [host_kind(h) for h in ("127.0.0.2", "::1", "fe80::1", "10.0.0.1", "hf.co")] == [
        "loopback", "loopback", "link-local", "", ""]
