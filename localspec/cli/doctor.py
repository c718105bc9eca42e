"""`localspec doctor`: versions, backends and devices, CPU features, cache, models and probes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from localspec import __version__
from localspec import settings as config


def doctor(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False):
    """Versions, compiled backends and devices, CPU features, threads, cache, models and exactness probes."""
    from localspec.models import download
    from localspec.models import registry
    from localspec.llama.sysinfo import hardware
    from localspec.core.exactness import cached_probes
    from localspec.core.verify_cost import cached_costs

    report: dict = {"localspec": __version__, "python": sys.version.split()[0]}
    report.update(hardware())
    notes = report.pop("notes")
    cd = download.cache_dir()
    report["cache_dir"] = str(cd)
    report["free_disk_gb"] = round(download.free_bytes(cd) / 1e9, 1)
    report["config_file"] = str(config.config_file())
    pairs, default = registry.load()
    report["models"] = {n: all(download.local_path(s) is not None for s in (p.target, p.draft) if s) for n, p in pairs.items()}
    report["exactness_probes"] = [
        {"model": p.get("model"), "llama_cpp": p.get("llama_cpp"), "threads": p.get("threads"), "gpu_layers": p.get("gpu_layers"),
         "kv_type": p.get("kv_type"), "long_prefix": p.get("long_prefix"), "exact_batch": p["batch"],
         "deviation": {str(b): v for b, v in sorted(p["deviation"].items())}, "current": p["current"]}
        for p in cached_probes()
    ]
    report["verify_costs"] = [  # what a verify batch of b rows costs in one-token decodes (the controller's start)
        {"model": c["model"], "threads": c["threads"], "gpu_layers": c["gpu_layers"],
         "ratio": {str(b): round(v, 3) for b, v in sorted(c["ratio"].items())},
         "measured": {str(b): round(v, 3) for b, v in sorted(c["measured"].items())},
         "scale": round(c["scale"], 3), "live_steps": c["live_steps"], "current": c["current"],
         "disturbed": c["disturbed"]}
        for c in cached_costs()
    ]
    from localspec.llama.ext import heads_available

    extra = {"dflash": " (DFlash and DSpark heads; DFlash2 heads are refused)", "dspark": " (as --method dflash)"}
    report["draft_heads"] = {h: (f"unavailable: {why}" if why is not None else "supported" + extra.get(h, ""))
                             for h, why in heads_available().items()}
    report["notes"] = notes
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    from localspec.printable import printable

    def say(line: str) -> None:  # device and model names come from drivers and files: no escapes reach the terminal
        typer.echo(printable(line))

    for k, v in report.items():
        if k in ("system_info", "notes", "models", "devices", "exactness_probes", "verify_costs", "draft_heads"):
            continue
        say(f"{k}: {', '.join(v) if isinstance(v, list) else v}")
    say(f"system_info: {report.get('system_info', '')}")
    for d in report["devices"]:
        mem = f"{d['memory_free'] / 2**30:.1f} of {d['memory_total'] / 2**30:.1f} GiB free" if d["memory_total"] else "memory n/a"
        say(f"device: {d['name']} ({d['type']}, {d['backend']}) {d['description']}: {mem}")
    say("models: " + ", ".join(f"{n} {'✓' if ok else '·'}" for n, ok in report["models"].items()))
    # an entry of an earlier version of a file, or of another build (a cache dir shared between machines), is never
    # used here: listed under the same file name it would read as this machine's figures
    for p in (p for p in report["exactness_probes"] if p["current"]):
        dev = " ".join(f"{b}:{v:.3g}" for b, v in p["deviation"].items()) or "-"
        say(f"exactness probe: {Path(p['model'] or '?').name} (threads {p['threads']}, gpu layers {p['gpu_layers']}, "
            f"kv {p['kv_type']}, llama-cpp-python {p['llama_cpp']}): bit-exact up to {p['exact_batch']} rows; "
            f"max |Δlogit| per batch size {dev}")
    for c in (c for c in report["verify_costs"] if c["current"]):
        costs = " ".join(f"{b}:{v:.2f}" for b, v in c["measured"].items())
        priced = " ".join(f"{b}:{v:.2f}" for b, v in c["ratio"].items() if b != "1")
        live = (f"; priced at the measured extra cost x {c['scale']:.2f} ({priced}), from {c['live_steps']} verify "
                "steps of earlier answers" if c["scale"] != 1.0 else f"; as measured, {c['live_steps']} verify steps "
                "of earlier answers agree" if c["live_steps"] else "")
        busy = ("; taken while the machine was busy (a batch read dearer than its rows one by one): priced at most "
                "at that bound, and measured again at a later load" if c["disturbed"] else "")
        say(f"verify cost: {Path(c['model'] or '?').name} (threads {c['threads']}, gpu layers {c['gpu_layers']}): "
            f"one-token decodes per batch size, measured {costs}{live}{busy}")
    other = [sum(not e["current"] for e in report[k]) for k in ("verify_costs", "exactness_probes")]
    if any(other):
        what = [f"{n} {w}{'s' if n != 1 else ''}" for n, w in zip(other, ("verify-cost calibration", "exactness probe"))]
        say(f"also kept: {' and '.join(what)} for other llama.cpp builds or earlier versions of their files, not "
            "used here")
    for h, state in report["draft_heads"].items():
        say(f"draft head {h}: {state}")
    for n in notes:
        say(f"note: {n}")

