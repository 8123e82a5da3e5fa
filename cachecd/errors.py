"""Every error cachecd raises, on both sides of the socket.

Each error has a stable ``code`` (the wire name), the ``http_status`` the daemon answers with,
``retryable``: whether asking again later can succeed, and ``exit_code``: what a command that
ends in it exits with (``cli_help.EXIT_CODES`` has the table ``--help`` and docs/daemon.md show). The wire form is
``{"error": code, "message": ..., "retryable": bool}``; the client turns it back into the same
type with :func:`error_from_wire`. A message says what failed and what to do next.
"""

from __future__ import annotations

from typing import Any, ClassVar


class CachecdError(Exception):
    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False
    exit_code: ClassVar[int] = 1  # the command failed; its line on stderr says what

    def __init__(self, message: str = "", *, request_id: str | None = None) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        self.request_id = request_id

    def to_wire(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, "retryable": self.retryable}


class InvalidRequest(CachecdError):
    code, http_status = "invalid_request", 400


class TooLarge(CachecdError):
    """The request can never fit (bigger than the whole budget): retrying does not help."""

    code, http_status = "too_large", 400


class Unauthorized(CachecdError):
    code, http_status = "unauthorized", 401


class Forbidden(CachecdError):
    """The peer is not the daemon's user."""

    code, http_status = "forbidden", 403


class Gated(CachecdError):
    code, http_status = "gated", 403


class RepoNotAllowed(CachecdError):
    """No manifest is registered for this repo: the daemon fetches nothing it cannot verify."""

    code, http_status = "repo_not_allowed", 403


class LayerNotServed(CachecdError):
    """The model is registered with this daemon for some layers only (one pipeline rank's, with
    ``setup --pipeline``): an expert of another layer is neither fetched nor served."""

    code, http_status = "layer_not_served", 403


class NotFound(CachecdError):
    code, http_status = "not_found", 404


class ModelNotFound(NotFound):
    code = "model_not_found"


class ExpertNotFound(NotFound):
    code = "expert_not_found"


class ManifestInvalid(CachecdError):
    code, http_status = "manifest_invalid", 422


class ManifestMismatch(ManifestInvalid):
    """A well-formed manifest that disagrees with the Hub's own metadata for the commit it pins
    (a file's size or sha256, the config's hash, a commit that is not the repo's): the message
    names the file and the field."""

    code = "manifest_mismatch"


class ManifestUnchecked(CachecdError):
    """A registered manifest whose expert layout has not been checked against the shards'
    safetensors headers yet (the daemon could not reach its endpoint, and no header is kept):
    none of its experts is served until it is."""

    code, http_status, retryable = "manifest_unchecked", 503, True


class RemoteCodeMismatch(ManifestInvalid):
    """A code file a trusted model would run (in its install dir, or the copy transformers
    imports from its modules cache) differs from the sha256 the manifest pins: nothing of it
    runs. The message names the file, both hashes and what to do."""

    code = "remote_code_mismatch"


class Offline(CachecdError):
    """A miss while HF_HUB_OFFLINE is set."""

    code, http_status = "offline", 503


class ChecksumMismatch(CachecdError):
    code, http_status = "checksum_mismatch", 502


class BadUpstreamRange(CachecdError):
    code, http_status = "bad_upstream_range", 502


class XetFormatError(CachecdError):
    """A Xet answer is malformed: a chunk header cut short or out of bounds, a chunk that does not
    decompress to its stated size, a hash that is not 64 hex digits. Nothing of it is kept; the
    endpoint (or what is between) sent bytes the protocol does not allow."""

    code, http_status = "xet_invalid", 502


class XetProofError(CachecdError):
    """A range's bytes and the content store's proof do not recompute the file's xet hash (a
    changed chunk, a wrong tree node, a proof for another offset, a window that does not cover
    the range). Nothing of it is kept: the bytes are not the file's at the pinned commit."""

    code, http_status = "xet_proof_mismatch", 502


