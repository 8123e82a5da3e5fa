"""`cachecd hub serve` as a subprocess, driven over real HTTP by unmodified huggingface_hub."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest
from huggingface_hub import (
    HfApi,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from cachecd.lanhub.repo import valid_relpath
from cachecd.lanhub.server import HashCache, repo_commit, serve_in_thread, spawn_hub

REPO = "acme/tiny"
TOKEN = "hub-test-token-123"
BIG = 5 * 1024 * 1024 + 123  # not a multiple of any chunk size


def _write_repo(repo: Path) -> None:
    rng = np.random.default_rng(7)
    repo.mkdir(parents=True)
    save_file(
        {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": np.arange(8, dtype=np.int64)},
        str(repo / "model.safetensors"),
    )
    (repo / "config.json").write_text(json.dumps({"model_type": "tiny", "hidden": 8}))
    (repo / "big.bin").write_bytes(rng.bytes(BIG))
    (repo / "sub" / "deeper").mkdir(parents=True)
    (repo / "sub" / "notes.txt").write_text("a file in a subfolder\n")
    (repo / "sub" / "deeper" / "x y.txt").write_text("space in the name\n")
    (repo / "sub" / "odd #1 ü+%?.txt").write_text("a name that needs quoting\n")
    (repo / "pair.bin").write_bytes(b"plain bytes " * 100)
    (repo / "pair.bin.gz").write_bytes(b"not the gzip of pair.bin")
    (repo / "link-inside.bin").symlink_to("pair.bin")
    # None of these belong to the repo: outside it, git's folder, hf's local-dir bookkeeping.
    (repo / "escape").symlink_to("/etc/passwd")
    (repo / ".git").mkdir()
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".cache" / "huggingface").mkdir(parents=True)
    (repo / ".cache" / "huggingface" / "x.metadata").write_text("x")


EXPECTED = {
    "model.safetensors",
    "config.json",
    "big.bin",
    "sub/notes.txt",
    "sub/deeper/x y.txt",
    "sub/odd #1 ü+%?.txt",
    "pair.bin",
    "pair.bin.gz",
    "link-inside.bin",
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hubroot")
    _write_repo(root / REPO)
    return root


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.terminate()
    return proc.wait(timeout=30)


@pytest.fixture(scope="module")
def hub(root: Path) -> Iterator[str]:
    proc, url = spawn_hub(root, verbose=True)
    yield url
    assert _stop(proc) == 0


@pytest.fixture(scope="module")
def token_hub(root: Path) -> Iterator[str]:
    proc, url = spawn_hub(root, token=TOKEN)
    yield url
    assert _stop(proc) == 0


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _request(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, path: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One raw request; ``path`` goes on the wire exactly as given (no normalisation)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    target = path if path is not None else parts.path + (f"?{parts.query}" if parts.query else "")
    conn.request(method, target, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def _cdn_url(hub: str, filename: str, headers: dict[str, str] | None = None) -> str:
    status, head, _ = _request(f"{hub}/{REPO}/resolve/main/{filename}", "HEAD", headers)
    assert status == 302, status
    assert head["location"].startswith(hub + "/"), "Location must be absolute on this server"
    return head["location"]


# ---------------------------------------------------------------- commit


def test_repo_commit_follows_the_documented_algorithm(root: Path) -> None:
    repo = root / REPO
    digest = hashlib.sha1()
    for rel in sorted(EXPECTED):
        digest.update(f"{rel}\0{_sha256(repo / rel)}\n".encode())
    assert repo_commit(repo) == digest.hexdigest()


def test_commit_is_stable_across_restarts_and_changes_with_content(tmp_path: Path) -> None:
    repo = tmp_path / "r" / "acme" / "mutable"
    repo.mkdir(parents=True)
    (repo / "a.bin").write_bytes(b"a" * 1000)
    (repo / "b.txt").write_text("b")
    commits = []
    for _ in range(2):
        proc, url = spawn_hub(tmp_path / "r")
        commits.append(HfApi(endpoint=url).model_info("acme/mutable").sha)
        assert _stop(proc) == 0
    assert commits[0] == commits[1] == repo_commit(repo)

    proc, url = spawn_hub(tmp_path / "r")
    try:
        status, head, _ = _request(f"{url}/acme/mutable/resolve/main/a.bin", "HEAD")
        signed = head["location"]
        assert _request(signed, "GET")[0] == 200
        untouched = _request(f"{url}/acme/mutable/resolve/main/b.txt", "HEAD")[1]["location"]
        (repo / "a.bin").write_bytes(b"A" + b"a" * 999)  # same size, new bytes
        changed = HfApi(endpoint=url).model_info("acme/mutable").sha
        assert changed not in commits and changed == repo_commit(repo)
        # The URL signed for the old commit stops serving: its bytes are gone.
        status, head, _ = _request(signed, "GET")
        assert status == 404 and head["x-error-code"] == "RevisionNotFound"
        # A signed URL names content: an untouched file keeps serving the bytes it was signed for.
        assert _request(untouched, "GET")[2] == b"b"
        with pytest.raises(RevisionNotFoundError):
            HfApi(endpoint=url).model_info("acme/mutable", revision=commits[0])
        assert HfApi(endpoint=url).model_info("acme/mutable", revision=changed).sha == changed
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_in_process_restart_does_not_hash_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repo = tmp_path / "acme" / "again"
    repo.mkdir(parents=True)
    for i in range(3):
        (repo / f"f{i}.bin").write_bytes(bytes([i]) * 1000)
    commits = []
    with caplog.at_level(logging.DEBUG, logger="cachecd.lanhub.repo"):
        for _ in range(2):
            with serve_in_thread(tmp_path) as url:
                commits.append(HfApi(endpoint=url).model_info("acme/again").sha)
    hashed = [r for r in caplog.records if r.getMessage().startswith("hashed ")]
    assert len(hashed) == 3 and commits[0] == commits[1]


# ---------------------------------------------------------------- huggingface_hub end to end


def test_file_metadata_gives_commit_sha256_and_size(hub: str, root: Path) -> None:
    meta = get_hf_file_metadata(hf_hub_url(REPO, "big.bin", endpoint=hub))
    assert meta.commit_hash == repo_commit(root / REPO)
    assert meta.etag == _sha256(root / REPO / "big.bin")
    assert meta.size == BIG
    assert meta.location.startswith(hub + "/_cdn/")


def test_resolve_302_carries_hub_headers(hub: str, root: Path) -> None:
    for method in ("HEAD", "GET"):
        # An LFS file (*.safetensors, as the Hub's default .gitattributes says): its sha256.
        status, head, _ = _request(f"{hub}/{REPO}/resolve/main/model.safetensors", method)
        sha = _sha256(root / REPO / "model.safetensors")
        assert status == 302
        assert head["x-repo-commit"] == repo_commit(root / REPO)
        assert head["etag"] == head["x-linked-etag"] == f'"{sha}"'
        assert head["x-linked-size"] == str((root / REPO / "model.safetensors").stat().st_size)
        # A small plain file is a git blob on the Hub: its blob id, no X-Linked headers.
        status, head, _ = _request(f"{hub}/{REPO}/resolve/main/config.json", method)
        data = (root / REPO / "config.json").read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        assert status == 302 and head["etag"] == f'"{blob}"' and "x-linked-etag" not in head


def test_hf_hub_download_is_byte_identical(hub: str, root: Path, tmp_path: Path) -> None:
    commit = repo_commit(root / REPO)
    for name in ("big.bin", "sub/deeper/x y.txt", "sub/odd #1 ü+%?.txt", "model.safetensors"):
        for rev in ("main", commit):
            got = hf_hub_download(
                REPO, name, revision=rev, endpoint=hub, cache_dir=tmp_path / rev[:4]
            )
            assert Path(got).read_bytes() == (root / REPO / name).read_bytes()


def test_snapshot_download_is_byte_identical(hub: str, root: Path, tmp_path: Path) -> None:
    out = Path(snapshot_download(REPO, endpoint=hub, cache_dir=tmp_path))
    assert out.name == repo_commit(root / REPO)
    got = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert got == EXPECTED
    for rel in EXPECTED:
        assert (out / rel).read_bytes() == (root / REPO / rel).read_bytes(), rel


def test_model_info_and_tree_parse_in_hf_api(hub: str, root: Path) -> None:
    api = HfApi(endpoint=hub)
    info = api.model_info(REPO)
    assert info.id == REPO and info.sha == repo_commit(root / REPO)
    assert info.last_modified is not None
    siblings = {s.rfilename: s for s in info.siblings or []}
    assert set(siblings) == EXPECTED
    big = siblings["big.bin"]
    assert big.size == BIG and big.lfs is not None
    assert big.lfs.sha256 == _sha256(root / REPO / "big.bin") and big.lfs.size == BIG

    tree = list(api.list_repo_tree(REPO, recursive=True))
    files = {e.path: e for e in tree if isinstance(e, RepoFile)}
    folders = {e.path for e in tree if isinstance(e, RepoFolder)}
    assert set(files) == EXPECTED and folders == {"sub", "sub/deeper"}
    assert files["model.safetensors"].lfs is not None
    assert files["model.safetensors"].lfs.sha256 == _sha256(root / REPO / "model.safetensors")
    assert files["config.json"].lfs is None and siblings["config.json"].lfs is None

    top = {(type(e).__name__, e.path) for e in api.list_repo_tree(REPO)}
    assert ("RepoFolder", "sub") in top and ("RepoFile", "big.bin") in top
    assert not any("/" in path for _, path in top)
    sub = {e.path for e in api.list_repo_tree(REPO, path_in_repo="sub")}
    assert sub == {"sub/notes.txt", "sub/deeper", "sub/odd #1 ü+%?.txt"}
    deep = {e.path for e in api.list_repo_tree(REPO, path_in_repo="sub", recursive=True)}
    assert deep == {"sub/notes.txt", "sub/deeper", "sub/deeper/x y.txt", "sub/odd #1 ü+%?.txt"}


def test_api_routes_accept_trailing_slash(hub: str, root: Path) -> None:
    commit = repo_commit(root / REPO)
    for path in (
        f"/api/models/{REPO}/revision/main/",
        f"/api/models/{REPO}/revision/{commit}",
        f"/api/models/{REPO}/",
    ):
        status, _, body = _request(hub, path=path)
        assert status == 200, path
        assert json.loads(body)["sha"] == commit
    status, _, body = _request(hub, path=f"/api/models/{REPO}/tree/main/?recursive=true")
    assert status == 200 and {e["path"] for e in json.loads(body)} >= EXPECTED


def test_unknown_repo_file_and_revision_raise_hf_error_types(hub: str, tmp_path: Path) -> None:
    api = HfApi(endpoint=hub)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("acme/nope")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/nope", "config.json", endpoint=hub, cache_dir=tmp_path)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "missing.bin", endpoint=hub, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="v9", endpoint=hub, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="0" * 40)
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(REPO, path_in_repo="nowhere"))
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(REPO, path_in_repo="config.json"))


def test_a_folder_per_revision_serves_each_by_branch_and_commit(tmp_path: Path) -> None:
    """``ORG/NAME`` is main, ``ORG/NAME@v2`` the branch v2: unmodified huggingface_hub resolves
    each by name and by commit, downloads each one's own bytes, and is told which exist."""
    _write_repo(tmp_path / REPO)
    shutil.copytree(tmp_path / REPO, tmp_path / f"{REPO}@v2")
    (tmp_path / f"{REPO}@v2" / "config.json").write_text(json.dumps({"model_type": "tiny2"}))
    with serve_in_thread(tmp_path) as url:
        api = HfApi(endpoint=url)
        main, v2 = api.model_info(REPO).sha, api.model_info(REPO, revision="v2").sha
        assert main == repo_commit(tmp_path / REPO) and v2 == repo_commit(tmp_path / f"{REPO}@v2")
        assert main != v2 and api.model_info(REPO, revision=v2).sha == v2
        for rev, folder in (("main", REPO), ("v2", f"{REPO}@v2"), (v2, f"{REPO}@v2"),
                            (main, REPO)):
            got = hf_hub_download(REPO, "config.json", revision=rev, endpoint=url,
                                  cache_dir=tmp_path / "hf")
            assert Path(got).read_bytes() == (tmp_path / folder / "config.json").read_bytes()
        assert {f.path for f in api.list_repo_tree(REPO, revision="v2")} >= {"config.json"}
        with pytest.raises(RevisionNotFoundError, match="main, v2"):
            api.model_info(REPO, revision="v3")
        status, _, _ = _request(f"{url}/api/models/{REPO}@v2")  # no repo of its own
        assert status == 404


