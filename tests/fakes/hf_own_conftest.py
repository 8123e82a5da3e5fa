"""conftest.py for huggingface_hub's own tests (its sdist ships them without one) run against
`cachecd hub serve`: HF_ENDPOINT is the local hub, for the tests that read through
``constants.ENDPOINT`` and for those that name the staging endpoint. Nothing here writes to a
hub: ``RepoFactory`` and ``api`` exist so the test modules import; tests that use them are not
selected (they need the write API)."""

from __future__ import annotations

import os

import pytest

from . import testing_constants

testing_constants.ENDPOINT_STAGING = os.environ["HF_ENDPOINT"]


class RepoFactory:  # the real one creates repos through the write API
    def __call__(self, *args: object, **kwargs: object) -> object:
        pytest.skip("needs the Hub's write API")


@pytest.fixture
def repo_factory() -> RepoFactory:
    return RepoFactory()


@pytest.fixture
def api():  # type: ignore[no-untyped-def]
    from huggingface_hub import HfApi

    return HfApi(endpoint=os.environ["HF_ENDPOINT"])

