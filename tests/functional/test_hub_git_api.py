"""`cachecd hub serve` answers the git-side calls of unmodified huggingface_hub as the Hub does:
list_repo_refs, list_repo_commits, get_paths_info, list_repo_tree(expand=True), /raw/, a small
plain file as a git blob (sha1 ETag), If-None-Match -> 304, a unique commit prefix."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import RevisionNotFoundError
from huggingface_hub.hf_api import RepoFile, RepoFolder
from huggingface_hub.utils import get_session

from tests.harness import HubProcess, short_tmp

REPO = "acme/git-api"


def _blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[HubProcess, Path]]:
    root = short_tmp("cdgit")
    repo = root / REPO
    (repo / "sub").mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    (repo / "weights.safetensors").write_bytes(b"\x01" * 4096)
    (repo / "sub" / "notes.txt").write_text("notes\n")
    for i in range(60):  # more than one page of an expanded listing (50)
        (repo / "sub" / f"f{i:02d}.txt").write_text(f"file {i}\n")
    other = root / (REPO + "@v2")
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"model_type": "tiny", "v": 2}))
    hub = HubProcess(root)
    yield hub, root
    hub.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_refs_and_commits_name_each_revision_folder(served: tuple[HubProcess, Path]) -> None:
    hub, _ = served
    api = HfApi(endpoint=hub.url)
    main, v2 = api.model_info(REPO).sha, api.model_info(REPO, revision="v2").sha
    refs = api.list_repo_refs(REPO, include_pull_requests=True)
    assert {(b.name, b.ref, b.target_commit) for b in refs.branches} == {
        ("main", "refs/heads/main", main), ("v2", "refs/heads/v2", v2)}
    assert refs.tags == [] and refs.converts == [] and refs.pull_requests == []
    commits = api.list_repo_commits(REPO, revision="v2", formatted=True)
    assert [c.commit_id for c in commits] == [v2]
    assert commits[0].authors == ["acme"] and commits[0].formatted_title is not None
    assert [c.commit_id for c in api.list_repo_commits(REPO)] == [main]
    with pytest.raises(RevisionNotFoundError):
        api.list_repo_commits(REPO, revision="nope")


def test_a_unique_commit_prefix_resolves(served: tuple[HubProcess, Path]) -> None:
    hub, root = served
    api = HfApi(endpoint=hub.url)
    v2 = api.model_info(REPO, revision="v2").sha
    assert api.model_info(REPO, revision=v2[:10]).sha == v2
    got = hf_hub_download(REPO, "config.json", revision=v2[:8], endpoint=hub.url,
                          cache_dir=root.parent / (root.name + "-cache"))
    assert Path(got).read_bytes() == (root / (REPO + "@v2") / "config.json").read_bytes()


def test_paths_info_and_expanded_tree(served: tuple[HubProcess, Path]) -> None:
    hub, root = served
    api = HfApi(endpoint=hub.url)
    main = api.model_info(REPO).sha
    info = api.get_paths_info(REPO, ["config.json", "sub", "missing.txt", "weights.safetensors"],
                              expand=True)
    by_path = {e.path: e for e in info}
    assert set(by_path) == {"config.json", "sub", "weights.safetensors"}
    config = by_path["config.json"]
    assert isinstance(config, RepoFile) and config.lfs is None
    assert config.blob_id == _blob((root / REPO / "config.json").read_bytes())
    assert config.last_commit is not None and config.last_commit["oid"] == main
    assert config.security is not None and config.security["safe"] is False
    weights = by_path["weights.safetensors"]
    assert isinstance(weights, RepoFile) and weights.lfs is not None
    assert weights.lfs["sha256"] == hashlib.sha256(b"\x01" * 4096).hexdigest()
    assert isinstance(by_path["sub"], RepoFolder)
    plain = api.get_paths_info(REPO, ["config.json"])
    assert plain[0].last_commit is None and plain[0].security is None

    tree = list(api.list_repo_tree(REPO, "sub", expand=True))
    assert len(tree) == 61  # paged: 50 per page expanded
    assert all(e.last_commit is not None and e.last_commit["oid"] == main for e in tree)
    assert all(e.last_commit is None for e in api.list_repo_tree(REPO, "sub"))


def test_plain_files_are_git_blobs_raw_and_not_modified(served: tuple[HubProcess, Path]) -> None:
    hub, root = served
    data = (root / REPO / "config.json").read_bytes()
    meta = get_hf_file_metadata(hf_hub_url(REPO, "config.json", endpoint=hub.url))
    assert meta.etag == _blob(data) and meta.size == len(data)
    http = get_session()
    raw = http.get(f"{hub.url}/{REPO}/raw/main/config.json")
    assert raw.status_code == 200 and raw.content == data
    assert raw.headers["ETag"] == f'"{_blob(data)}"'
    pointer = http.get(f"{hub.url}/{REPO}/raw/main/weights.safetensors").text
    assert pointer.startswith("version https://git-lfs.github.com/spec/v1\noid sha256:")
    for path, etag in (("config.json", _blob(data)),
                       ("weights.safetensors", hashlib.sha256(b"\x01" * 4096).hexdigest())):
        url = hf_hub_url(REPO, path, endpoint=hub.url)
        head = http.head(url, headers={"If-None-Match": f'"{etag}"'}, follow_redirects=False)
        assert head.status_code == 304, (path, head.status_code)
        assert head.headers["ETag"] == f'"{etag}"' and head.headers["X-Repo-Commit"]
        other = http.head(url, headers={"If-None-Match": '"0000"'}, follow_redirects=False)
        assert other.status_code == 302
    raw304 = http.get(f"{hub.url}/{REPO}/raw/main/config.json",
                      headers={"If-None-Match": f'"{_blob(data)}"'})
    assert raw304.status_code == 304