# ---------------------------------------------------------------- ranges on the CDN URL


def test_ranges_are_exact(hub: str, root: Path) -> None:
    data = (root / REPO / "big.bin").read_bytes()
    url = _cdn_url(hub, "big.bin")
    cases = [
        ("bytes=0-0", 0, 0),
        ("bytes=10-19", 10, 19),
        (f"bytes={BIG - 7}-", BIG - 7, BIG - 1),
        (f"bytes=100-{BIG + 500}", 100, BIG - 1),  # an end past EOF is clipped (RFC 9110)
        ("bytes=-5", BIG - 5, BIG - 1),
    ]
    for header, first, last in cases:
        status, head, body = _request(url, headers={"Range": header})
        assert status == 206, header
        assert head["content-range"] == f"bytes {first}-{last}/{BIG}", header
        assert body == data[first : last + 1], header
        assert head["accept-ranges"] == "bytes"
    status, head, body = _request(url)
    assert status == 200 and body == data and head["content-length"] == str(BIG)
    status, head, body = _request(url, "HEAD", {"Range": "bytes=5-9"})
    assert status == 206 and head["content-length"] == "5" and body == b""
    for header in (f"bytes={BIG}-", f"bytes={BIG + 10}-{BIG + 20}", "bytes=-0", "bytes=9-3"):
        status, head, _ = _request(url, headers={"Range": header})
        assert status == 416, header
        assert head["content-range"] == f"bytes */{BIG}", header