class UpstreamError(CachecdError):
    code, http_status, retryable = "upstream_error", 502, True


class UpstreamRateLimited(CachecdError):
    code, http_status, retryable = "upstream_rate_limited", 503, True


class UpstreamTimeout(CachecdError):
    code, http_status, retryable = "upstream_timeout", 504, True


class ShuttingDown(CachecdError):
    code, http_status, retryable = "shutting_down", 503, True


class TooManyConnections(CachecdError):
    """The control socket holds its limit of connections, each busy or just answered."""

    code, http_status, retryable = "too_many_connections", 503, True


class DaemonUnavailable(CachecdError):
    """Raised by the client only: nothing listens on the socket."""

    code, http_status, retryable = "daemon_unavailable", 503, True
    exit_code = 3  # scripts can tell "start a daemon" from a failure


class StopTimedOut(CachecdError):
    """``cachecd stop``: the daemon is still running after the wait (it was sent SIGTERM)."""

    code, http_status, retryable = "stop_timeout", 504, True


class DiskFull(CachecdError):
    code, http_status, retryable = "disk_full", 507, True


class ReservationsFull(CachecdError):
    """Everything evictable is reserved or pinned right now; space frees as fetches finish."""

    code, http_status, retryable = "reservations_full", 507, True


class BudgetTooSmall(ReservationsFull):
    """A request needs more bytes on disk at once than the whole budget (its own experts, one
    layer's of a prefill step): retrying does not help; the message names the budget that
    would, and the smaller prefill step that needs less."""

    code, retryable = "budget_too_small", False


class EndpointMismatch(CachecdError):
    """A model was installed from one endpoint and the daemon fetches from another: its missing
    experts are not fetched from there until the user says so (the message names both endpoints,
    ``serve --allow-other-endpoint`` and re-running setup with the new endpoint)."""

    code, http_status = "endpoint_mismatch", 409


class IndexFull(CachecdError):
    code, http_status, retryable = "index_full", 507, True


class CacheLocked(CachecdError):
    """Another daemon holds the cache directory's lock."""

    code, http_status = "cache_locked", 409
    exit_code = 6  # busy: stop that daemon, or ask it (`cachecd status`)


class ConfigInvalid(CachecdError):
    code, http_status = "config_invalid", 400


class UnsupportedFormat(CachecdError):
    """The engine cannot decode this model type or quant format; no expert is approximated."""

    code, http_status = "unsupported_format", 422


class NotStreamable(CachecdError):
    """Asked of the engine but not possible with streamed experts (a local folder, an adapter or
    config that changes the experts, another revision): the message says what to use instead."""

    code, http_status = "not_streamable", 422


class RemoteCodeNotTrusted(CachecdError):
    """A model's tokenizer runs code from its repo and the user has not said to trust it: the
    message names each file and the sha256 the manifest pins, and the flag that trusts it."""

    code, http_status = "remote_code_not_trusted", 403


class DispatchUnmodelled(CachecdError):
    """The engine cannot keep a streamed call on the kernel the resident call takes: an MLX
    whose dispatch it has not modelled (on Metal), a setting that makes the choice depend on what
    its plans do not see, or a call no flag or dummy rows bring to that kernel. Nothing is
    computed with another kernel; the message says what to change."""

    code, http_status = "dispatch_unmodelled", 422


class ExpertSizeMismatch(CachecdError):
    """An expert buffer's length differs from its manifest entry: the bytes are not used."""

    code, http_status = "expert_size_mismatch", 502


class ServiceManagerUnavailable(CachecdError):
    """launchd or a systemd user manager is not reachable here (containers, SSH without a session)."""

    code, http_status = "service_manager_unavailable", 503


class ServiceCommandFailed(CachecdError):
    """A launchctl/systemctl command run by ``cachecd service`` exited non-zero."""

    code, http_status = "service_command_failed", 500


class Internal(CachecdError):
    code, http_status = "internal", 500


