"""mlx-lm's OpenAI-compatible server over a model whose experts stream through the daemon.

mlx-lm's server does the serving (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
SSE streaming, batching of concurrent requests, the prompt cache, sampling, tool calls); this
module gives it a model provider that loads through ``cachecd_engine.load``, and a handler that
adds the cache's view to each answer (``request_view``) and lists the daemon's models. The
command is ``openai_cli``.

Invariants:
- Under ``mlx.launch`` rank 0 alone binds the address and serves; every rank loads its layers
  (pipelined) and its generation thread follows rank 0's requests, as mlx_lm.server's ranks do.
- Bound to 127.0.0.1 unless ``--host`` says otherwise. A browser page's request (one with an
  ``Origin`` header) is refused unless ``--allowed-origins`` names it: any page could otherwise
  make this machine fetch experts from the Hub.
- Only models registered with the daemon load; a request naming another model gets a one-line
  error and the loaded model stays loaded.
- The model loads in mlx-lm's generation thread, as in mlx_lm.server (MLX streams are per
  thread: a model made in another thread, an adapter's lazy weights with it, fails there);
  ``serve`` waits for that load and raises its error before it listens.
- The engine's counters are never reset while serving (windows are differences), and survive a
  switch to another model.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import socket
import sys
import threading
from collections import Counter
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, _run_http_server
from mlx_lm.utils import maybe_set_recommended_wired_limit

from cachecd.errors import CachecdError, ConfigInvalid
from cachecd_client import Client
from cachecd_engine.kernels import compiling_notice
from cachecd_engine.openai_daemon import (
    DaemonAnswers,
    OutlivingGenerator,
    Unserved,
    daemon_down,
    error_body,
)
from cachecd_engine.pipeline import launched_group, rank_path
from cachecd_engine.pool.bank import EngineStats
from cachecd_engine.prefill_progress import LayerLog, log_wait, watch
from cachecd_engine.registered import check_name, load
from cachecd_engine.request_view import RequestViews
from cachecd_engine.run import cold_cost_notice


class StreamedModelProvider(ModelProvider):
    """mlx-lm's model provider; its models come from ``cachecd_engine.load``."""

    def __init__(self, cli_args: argparse.Namespace, engine: dict[str, Any]) -> None:
        super().__init__(cli_args)
        self.engine = engine
        self.stats = EngineStats()  # every load counts into it: windows span a model switch
        self.views = RequestViews(self.counters)
        self._fetched_before = 0  # upstream fetches of models already unloaded
        self._lock = threading.Lock()
        self.loaded = threading.Event()  # set once load_default has ended, loaded or not
        self.load_error: BaseException | None = None

    def load_default(self) -> None:
        """The first thing mlx-lm's generation thread does, as in mlx_lm.server: MLX streams
        belong to a thread, so the model (an adapter's lazily loaded weights included) must be
        made in the thread that evaluates it. A failure is kept for ``serve`` to raise, and the
        thread goes on to its stop, not its death."""
        try:
            super().load_default()
        except BaseException as exc:
            self.load_error = exc
        finally:
            self.loaded.set()

    def load(self, model_path: str, adapter_path: str | None = None,
             draft_model_path: str | None = None) -> Any:
        # A request names the served model by its name (the openai client must name one):
        # that is the model with --adapter-path, not the bare model (mlx-lm maps only the
        # name "default_model" to it, and would reload the weights without the adapter).
        if model_path == self.cli_args.model and adapter_path is None:
            adapter_path = self.cli_args.adapter_path
        return super().load(model_path, adapter_path, draft_model_path)

    def _load(self, model_path: str, adapter_path: str | None = None,
              draft_model_path: str | None = None) -> None:
        # mlx-lm's _load, through cachecd_engine.load: under mlx.launch it pipelines the layers
        # over the ranks itself (each rank streaming its own layers' experts).
        self.reset()
        gc.collect()
        mx.clear_cache()
        model, tokenizer, config = load(
            model_path, tokenizer_config=self._tokenizer_config, adapter_path=adapter_path,
            return_config=True, trust_remote_code=self.cli_args.trust_remote_code,
            stats=self.stats, **self.engine)
        try:
            refuse_what_cannot_apply(self.cli_args, model, config, draft_model_path)
        except BaseException:
            _close(model)
            raise
        # A layer-by-layer prefill's progress in the log (its keepalives come all the same),
        # and a cold layer's wait on the Hub while it lasts (the first token's delay).
        watch(model, LayerLog(self.stats, model.bank.source.client))
        model.bank.source.client.on_wait(log_wait)
        if getattr(model, "ahead", None) is not None:
            model.ahead.on_rows = batched_keepalives
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        draft = _load_draft(draft_model_path, tokenizer)
        with self._lock:
            self.model_key = (model_path, adapter_path, draft_model_path)  # type: ignore[assignment]
            self.model, self.tokenizer, self.draft_model = model, tokenizer, draft
        self.processor = load_processor(model, config)  # type: ignore[assignment]
        self.is_batchable = draft is None and all(
            hasattr(c, "merge") for c in make_prompt_cache(model))

    def reset(self) -> None:
        with self._lock:
            model = self.model
            if model is not None:
                self._fetched_before += model.bank.source.client.upstream_fetches
            super().reset()
        if model is not None:
            _close(model)

    def daemon_socket(self) -> str | None:
        """The daemon this process (rank 0 under mlx.launch: the one that serves) asks."""
        return rank_path(self.engine.get("socket"), 0)

    def counters(self) -> dict[str, float]:
        """The engine's counters since the server started (``request_view.FIELDS``)."""
        with self._lock:
            model = self.model
            fetched = self._fetched_before + (
                model.bank.source.client.upstream_fetches if model is not None else 0)
        return {**self.stats.snapshot(), "fetched": fetched}