def test_parallel_ranges_stay_exact(hub: str, root: Path) -> None:
    data = (root / REPO / "big.bin").read_bytes()
    url = _cdn_url(hub, "big.bin")
    rnd = random.Random(3)
    spans = [(s, min(BIG - 1, s + rnd.randrange(1, 1 << 20))) for s in rnd.sample(range(BIG), 24)]
    failures: list[str] = []

    def fetch(first: int, last: int) -> None:
        status, head, body = _request(url, headers={"Range": f"bytes={first}-{last}"})
        if status != 206 or body != data[first : last + 1]:
            failures.append(f"{first}-{last}: {status} {head.get('content-range')}")

    threads = [threading.Thread(target=fetch, args=span) for span in spans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures


def test_cdn_never_swaps_in_a_compressed_sibling(hub: str, root: Path) -> None:
    url = _cdn_url(hub, "pair.bin")
    status, head, body = _request(url, headers={"Accept-Encoding": "gzip, br"})
    assert status == 200 and body == (root / REPO / "pair.bin").read_bytes()
    assert "content-encoding" not in head


def test_large_offsets_past_4_gib(tmp_path: Path) -> None:
    """In-process, with the sparse file's sha256 seeded: hashing 4 GiB would dominate the suite."""
    repo = tmp_path / "r" / "acme" / "huge"
    repo.mkdir(parents=True)
    size = (4 << 30) + 4096
    with open(repo / "sparse.bin", "wb") as fh:  # sparse: no disk used for the hole
        fh.seek(size - 8)
        fh.write(b"THE-END!")
    st = (repo / "sparse.bin").stat()
    hashes = HashCache()
    hashes.seed((repo / "sparse.bin").resolve(), st.st_size, st.st_mtime_ns, "ab" * 32)
    # The LFS route only: Xet would chunk the 4 GiB once first (about half a minute here).
    with serve_in_thread(tmp_path / "r", hashes=hashes, xet=False) as url:
        status, head, _ = _request(f"{url}/acme/huge/resolve/main/sparse.bin", "HEAD")
        assert head["x-linked-size"] == str(size) and head["x-linked-etag"] == f'"{"ab" * 32}"'
        signed = head["location"]
        status, head, body = _request(signed, headers={"Range": f"bytes={size - 12}-"})
        assert status == 206 and body == b"\0\0\0\0THE-END!"
        assert head["content-range"] == f"bytes {size - 12}-{size - 1}/{size}"
        first = (4 << 30) + 1
        status, head, body = _request(signed, headers={"Range": f"bytes={first}-{first + 2}"})
        assert status == 206 and body == b"\0\0\0"
        assert head["content-range"] == f"bytes {first}-{first + 2}/{size}"


# ---------------------------------------------------------------- signatures and tokens


def test_signed_url_rejects_tampering_and_expiry(hub: str, root: Path, tmp_path: Path) -> None:
    url = _cdn_url(hub, "config.json")
    base, query = url.split("?")
    params = dict(p.split("=") for p in query.split("&"))
    bad_sig = f"{base}?expires={params['expires']}&sig={'0' * 64}"
    longer = f"{base}?expires={int(params['expires']) + 1}&sig={params['sig']}"
    other_file = url.replace("config.json", "big.bin")
    for bad in (bad_sig, longer, other_file, base):
        assert _request(bad)[0] == 403, bad
    assert _request(url)[0] == 200

    proc, short = spawn_hub(root, extra_args=["--url-ttl", "-1"])
    try:
        assert _request(_cdn_url(short, "config.json"))[0] == 403
    finally:
        assert _stop(proc) == 0


def test_token_required_outside_the_cdn(token_hub: str, root: Path, tmp_path: Path) -> None:
    for path in (f"/api/models/{REPO}", f"/{REPO}/resolve/main/config.json"):
        status, head, _ = _request(token_hub, path=path)
        assert status == 401 and head["x-error-code"] == "GatedRepo"
        assert _request(token_hub, path=path, headers={"Authorization": "Bearer nope"})[0] == 401
    with pytest.raises(GatedRepoError):
        hf_hub_download(REPO, "config.json", endpoint=token_hub, cache_dir=tmp_path, token=False)
    with pytest.raises(HfHubHTTPError) as info:
        hf_hub_download(REPO, "config.json", endpoint=token_hub, cache_dir=tmp_path, token="nope")
    assert info.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError):
        HfApi(endpoint=token_hub, token="nope").model_info(REPO)

    got = hf_hub_download(REPO, "big.bin", endpoint=token_hub, cache_dir=tmp_path, token=TOKEN)
    assert Path(got).read_bytes() == (root / REPO / "big.bin").read_bytes()
    # The signed location works without any token, like a real CDN.
    url = _cdn_url(token_hub, "config.json", {"Authorization": f"Bearer {TOKEN}"})
    assert _request(url)[0] == 200


