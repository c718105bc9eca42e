"""The `bench` report on the terminal: the table (rich on a terminal, plain columns into a pipe), which source
drafted under each configuration, a bar chart of the speedups, and each divergence with its verdict."""

from __future__ import annotations

from rich.console import Console

from localspec.cli.table import print_table


def bars(rows: list[dict], width: int = 30) -> str:
    """Terminal bar chart of median speedup per config, per category."""
    out = []
    cats = [c for c in dict.fromkeys(r["category"] for r in rows)]
    top = max((r["speedup_median"] or 0) for r in rows) or 1.0
    for cat in cats:
        out.append(cat)
        for r in rows:
            if r["category"] != cat or r["speedup_median"] is None:
                continue
            n = int(round(width * r["speedup_median"] / max(top, 1.0)))
            one = int(round(width * 1.0 / max(top, 1.0)))
            bar = "".join("█" if i < n else " " for i in range(width))
            bar = bar[:one] + "│" + bar[one:]
            out.append(f"  {r['config']:<18} {bar} {r['speedup_median']:.2f}x")
    return "\n".join(out)


def print_report(rows: list[dict], console=None) -> None:
    """The report table: rich on a terminal, plain aligned columns (nothing cut) into a pipe or a file."""
    console = console or Console(stderr=True)
    cols = ["config", "k eff", "exactness", "category", "tok/s med", "tok/s p95", "lat p50", "lat p95", "ttft", "accept",
            "len", "speedup", "ideal", "meas/ideal", "identical", "div pos"]
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    table = []
    for r in rows:
        spec = r["method"] != "none"
        share = r["identical_share"]
        ident = "-" if share is None or not spec else ("[red]" if r["bugs"] else "") + f"{share:.0%}" + ("[/red]" if r["bugs"] else "")
        table.append([r["config"], str(r["k_effective"]) if spec else "-", (r["exactness"] or "-") if spec else "-", r["category"],
                      f(r["tps_median"], ".1f"), f(r["tps_p95"], ".1f"), f(r["latency_p50"], ".2f"),
                      f(r["latency_p95"], ".2f"), f(r["ttft_median"], ".2f"), f(r["acceptance_rate"], ".0%"),
                      f(r["mean_accepted_length"], ".2f"), f(r["speedup_median"], ".2f") + ("x" if r["speedup_median"] else ""),
                      f(r["ideal_speedup"], ".2f"), f(r["measured_over_ideal"], ".2f"), ident,
                      f(r["median_divergence"], "g")])
    print_table(cols, table, file=console.file, right=[c for c in cols if c not in ("config", "exactness", "category")],
                title="localspec bench (speedup = median of per-prompt tok/s ratios vs the interleaved baseline)")
    oracle = [r for r in rows if r.get("oracle") is not None]
    if oracle:  # auto against the best fixed configuration of the same run
        print_table(["category", "auto", "best fixed", "its speedup", "auto / best"],
                    [[r["category"], f(r["speedup_median"], ".2f"), r["oracle"], f(r["oracle_speedup"], ".2f"),
                      f(r["auto_over_oracle"], ".2f")] for r in oracle], file=console.file,
                    right=["auto", "its speedup", "auto / best"], title="auto vs the best fixed setting (oracle)")
    used = [(r["config"], m, c) for r in rows if r["category"] == "all" for m, c in r.get("sources", {}).items()]
    if used:  # which source drafted under each configuration, over every prompt
        print_table(["config", "source", "steps", "drafted", "accepted", "accept"],
                    [[cfg, m, str(c["steps"]), f(c["drafted"], "d"), f(c["accepted"], "d"),
                      f(c["acceptance_rate"], ".0%")] for cfg, m, c in used], file=console.file,
                    right=["steps", "drafted", "accepted", "accept"], title="drafting sources (all categories)")
    hybrid = [r for r in rows if r.get("rollback") not in (None, "", "kv") and r["method"] != "none"]
    for r in hybrid:
        console.print(f"rollback {r['config']} {r['category']}: {r['rollback']}, "
                      f"{r['replayed_per_100']:.1f} tokens replayed per 100 generated")
    console.print(bars([r for r in rows if r["method"] != "none"]))
    for r in rows:
        if r["category"] == "all":
            continue  # each divergence once, under its own category
        for m in r["mismatches"]:
            why = ("numeric: a near-tie flipped by float reduction order" if m["kind"] == "numeric"
                   else "[red]BUG[/red]: float order cannot flip a margin that wide")
            console.print(f"divergence {r['config']} on {m['prompt']}: first different token at {m['position']}, target "
                          f"top-2 margin there {m['margin']:.4g}, measured batch deviation {m['deviation']:.4g} -> {why}")
