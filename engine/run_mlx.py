"""mlx_lm.generate's command line in ``cachecd run``: its flags, and its own ``main()`` run with the
engine's load and generate.

Invariants:
- Each option of mlx_lm.generate's ``setup_arg_parser`` is an option of ``cachecd run`` with the
  same option strings, type, nargs and default (literals here, so ``cachecd --help`` imports no
  mlx; tests/unit/test_run_flags.py holds them equal to the installed mlx-lm's), but for
  ``--prompt`` (required: no model-specific default text) and ``--max-tokens`` (64), or is
  refused when given, saying why (``REFUSED``).
- What a flag does is what mlx_lm.generate's ``main()`` does with it (the prompt's ``\\n`` escapes
  and ``-`` for stdin, the system prompt, a prefilled response, the chat template and its config,
  extra eos tokens, the sampler, how the prompt is encoded): ``call_main`` runs that function
  itself, bound to its own module's names but three (``setup_arg_parser``, ``load``,
  ``generate``), so nothing of it is copied here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

# mlx_lm.generate's defaults (DEFAULT_XTC_PROBABILITY, ...); held equal by the unit test.
XTC_PROBABILITY, XTC_THRESHOLD, MIN_TOKENS_TO_KEEP = 0.0, 0.1, 1

# Options of mlx_lm.generate that streamed experts cannot honour yet: (option strings, the
# default main() reads, why).
REFUSED: tuple[tuple[tuple[str, ...], Any, str], ...] = (
    (("--image",), (), "the streamed install holds the text model only (no vision tower)"),
    (("--prompt-cache-file",), None, "a prompt cache is made by mlx_lm.cache_prompt on a "
     "resident model; cachecd run does not read one yet"),
    (("--draft-model",), None, "speculative decoding with a draft model is not supported: "
     "K3's linear-attention caches cannot be trimmed back after a rejected draft"),
    (("--num-draft-tokens",), 3, "it goes with --draft-model, which is not supported"),
    (("--kv-bits",), None, "kimi_k3's attention reads its compressed KV cache as plain arrays "
     "(mlx-lm fails on a quantized one), and a quantized cache is not checked against mlx-lm's "
     "on a layer-by-layer prefill"),
    (("--kv-group-size",), 64, "it goes with --kv-bits, which is not supported"),
    (("--quantized-kv-start",), 5000, "it goes with --kv-bits, which is not supported"),
)


def str2bool(text: str) -> bool:
    """mlx_lm.generate's ``--verbose`` reading: anything but false/f (any case) is true."""
    return text.lower() not in ("false", "f")


class Refused(argparse.Action):
    """An option of mlx_lm.generate that ``cachecd run`` refuses, with the reason."""

    def __init__(self, *args: Any, why: str = "", **kwargs: Any) -> None:
        self.why = why
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} is mlx_lm.generate's, but not cachecd run's: {self.why}")


def add_generate_flags(p: argparse.ArgumentParser) -> None:
    """mlx_lm.generate's options beyond those ``cachecd run`` defines itself (the prompt, the
    model, sampling, the seed, the prefill step, trusting remote code)."""
    p.add_argument("--system-prompt", default=None,
                   help="a system message before the prompt, in the chat template (default: none)")
    p.add_argument("--prefill-response", default=None,
                   help="the start of the answer, which the model continues (chat template; default: "
                        "none)")
    p.add_argument("--chat-template-config", default=None,
                   help="more arguments for the chat template, as a JSON object, e.g. "
                        "'{\"enable_thinking\": false}' (default: none)")
    p.add_argument("--ignore-chat-template", "--no-chat", dest="ignore_chat_template",
                   action="store_true",
                   help="the prompt as it is, without the tokenizer's chat template")
    p.add_argument("--use-default-chat-template", action="store_true",
                   help="accepted as mlx_lm.generate accepts it (it changes nothing there either)")
    p.add_argument("--extra-eos-token", type=str, default=(), nargs="+",
                   help="more tokens that end the text")
    p.add_argument("--verbose", type=str2bool, default=True,
                   help="T (default): the text as it comes, progress and figures on stderr; F: "
                        "only the answer, printed when it is complete (as mlx_lm.generate)")
    p.add_argument("--max-kv-size", type=int, default=None,
                   help="the KV cache's size, for models without their own cache (K3 has one, "
                        "so it changes nothing there, as in mlx-lm; default: none)")
    p.add_argument("--xtc-probability", type=float, default=XTC_PROBABILITY,
                   help="XTC sampling: the chance to apply it at each token")
    p.add_argument("--xtc-threshold", type=float, default=XTC_THRESHOLD,
                   help="XTC sampling: the probability above which candidates are dropped")
    p.add_argument("--min-tokens-to-keep", type=int, default=MIN_TOKENS_TO_KEEP,
                   help="the fewest tokens min-p sampling keeps")
    p.add_argument("--adapter-path", type=str, default=None,
                   help="a LoRA adapter (mlx_lm.lora's) on the resident weights; one on the "
                        "routed experts is refused (default: none)")
    p.add_argument("--quantize-activations", "-qa", action="store_true",
                   help="quantize activations as the layer's weights (nvfp4 and mxfp8 "
                        "layers, as in mlx-lm)")
    for flags, default, why in REFUSED:
        p.add_argument(*flags, action=Refused, why=why, default=default, help=argparse.SUPPRESS)


class _Parsed:
    """What ``main()`` takes for its parser: ``parse_args`` gives the namespace parsed already."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def parse_args(self) -> argparse.Namespace:
        return self.args


def call_main(args: argparse.Namespace, load: Callable[..., Any],
              generate: Callable[..., Any]) -> None:
    """mlx_lm.generate's ``main()`` on ``args``, with ``load(path, **mlx_lm.load's keywords)`` and
    ``generate(model, tokenizer, prompt_ids, verbose=..., **stream_generate's keywords)`` in place
    of mlx-lm's. It prints the answer itself when ``args.verbose`` is false."""
    import importlib
    import types

    module = importlib.import_module("mlx_lm.generate")  # the package's name is its function
    ours = {"setup_arg_parser": lambda: _Parsed(args), "load": load, "generate": generate}
    missing = set(ours) - set(module.main.__code__.co_names)
    if missing:  # a newer mlx-lm whose main() no longer calls what we replace
        raise RuntimeError(f"mlx_lm.generate.main no longer uses {sorted(missing)}: cachecd run "
                           "needs the mlx-lm version it was released with")
    types.FunctionType(module.main.__code__, {**vars(module), **ours})()