_GENERATE = ResponseGenerator._generate.__code__


def batched_keepalives(rows: list[tuple[int, tuple[int, int]]]) -> None:
    """After each layer of a layer-by-layer pass on the batched path (``prefill_batch``): each
    row's request hears its prefill progress, as mlx-lm's generation loop tells it after each
    step (its ``batch_results[uid]["rqueue"]``), so its keepalive comments keep coming."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _GENERATE:
        frame = frame.f_back  # type: ignore[assignment]
    results = frame.f_locals.get("batch_results") if frame is not None else None
    if not isinstance(results, dict):
        return
    for uid, progress in rows:
        result = results.get(uid)
        if isinstance(result, dict) and "rqueue" in result:
            result["rqueue"].put(progress)


def _close(model: Any) -> None:
    model.bank.close()
    model.bank.source.close()
    if model.bank.trace is not None:
        model.bank.trace.close()


def refuse_what_cannot_apply(cli_args: argparse.Namespace, model: Any, config: dict[str, Any],
                             draft_model_path: str | None) -> None:
    """mlx_lm.server's flags that cannot apply to this model, refused at load with the reason
    (mlx-lm would fail on them at the first request that uses them)."""
    kind = config.get("model_type")
    if cli_args.kv_bits is not None and kind in NO_QUANTIZED_KV:
        raise ConfigInvalid(
            f"--kv-bits: mlx-lm's {kind} attention reads its compressed KV cache as plain "
            "arrays, so a quantized KV cache cannot apply to it (mlx-lm fails on one at the "
            "first request past --quantized-kv-start); leave --kv-bits out")
    if draft_model_path is not None and not can_trim_prompt_cache(make_prompt_cache(model)):
        raise ConfigInvalid(
            f"--draft-model: speculative decoding takes back the tokens the model rejects by "
            f"trimming its caches, and {kind}'s cannot be trimmed (its linear-attention layers "
            "keep a running state), so a draft model cannot apply; leave --draft-model out")


# Model types whose mlx-lm attention cannot read a QuantizedKVCache (tried: kimi_k3's MLA
# indexes its cache's arrays, AttributeError on the quantized tuple).
NO_QUANTIZED_KV = frozenset({"kimi_k3"})


def _load_draft(path: str | None, tokenizer: Any) -> Any:
    if path is None:
        return None
    from mlx_lm import load as mlx_load

    draft, draft_tokenizer = mlx_load(path)[:2]
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        print(f"cachecd openai: the draft model's tokenizer ({draft_tokenizer.vocab_size} ids) "
              f"is not the model's ({tokenizer.vocab_size}); its drafts will be rejected",
              file=sys.stderr)
    return draft


class CachecdHandler(DaemonAnswers, APIHandler):
    """mlx-lm's request handler, with the cache's view in each answer and the daemon's models.

    The view (``request_view``) goes in ``usage.cachecd`` (the non-streamed answer, and the usage
    chunk of a stream asked with ``stream_options={"include_usage": true}``) and, for a non-streamed
    answer, in the ``X-Cachecd-Fetched-Experts`` and ``X-Cachecd-Other-Requests`` headers."""

    @property
    def provider(self) -> StreamedModelProvider:
        return self.response_generator.model_provider  # type: ignore[return-value]

    def do_POST(self) -> None:
        origin = self.headers.get("Origin")
        allowed = self.response_generator.cli_args.allowed_origins
        if origin is not None and "*" not in allowed and origin not in allowed:
            self._error(403, f"origin {origin} is not allowed; start cachecd openai with "
                             f"--allowed-origins {origin} to let that page use the model",
                        "origin_not_allowed")
            return
        super().do_POST()

    def handle_completion(self, request: Any, stop_words: list[str]) -> None:
        if (down := daemon_down(self.provider.daemon_socket())) is not None:
            self._error(down.http_status, down.message, down.code)  # it would wait for nothing
            return
        if not self._one_choice() or not self._installed_model(self.requested_model):
            return
        self.window = self.provider.views.open()
        try:
            super().handle_completion(request, stop_words)
        except (CachecdError, Unserved) as exc:
            self._unserved(exc.error if isinstance(exc, Unserved) else exc)
        finally:
            self.provider.views.close(self.window)

    def generate_response(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        response = super().generate_response(*args, **kwargs)
        if not self.stream:  # the headers are still open: mlx-lm ends them after this answer
            view = self._view(response["usage"])
            response["usage"]["cachecd"] = view
            self.send_header("X-Cachecd-Fetched-Experts", str(view["experts_fetched"]))
            self.send_header("X-Cachecd-Other-Requests", str(view["other_requests"]))
        return response

    def completion_usage_response(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        response = super().completion_usage_response(*args, **kwargs)
        response["usage"]["cachecd"] = self._view(response["usage"])
        return response

    def _view(self, usage: dict[str, Any]) -> dict[str, float | int]:
        """The request's view, with its prompt split as mlx-lm's usage counts it (the tokens its
        prompt cache held, in ``prompt_tokens_details``, were not prefilled again)."""
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return self.provider.views.view(self.window, usage["prompt_tokens"], cached)

    def _one_choice(self) -> bool:
        """mlx-lm's server answers one choice whatever ``n`` asks; asked for more, say so rather
        than answer fewer than asked."""
        n = self.body.get("n", 1)
        if n is None or n == 1:
            return True
        self._error(400, f"n={n} is not supported: cachecd openai answers one choice a "
                         "request; send n=1 (the default), or send the request n times",
                    "invalid_request")
        return False

    def _installed_model(self, name: str) -> bool:
        """Whether ``name`` can be served; if not, answered with an error that says why. Checked
        here, before mlx-lm's provider unloads the model in use to load another."""
        served = self.provider.model_key[0] if self.provider.model_key else None
        if name in ("default_model", self.provider.cli_args.model, served):
            return True
        try:
            with Client(self.provider.daemon_socket(), timeout=10) as client:
                client.model(check_name(name))
            return True
        except CachecdError as exc:
            self._error(404, exc.message, exc.code)
            return False

    def handle_models_request(self) -> None:
        """The served model, then the daemon's other installed models (each loads on request)."""
        names = [self.provider.cli_args.model, *self._installed()]
        models = [{"id": n, "object": "model", "created": self.created, "owned_by": n.split("/")[0]}
                  for n in dict.fromkeys(names)]
        wanted = unquote(self.path.removeprefix("/v1/models").strip("/"))  # the openai client: %2F
        if wanted:
            match = [m for m in models if m["id"] == wanted]
            if not match:
                self._error(404, f"{wanted} is not installed; run `cachecd setup --stream {wanted}`",
                            "model_not_found")
                return
            self._json(match[0])
        else:
            self._json({"object": "list", "data": models})

    def _installed(self) -> list[str]:
        try:
            with Client(self.provider.daemon_socket(), timeout=10) as client:
                models = [m for m in client.models() if m.get("local_dir")]
        except CachecdError:
            return []  # the served model is listed all the same
        # A repo with several revisions registered is named by each: the bare name is none.
        repos = Counter(m["repo"] for m in models)
        return [m["repo"] if repos[m["repo"]] == 1 else f"{m['repo']}@{m['revision']}"
                for m in models]

    def _json(self, body: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, code: str) -> None:
        self._json(error_body(status, message, code), status)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stalled client must not keep the process alive at exit
    banner = ""

    def server_activate(self) -> None:
        super().server_activate()
        host, port = str(self.server_address[0]), int(self.server_address[1])
        host = f"[{host}]" if ":" in host else host
        print(f"cachecd openai: {self.banner} at http://{host}:{port}/v1", flush=True)


