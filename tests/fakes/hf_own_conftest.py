"""conftest.py for huggingface_hub's own tests (its sdist ships them without one) run against
`cachecd hub serve`: HF_ENDPOINT is the local hub, for the tests that read through
``constants.ENDPOINT`` and for those that name the staging endpoint. Nothing here writes to a
hub: ``RepoFactory`` and ``api`` exist so the test modules import (a test that makes a repo with
them skips), and a class fixture's setup writes the served folder directly (below)."""

from __future__ import annotations

import os

import pytest

from . import testing_constants

testing_constants.ENDPOINT_STAGING = os.environ["HF_ENDPOINT"]
testing_constants.USER = "hub-ci-user"  # the Hub, like this hub, takes no name starting with _


class RepoFactory:  # the real one creates repos through the write API
    def __call__(self, *args: object, **kwargs: object) -> object:
        pytest.skip("needs the Hub's write API")


@pytest.fixture
def repo_factory() -> RepoFactory:
    return RepoFactory()


@pytest.fixture(scope="session")
def api():  # type: ignore[no-untyped-def]
    from huggingface_hub import HfApi

    return HfApi(endpoint=os.environ["HF_ENDPOINT"])



# TestHfFileSystemRepositoryRO makes its repo in a class fixture through the write API. Here that
# setup writes the folder the hub serves (CACHECD_HUB_ROOT) instead; the tests then read it
# through the hub, unmodified. An upload to a pull request is dropped: no PR refs are served.
def _local_writes(root: str) -> None:
    import shutil
    from pathlib import Path

    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.hf_api import RepoUrl

    from cachecd.lanhub.gitattrs import HUB_DEFAULT

    def folder(repo_id: str, repo_type: str | None) -> Path:
        if "/" not in repo_id:
            repo_id = f"{testing_constants.USER}/{repo_id}"
        return Path(root, "datasets" if repo_type == "dataset" else "", repo_id)

    def create_repo(self, repo_id, *, repo_type=None, **_):  # type: ignore[no-untyped-def]
        path = folder(repo_id, repo_type)
        path.mkdir(parents=True, exist_ok=True)
        # A repo made on the Hub starts with its default .gitattributes (the LFS patterns).
        lines = [f"{pattern} filter=lfs diff=lfs merge=lfs -text" for pattern in HUB_DEFAULT]
        (path / ".gitattributes").write_text("\n".join(lines) + "\n")
        kind = "datasets/" if repo_type == "dataset" else ""
        return RepoUrl(f"{self.endpoint}/{kind}{path.parent.name}/{path.name}",
                       endpoint=self.endpoint)

    def upload_file(self, *, path_or_fileobj, path_in_repo, repo_id, repo_type=None,
                    create_pr=False, **_):  # type: ignore[no-untyped-def]
        if not create_pr:
            target = folder(repo_id, repo_type) / path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path_or_fileobj)

    def create_commit(self, repo_id, operations, *, repo_type=None, **_):  # type: ignore[no-untyped-def]
        for op in operations:
            if not isinstance(op, CommitOperationAdd) or not isinstance(op.path_or_fileobj, bytes):
                pytest.skip(f"needs the Hub's write API ({type(op).__name__})")
            upload_file(self, path_or_fileobj=op.path_or_fileobj, path_in_repo=op.path_in_repo,
                        repo_id=repo_id, repo_type=repo_type)

    def delete_file(self, path_in_repo, repo_id, *, repo_type=None, **_):  # type: ignore[no-untyped-def]
        (folder(repo_id, repo_type) / path_in_repo).unlink(missing_ok=True)

    def delete_repo(self, repo_id, *, repo_type=None, **_):  # type: ignore[no-untyped-def]
        shutil.rmtree(folder(repo_id, repo_type), ignore_errors=True)

    HfApi.create_repo, HfApi.upload_file = create_repo, upload_file  # type: ignore[method-assign]
    HfApi.delete_file, HfApi.delete_repo = delete_file, delete_repo  # type: ignore[method-assign]
    HfApi.create_commit = create_commit  # type: ignore[method-assign]


if os.environ.get("CACHECD_HUB_ROOT"):
    _local_writes(os.environ["CACHECD_HUB_ROOT"])
