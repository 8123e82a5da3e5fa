"""A plan for people (a table), for scripts (JSON, as built) and as a picture (PNG: tok/s
against disk budget, cold and warm, the recommendation marked). matplotlib runs on the Agg
backend and is imported only when a PNG is asked for, as coverage_render does."""

from __future__ import annotations

import io
from typing import Any

from cachecd.sizes import format_size


def _tps(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def render_table(plan: dict[str, Any]) -> str:
    m, mach, rec = plan["model"], plan["machine"], plan["recommended"]
    net = ("Hub: not measured (cachecd doctor --network REPO)" if not mach["hub_rate"] else
           f"Hub {mach['hub_rate'] / 1e9:.3f} GB/s, resolve {mach['resolve_s'] * 1e3:.0f} ms")
    first = plan["first_token_s"]
    lines = [
        f"model      {m['repo']}@{m['revision'][:12]}: {m['moe_layers']} MoE layers x "
        f"{m['experts_per_layer']} experts, top-{m['top_k']}"
        f"{' (' + m['top_k_source'] + ')' if m.get('top_k_source') else ''}, "
        f"{format_size(m['expert_bytes_total'])} of experts, "
        f"{format_size(m['bytes_per_token'])} routed a token",
        *_origin(m),
        f"workload   {plan['workload']}",
        f"machine    memory {format_size(mach['total'])} ({format_size(mach['available'])} "
        f"available); SSD cold {mach['cold_rate'] / 1e9:.2f} GB/s, page cache "
        f"{mach['page_rate'] / 1e9:.2f} GB/s; {net}",
        f"compute    {plan['compute']['ms_per_token']:.1f} ms a token ({plan['compute']['source']})",
        f"pool       {format_size(plan['pool']['bytes'])} ({plan['budgets'][0]['slots']} slots; "
        "the engine's default here)",
        "",
        f"{'disk budget':>12} {'pool hits':>9} {'disk hits':>9} {'local':>6} "
        f"{'tok/s cold':>10} {'tok/s warm':>10}",
    ]
    for r in plan["budgets"]:
        mark = "  <- recommended" if r["budget"] == rec["budget"] else ""
        disk = "-" if r["pool_hit_rate"] == 1 else f"{r['disk_hit_rate']:.1%}"
        lines.append(f"{format_size(r['budget']):>12} {r['pool_hit_rate']:>9.1%} "
                     f"{disk:>9} {r['local_rate']:>6.1%} "
                     f"{_tps(r['tok_s_cold']):>10} {_tps(r['tok_s_warm']):>10}{mark}")
    lines += ["", f"{'pool':>12} {'slots':>9} {'pool hits':>9} {'tok/s warm':>10}   (at the "
              f"recommended budget)"]
    for r in plan["pools"]:
        lines.append(f"{format_size(r['pool_bytes']):>12} {r['slots']:>9} "
                     f"{r['pool_hit_rate']:>9.1%} {_tps(r['tok_s_warm']):>10}")
    lines += ["",
              f"first token, nothing cached: {'n/a' if first is None else f'{first:.1f} s'} "
              "from the Hub",
              f"recommended: --budget {format_size(rec['budget'])}, pool "
              f"{format_size(rec['pool_bytes'])}: {_tps(rec['tok_s_cold'])} tok/s cold, "
              f"{_tps(rec['tok_s_warm'])} warm"]
    if plan.get("prompt"):
        lines += ["", *prompt_lines(plan["prompt"])]
    return "\n".join([*lines, "", *LEGEND])


# What the table's figures mean, printed under it (docs/plan.md says how each is projected).
LEGEND = (
    "how to read it:",
    "  disk budget  the expert cache's size on disk (setup/serve --budget)",
    "  pool hits    routed experts found in the pool of expert slots in memory (run --ram)",
    "  disk hits    of those not in the pool, the share the disk cache held",
    "  local        of the bytes read into the pool, the share from disk (the rest: the Hub)",
    "  tok/s cold   decode speed reading the disk cold from the SSD; warm: from the page cache",
    "  slots        experts the pool holds at once (its size / one expert's bytes)",
    "  first token  nothing cached: every expert it routes to comes from the Hub",
    "  n/a          not measured here (the Hub's rate: cachecd doctor --network REPO)",
)


def _origin(m: dict[str, Any]) -> list[str]:
    """Where the model's figures came from (``plan_command`` adds it; ``build_plan`` does not)."""
    if not m.get("origin"):
        return []
    read = ("" if m.get("fetched_bytes") is None else
            f" (read {format_size(m['fetched_bytes'])} of the shards' "
            f"{format_size(m['shard_bytes'])})")
    return [f"from       {m['origin']}{read}"]


def _secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g} s"


def prompt_lines(p: dict[str, Any]) -> list[str]:
    """The first token of a prompt of ``p['tokens']`` tokens (``plan --prompt-tokens``)."""
    t = p["first_token_s"]
    lines = [f"prompt of {p['tokens']} tokens ({p['steps']} steps of {p['step']}, layer by "
             f"layer), pool {format_size(p['pool_bytes'])} ({p['slots']} slots): reads "
             f"{p['reads']:.0f} experts ({format_size(p['read_bytes'])}), "
             f"{p['routed_experts']:.0f} distinct ({format_size(p['routed_bytes'])}); "
             f"compute {p['compute_s']:.3g} s ({p['compute_source']})",
             f"first token: {_secs(t['cold'])} cold from the Hub, {_secs(t['warm'])} warm "
             f"from disk, {_secs(t['pool'])} from the pool"]
    if p["note"]:
        lines.append(f"note: {p['note']}")
    return lines


def render_png(plan: dict[str, Any], dpi: int = 100) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = plan["budgets"]
    x = [r["budget"] / 1e9 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        for key, label in (("tok_s_warm", "warm (page cache)"), ("tok_s_cold", "cold (SSD)")):
            ys = [r[key] if r[key] is not None else float("nan") for r in rows]
            ax.plot(x, ys, marker="o", label=label)
        ax.axvline(plan["recommended"]["budget"] / 1e9, color="grey", ls="--",
                   label="recommended")
        ax.set_xscale("log")
        ax.set_xlabel("disk budget (GB)")
        ax.set_ylabel("tok/s")
        ax.set_title(f"{plan['model']['repo']}: {plan['workload']}", fontsize=9)
        ax.legend()
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=dpi)
        return buf.getvalue()
    finally:
        plt.close(fig)