def serve(cli_args: argparse.Namespace, engine: dict[str, Any]) -> None:
    """mlx-lm's server on ``cli_args.host``/``port`` (mlx_lm.server's namespace), its model loaded
    through ``cachecd_engine.load`` with ``engine``'s keywords, until SIGINT or SIGTERM."""
    maybe_set_recommended_wired_limit()
    group = launched_group()
    serves = group is None or group.rank() == 0  # mlx.launch: rank 0 serves, the others compute
    prefix = f"rank {group.rank()}: " if group is not None else ""
    if serves:
        _check_address(cli_args.host, cli_args.port)  # before a load that can take minutes
    compiling = compiling_notice()  # asked before the load, which may compile a kernel too
    provider = StreamedModelProvider(cli_args, engine)
    cache_bytes = cli_args.prompt_cache_bytes or 1 << 63  # mlx-lm's LRUPromptCache's "none"
    generator = OutlivingGenerator(provider, LRUPromptCache(cli_args.prompt_cache_size, cache_bytes))
    _wait_for_load(provider, generator)  # no daemon, an unknown model: the one-line error, now
    model: Any = provider.model
    print(prefix + cold_cost_notice(model.bank.source.client, cli_args.model), file=sys.stderr)
    if compiling is not None:
        print(prefix + compiling, file=sys.stderr)
    signal.signal(signal.SIGTERM, _interrupt)  # stop as on Ctrl-C: mlx-lm's server cleans up
    if not serves:  # this rank's generation thread follows rank 0's requests (collectives)
        try:
            generator.join()
        except KeyboardInterrupt:  # its thread may wait in a collective rank 0 left: the
            pass  # caller's os._exit ends it (joining could wait forever)
        return
    server = type("Server", (_Server,), {"banner": f"serving {cli_args.model}" + (
        f" (pipelined over {group.size()} ranks)" if group is not None else "")})
    try:
        # mlx_lm.server.run drops its handler_class in 0.32; the function it calls takes it.
        _run_http_server(cli_args.host, cli_args.port, generator, server_class=server,
                         handler_class=CachecdHandler)
    except OSError as exc:
        raise _cannot_listen(cli_args.host, cli_args.port, exc) from exc
    finally:
        generator.stop_and_join()


def _wait_for_load(provider: StreamedModelProvider, generator: ResponseGenerator) -> None:
    """Until the generation thread has loaded the model; its error, or Ctrl-C, stops it."""
    try:
        provider.loaded.wait()
        if provider.load_error is not None:
            raise provider.load_error
    except BaseException:
        generator.stop_and_join()
        raise


def _check_address(host: str, port: int) -> None:
    """Bind and release the address as the server will (address reuse on), to fail early."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        raise _cannot_listen(host, port, exc) from exc


def _cannot_listen(host: str, port: int, exc: OSError) -> ConfigInvalid:
    why = exc.strerror or str(exc)
    return ConfigInvalid(f"cannot listen on {host}:{port}: {why}; choose another --host or --port")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
