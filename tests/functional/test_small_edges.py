"""Small edges a new user met, each run as they ran it: the message says what is wrong and what
to do, in the user's words (no Python tuple, no "got None", no lost connection for a missing
scheme), and help text says what the code does."""

from __future__ import annotations

from typing import Any

from cachecd.sizes import format_size
from tests.harness import TINY_REPO, Installed, run_cli, short_tmp


def _last_line(proc: Any) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_evict_experts_without_a_layer_is_a_usage_error(installed_module: Installed) -> None:
    proc = run_cli("evict", "--socket", str(installed_module.socket), "--experts", "1",
                   check=False)
    assert proc.returncode == 2, proc.stderr
    assert "--experts needs --layer" in _last_line(proc), proc.stderr


def test_no_such_expert_names_the_layers_as_numbers(installed_module: Installed,
                                                   tiny_manifest: Any) -> None:
    layers = tiny_manifest.moe_layers
    proc = run_cli("evict", "--socket", str(installed_module.socket), "--model", TINY_REPO,
                   "--layer", "99", "--experts", "0", check=False)
    assert proc.returncode == 1, proc.stderr
    assert f"(MoE layers {layers[0]}..{layers[-1]}, " in _last_line(proc), proc.stderr


def test_an_endpoint_without_a_scheme_is_named() -> None:
    base = short_tmp("cdep")
    proc = run_cli("setup", "--stream", TINY_REPO, "--endpoint", "127.0.0.1:8090", "--socket",
                   str(base / "s.sock"), "--models-dir", str(base / "models"), "--cache-dir",
                   str(base / "cache"), check=False)
    line = _last_line(proc)
    assert proc.returncode == 1, proc.stderr
    assert line.startswith("cachecd: config_invalid: --endpoint") and "http://" in line, line
    assert "'127.0.0.1:8090'" in line, line


def test_evicting_a_pinned_expert_says_why_nothing_was_freed(installed_module: Installed,
                                                            tiny_manifest: Any) -> None:
    sock, layer = str(installed_module.socket), str(tiny_manifest.moe_layers[0])
    which = ["--model", TINY_REPO, "--layer", layer, "--experts", "2"]
    run_cli("pin", "--socket", sock, *which)
    try:
        out = run_cli("evict", "--socket", sock, *which).stdout.strip()
        assert out.startswith("freed 0 B; 1 of those experts are pinned, so kept"), out
        assert "cachecd unpin" in out, out
    finally:
        run_cli("unpin", "--socket", sock, *which)
    out = run_cli("evict", "--socket", sock, *which).stdout.strip()
    assert out.startswith("freed ") and out != "freed 0 B" and "pinned" not in out, out


def test_prefetch_help_says_its_default_is_off() -> None:
    text = " ".join(run_cli("run", "--help").stdout.split())
    prefetch = text[text.index("--prefetch, --no-prefetch"):][:300]
    assert "(default: off" in prefetch and "GPU" not in prefetch.split("--speculate")[0], prefetch


def test_status_shows_the_pins(installed_module: Installed, tiny_manifest: Any) -> None:
    sock, layers = str(installed_module.socket), tiny_manifest.moe_layers
    pins = [(layers[0], "0,5"), (layers[1], "3")]
    for layer, experts in pins:
        run_cli("pin", "--socket", sock, "--model", TINY_REPO, "--layer", str(layer),
                "--experts", experts)
    try:
        nbytes = sum(tiny_manifest.expert(layer, int(e)).nbytes
                     for layer, experts in pins for e in experts.split(","))
        out = run_cli("status", "--socket", sock).stdout
        assert f"  pinned    3 experts, {format_size(nbytes)}: never evicted" in out, out
        assert f"layer {layers[0]}:" not in out, out  # the list is --verbose's
        out = run_cli("status", "--socket", sock, "--verbose").stdout
        assert f"    layer {layers[0]}: 0, 5\n    layer {layers[1]}: 3" in out, out
    finally:
        for layer, experts in pins:
            run_cli("unpin", "--socket", sock, "--model", TINY_REPO, "--layer", str(layer),
                    "--experts", experts)
    assert "pinned" not in run_cli("status", "--socket", sock).stdout
