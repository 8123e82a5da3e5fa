"""The command line as a user meets it before any work: an unknown flag is refused by the command
it was given to (its usage, and the closest of its flags), ``-v`` works after the command as
before it, and ``run`` without a daemon says so at once (before the model's libraries load)."""

from __future__ import annotations

from pathlib import Path

from tests.harness import run_cli


def test_an_unknown_flag_shows_the_commands_usage_and_the_closest_flag(tmp_path: Path) -> None:
    proc = run_cli("run", "--socket", str(tmp_path / "s.sock"), "-p", "hi", "--system-promt", "x",
                   check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: cachecd run "), proc.stderr
    assert "--max-kv-size" in proc.stderr  # run's own options, not the list of commands
    assert proc.stderr.rstrip().endswith(
        "cachecd run: error: unrecognized arguments: --system-promt x; did you mean "
        "--system-prompt?"), proc.stderr
    nested = run_cli("service", "install", "--dry-rum", check=False)
    assert nested.returncode == 2 and nested.stderr.startswith("usage: cachecd service install ")
    assert "did you mean --dry-run?" in nested.stderr
    far = run_cli("coverage", "--zzzzzz", check=False)
    assert far.stderr.startswith("usage: cachecd coverage ") and "did you mean" not in far.stderr


def test_verbose_after_the_command(tmp_path: Path) -> None:
    """``-v`` after the command is the same debug switch as before it: the error's traceback."""
    sock = str(tmp_path / "none" / "s.sock")
    for args in (["-v", "coverage", "--socket", sock], ["coverage", "--socket", sock, "-v"],
                 ["coverage", "--verbose", "--socket", sock]):
        proc = run_cli(*args, check=False)
        assert proc.returncode == 3, (args, proc.stderr)
        assert "Traceback" in proc.stderr and "daemon_unavailable" in proc.stderr, args
    assert "Traceback" not in run_cli("coverage", "--socket", sock, check=False).stderr


def test_run_without_a_daemon_fails_before_loading_mlx(tmp_path: Path) -> None:
    """No daemon: exit 3 and the one line that says what to start, before mlx is imported (an
    mlx that cannot be imported is on the path: reaching it would be another error)."""
    poison = tmp_path / "poison" / "mlx"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('mlx was imported')\n")
    sock = tmp_path / "none" / "s.sock"
    for model in ([], ["--model", "org/name"]):
        proc = run_cli("run", "--socket", str(sock), *model, "-p", "hi", check=False,
                       env={"PYTHONPATH": f"{poison.parent}:{Path.cwd()}"})
        assert proc.returncode == 3, proc.stderr
        assert proc.stderr.startswith("cachecd: daemon_unavailable: no cachecd daemon answers on "
                                      f"{sock}"), proc.stderr