# ---------------------------------------------------------------- path safety


@pytest.mark.parametrize(
    "path",
    [
        f"/{REPO}/resolve/main/../../../../etc/passwd",
        f"/{REPO}/resolve/main/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        f"/{REPO}/resolve/main/sub/..%2f..%2fconfig.json",
        f"/{REPO}/resolve/main//etc/passwd",
        f"/{REPO}/resolve/main/sub%5c..%5cconfig.json",
        f"/{REPO}/resolve/main/config.json%00.txt",
        f"/{REPO}/resolve/main/escape",
        f"/{REPO}/resolve/main/.git/HEAD",
        f"/{REPO}/resolve/main/.cache/huggingface/x.metadata",
        "/acme/..%2f..%2fetc/resolve/main/passwd",
        "/../../etc/resolve/main/passwd",
        f"/api/models/{REPO}/tree/main/..%2f..",
        "/api/models/acme/%2e%2e/revision/main",
    ],
)
def test_traversal_is_refused(hub: str, path: str) -> None:
    status, _, body = _request(hub, path=path)
    assert status in (400, 403, 404), (path, status)
    assert b"root:" not in body


def test_cli_subprocess_env_endpoint_snapshot(hub: str, root: Path, tmp_path: Path) -> None:
    """HF_ENDPOINT read at import time by an untouched huggingface_hub in a fresh process."""
    script = textwrap.dedent(
        """
        import sys
        from huggingface_hub import snapshot_download
        print(snapshot_download(sys.argv[1]))
        """
    )
    env = {**os.environ, "HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": ""}
    env.pop("HF_HUB_OFFLINE", None)
    out = subprocess.run(
        [sys.executable, "-c", script, REPO],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    snap = Path(out.stdout.strip().splitlines()[-1])
    for rel in EXPECTED:
        assert (snap / rel).read_bytes() == (root / REPO / rel).read_bytes()


def test_mlx_lm_loads_a_snapshot_downloaded_through_the_hub(tmp_path: Path) -> None:
    tiny_model = pytest.importorskip("cachecd.testbed.tiny_model")
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.utils import load_model

    src = tiny_model.write_tiny_model(tmp_path / "root" / "acme" / "tiny-k3")
    proc, url = spawn_hub(tmp_path / "root")
    try:
        snap = Path(snapshot_download("acme/tiny-k3", endpoint=url, cache_dir=tmp_path / "hf"))
    finally:
        assert _stop(proc) == 0
    for f in src.iterdir():
        assert (snap / f.name).read_bytes() == f.read_bytes(), f.name
    tokens = mx.array([[1, 5, 9, 42, 7]])
    model, _ = load_model(snap, strict=True)
    resident, _ = load_model(src, strict=True)
    got, want = model(tokens), resident(tokens)
    assert mx.isfinite(got).all().item()
    assert mx.array_equal(got, want).item()
    shutil.rmtree(tmp_path / "hf")


_SEGMENTS = [
    "..",
    ".",
    "",
    "%2e%2e",
    "%2E%2e",
    "..%2f",
    "%2f",
    "%5c",
    "%00",
    "~",
    "etc",
    "passwd",
    "sub",
    "notes.txt",
    "config.json",
    "escape",
    ".git",
    "HEAD",
    ".cache",
    "link-inside.bin",
]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(parts=st.lists(st.sampled_from(_SEGMENTS), min_size=1, max_size=6))
def test_fuzzed_paths_resolve_only_to_listed_files(hub: str, parts: list[str]) -> None:
    status, head, _ = _request(hub, "HEAD", path=f"/{REPO}/resolve/main/" + "/".join(parts))
    assert status in (302, 400, 404), (parts, status)
    if status == 302:
        served = unquote(urlsplit(head["location"]).path).split("/", 5)[5]
        assert served in EXPECTED, (parts, served)


@given(path=st.text(alphabet="./\\\0a%", max_size=12))
def test_valid_relpath_never_leaves_its_root(path: str) -> None:
    if valid_relpath(path):
        joined = os.path.normpath(os.path.join("/r", path))
        assert joined.startswith("/r/") and "\\" not in path and "\0" not in path
