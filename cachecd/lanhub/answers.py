"""Errors answered as the Hub answers them: huggingface_hub maps ``X-Error-Code`` to its error
types (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError, GatedRepoError) and
shows ``X-Error-Message``."""

from __future__ import annotations

import json

from aiohttp import web


def hf_error(
    cls: type[web.HTTPException],
    code: str | None,
    message: str,
    extra: dict[str, str] | None = None,
) -> web.HTTPException:
    """An error the way the Hub sends it."""
    headers = {"X-Error-Message": message.encode("ascii", "backslashreplace").decode()}
    if code:
        headers["X-Error-Code"] = code
    headers.update(extra or {})
    body = json.dumps({"error": message})
    return cls(headers=headers, text=body, content_type="application/json")


def bad_request(message: str) -> web.HTTPException:
    return hf_error(web.HTTPBadRequest, None, message)