# Exit codes: one meaning each. A code never says two things in one command, and a code several
# commands use means the same in each; ``cachecd CMD --help`` and docs/daemon.md show the tables.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_DAEMON, EXIT_BUSY, EXIT_INTERRUPTED = 0, 1, 2, 3, 6, 130
# fsck's bits (Nix's convention: 1 corrupt, 4 unverifiable; 5 both).
FSCK_CORRUPT, FSCK_UNVERIFIABLE = 1, 4
_COMMON = ((EXIT_OK, "done"),
           (EXIT_FAILED, "failed: the last line on stderr names the error (cachecd: CODE: ...)"),
           (EXIT_USAGE, "the command line is wrong (see --help)"),
           (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"))
_NO_DAEMON = ((EXIT_NO_DAEMON, "no daemon answers on the socket: start one (cachecd serve, "
                               "cachecd service install, or cachecd setup --stream)"),)
_DAEMON_COMMANDS = ("status", "pin", "unpin", "evict", "remove", "coverage", "warm", "run",
                    "openai", "setup")
# Rows a command adds to (or, same code, says more precisely than) the common ones.
_OWN: dict[str, tuple[tuple[int, str], ...]] = {
    "fsck": ((EXIT_OK, "clean: every blob checked is good"),
             (FSCK_CORRUPT, "corrupt blobs found (missing, wrong size, wrong hash); --repair "
                            "quarantines them"),
             (FSCK_UNVERIFIABLE, "not everything could be checked: blobs that could not be read, "
                                 "no cache at the dir, or an error named on stderr"),
             (FSCK_CORRUPT | FSCK_UNVERIFIABLE, "both"),
             (EXIT_BUSY, "busy: a running daemon holds the cache; stop it first (it re-hashes "
                         "blobs in the background: cachecd status shows its scrub)")),
    "stop": ((EXIT_OK, "stopped: the daemon drained its fetches in flight and exited"),
             (EXIT_FAILED, "still running after --wait (stderr names its pid); it was sent "
                           "SIGTERM, nothing stronger"),
             (EXIT_NO_DAEMON, "no daemon answers on the socket: nothing to stop")),
    "serve": ((EXIT_OK, "stopped cleanly (SIGTERM, SIGINT)"),
              (EXIT_BUSY, "busy: another daemon holds the cache dir or listens on the socket")),
    "warm": ((EXIT_FAILED, "warming stopped at an error named on stderr; what was fetched stays "
                           "cached: run it again to go on"),
             (EXIT_INTERRUPTED, "interrupted (Ctrl-C); what was fetched stays cached")),
    "manifest verify": ((EXIT_FAILED, "the manifest is invalid or disagrees with the endpoint's "
                                      "metadata (each disagreement printed)"),),
    "service status": ((EXIT_NO_DAEMON, "not running: no daemon answers on the service's "
                                        "socket (LSB's code, as systemctl status)"),),
}


def exit_codes(command: str) -> list[tuple[int, str]]:
    """(code, meaning) of ``command`` ("fsck", "service status", ...), by code."""
    rows = dict(_COMMON)
    if command.split()[0] in _DAEMON_COMMANDS or command == "service status":
        rows.update(_NO_DAEMON)
    rows.update(_OWN.get(command, ()))
    return sorted(rows.items())


def _all_subclasses(cls: type[CachecdError]) -> list[type[CachecdError]]:
    out: list[type[CachecdError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_ALL_ERRORS: list[type[CachecdError]] = [CachecdError, *_all_subclasses(CachecdError)]
ERRORS_BY_CODE: dict[str, type[CachecdError]] = {cls.code: cls for cls in _ALL_ERRORS}


def error_from_wire(payload: Any, http_status: int | None = None) -> CachecdError:
    """The typed error for a wire payload; an unknown code keeps its message as ``Internal``."""
    if not isinstance(payload, dict) or "error" not in payload:
        return Internal(f"daemon answered HTTP {http_status} without an error body: {payload!r}"[:500])
    cls = ERRORS_BY_CODE.get(str(payload["error"]), Internal)
    return cls(str(payload.get("message", "")))
