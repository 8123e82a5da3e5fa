"""`cachecd plan` as a user runs it after setup: no --model (the daemon's one model, as every other
command takes it), its long steps said on stderr as they start (it ran 85 s in silence), and
what its numbers mean under its table."""

from __future__ import annotations

from tests.harness import TINY_REPO, Installed, run_cli


def test_plan_takes_the_registered_model_says_its_steps_and_explains_its_figures(
        installed_module: Installed) -> None:
    socket = str(installed_module.socket)
    doctor = installed_module.base / "doctor.json"
    doctor.write_text(run_cli("doctor", "--cache-dir", str(installed_module.base / "cache"),
                              "--size", "16MiB", "--block", "64KiB", "--socket", socket,
                              "--json").stdout)
    proc = run_cli("plan", "--socket", socket, "--doctor", str(doctor), timeout=600)
    assert proc.stdout.startswith(f"model      {TINY_REPO}@"), proc.stdout
    steps = [ln for ln in proc.stderr.splitlines() if ln.startswith("plan: ")]
    said = " | ".join(steps)
    for step in (f"reading {TINY_REPO}'s manifest", "measuring the compute", "simulating",
                 "done"):
        assert step in said, proc.stderr
    legend = proc.stdout.split("how to read it:", 1)[1]
    for column in ("disk budget", "pool hits", "disk hits", "local", "tok/s cold", "slots",
                   "first token"):
        assert f"\n  {column} " in legend, legend
