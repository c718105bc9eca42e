"""`localspec models`: list, pull, remove, inspect and add model pairs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from localspec.errors import UsageError
from localspec.printable import printable

models_app = typer.Typer(help="List, download, inspect and add model pairs.", no_args_is_help=True)


@models_app.command("list")
def models_list(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
                local: Annotated[bool, typer.Option("--local", help="Only what is on this machine: downloaded pairs and hub models, and the GGUFs of Ollama, LM Studio and llama.cpp's cache.")] = False):
    """Pairs, and hub models fetched by name, whether downloaded, sizes and local paths. With --local, also the models
    other runners keep here (Ollama's store, LM Studio's folders, llama.cpp's download cache), read where they lie."""
    from localspec.models import download
    from localspec.models import hubname as hfname
    from localspec.models import registry

    pairs, default = registry.load()

    def facts(spec):
        lp = download.local_path(spec)
        return {"file": spec.label, "size": spec.size or (lp.stat().st_size if lp else None),
                "downloaded": lp is not None, "path": str(lp) if lp else None}

    rows = []
    for name, p in pairs.items():
        entry = {"name": name, "default": name == default, "description": p.description, "k": p.k, "source": p.source}
        for role, spec in (("target", p.target), ("draft", p.draft)):
            entry[role] = None if spec is None else facts(spec)
        rows.append(entry)
    in_pairs = {r[role]["path"] for r in rows for role in ("target", "draft") if r[role] and r[role]["path"]}
    for name, spec in hfname.cached_models():  # fetched with -m OWNER/REPO:QUANT and not part of a pair
        f = facts(spec)
        if f["path"] not in in_pairs:
            rows.append({"name": name, "default": False, "description": "hub model", "k": None, "source": "hub cache",
                         "target": f, "draft": None})
    if local:
        rows = [r for r in rows if any(r[role] and r[role]["downloaded"] for role in ("target", "draft"))]
        from localspec.models import local as stores

        for m in stores.local_models(hf=False, every_tag=True):  # other runners' files: -m/-d take the name or the path
            f = {"file": m.path.name, "size": m.size, "downloaded": True, "path": str(m.path)}
            rows.append({"name": m.name, "default": False, "description": f"{m.source} model", "k": None,
                         "source": m.source, "target": f, "draft": None})
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    from localspec.cli.table import print_table

    def fmt(f):
        if f is None:
            return "[dim]- (lookup)[/dim]"
        size = f"{f['size'] / 1e9:.2f} GB" if f["size"] else "?"
        mark = "[green]✓[/green]" if f["downloaded"] else "[dim]·[/dim]"
        return f"{mark} {Path(f['file']).name} [dim]{size}[/dim]"

    table = []
    # names, paths and descriptions come from files (pairs.toml, the hub cache): no escapes reach the terminal
    for r in rows:
        paths = "\n".join(x["path"] for x in (r["target"], r["draft"]) if x and x["path"]) or "-"
        table.append([printable(r["name"]) + (" [bold](default)[/bold]" if r["default"] else ""),
                      printable(fmt(r["target"])), printable(fmt(r["draft"])), "-" if r["k"] is None else str(r["k"]),
                      printable(paths)])
    print_table(["pair", "target", "draft", "k", "local"], table, right=["k"])


@models_app.command("pull")
def models_pull(name: Annotated[str, typer.Argument(help="Pair name, or a hub model (OWNER/REPO:QUANT, hf://…).")],
                check: Annotated[bool, typer.Option("--check/--no-check", help="Check pair compatibility from the remote headers first.")] = True):
    """Download both files of a pair, or one hub model (progress, resume, sha256 check)."""
    from localspec.models import download
    from localspec.models import hubname as hfname
    from localspec.models import registry

    kind, obj = registry.resolve_name(name)
    if kind == "hub":
        sys.stderr.write(f"model: {printable(download.ensure(hfname.resolve(obj)))}\n")
        return
    if kind == "path":
        from localspec.models.spec import is_file, shown

        raise UsageError(f"{shown(name)} is a local file: nothing to pull" if is_file(obj, name)
                         else f"no such file: {shown(name)}")
    pair = obj
    if check and pair.draft is not None and not download.offline():
        _remote_compat(pair)
    for role, spec in (("target", pair.target), ("draft", pair.draft)):
        if spec is None:
            continue
        path = download.ensure(spec)
        sys.stderr.write(f"{role}: {printable(path)}\n")


def _remote_compat(pair) -> None:
    """Pair check on the GGUF headers, read remotely (HTTP range requests) before fetching gigabytes."""
    from localspec.models import remote

    why = remote.remote_incompatibility(pair.target, pair.draft)
    if why:
        raise UsageError(f"pair {pair.name} cannot speculate: {why} (nothing was downloaded)")


@models_app.command("rm")
def models_rm(name: Annotated[str, typer.Argument(help="Pair name, or a downloaded hub model (OWNER/REPO:QUANT, hf://…).")],
              yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
              keep_files: Annotated[bool, typer.Option("--keep-files", help="Remove your pair's entry only.")] = False,
              files_only: Annotated[bool, typer.Option("--files-only", help="Delete the downloaded files only; keep your pair.")] = False):
    """Remove a pair you added: its entry in pairs.toml and its downloaded files (asks first). For a shipped pair or
    a hub model, delete the downloaded files. Your own local files, and files another pair uses, are never deleted."""
    from localspec.models import download
    from localspec.models import hubname as hfname
    from localspec.models import registry

    if keep_files and files_only:
        raise UsageError("--keep-files and --files-only exclude each other")
    pairs, _ = registry.load()
    if name in pairs:
        user = pairs[name].source != "shipped"
        specs = [pairs[name].target, pairs[name].draft]
    else:
        from localspec.models import local as stores
        from localspec.models.spec import shown

        if stores.is_ollama_name(name):
            raise UsageError(f"{shown(name)} is a model in Ollama's store, not a pair: localspec never deletes "
                             f"another runner's files (`ollama rm {shown(name[len(stores.OLLAMA_PREFIX):])}` does)")
        hub = hfname.parse(name)
        if hub is None:
            if registry.looks_like_path(name):
                raise UsageError(f"{shown(name)} is a path, not a pair or a hub model: `models rm` removes those, "
                                 "never a file named by its path")
            registry.get(name)  # the unknown-pair error, with suggestions where a pair's name is close
        user, specs = False, [hfname.cached_spec(hub)]
    if keep_files and not user:
        raise UsageError(f"{name} is not a pair you added: there is no entry to remove, only files")
    drop_entry = user and not files_only
    others = {download.local_path(s) for n, p in pairs.items() if n != name for s in (p.target, p.draft) if s is not None}
    present, shared = [], []
    for s in specs:
        lp = None if keep_files or s is None or s.path else download.local_path(s)
        if lp is not None:
            (shared if lp in others else present).append((s, lp))

    def keeping() -> None:
        for _, lp in shared:
            sys.stderr.write(f"keeping {printable(lp)}: another pair uses it\n")

    if not present and not drop_entry:
        keeping()
        sys.stderr.write(f"{name}: nothing {'else ' if shared else ''}downloaded\n")
        return
    what = [f"remove pair {name} from {registry.user_pairs_file()}"] if drop_entry else []
    if present:
        size = sum(lp.stat().st_size for _, lp in present)
        what.append(f"delete {len(present)} downloaded file(s), {size / 1e9:.2f} GB")
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(f"refusing to {' and '.join(what)} without confirmation; pass --yes")
        if not typer.confirm(" and ".join(what) + "?", err=True):
            raise typer.Exit(1)
    keeping()
    if drop_entry:
        registry.remove(name)
        sys.stderr.write(f"removed pair {name}\n")
    for s, _ in present:
        for p in download.remove(s):
            sys.stderr.write(f"removed {printable(p)}\n")


@models_app.command("info")
def models_info(what: Annotated[str, typer.Argument(help="Pair name or GGUF path.")],
                as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False):
    """GGUF facts (architecture, size, quantization, context, vocab) and the pair's compatibility verdict."""
    from localspec.models import download
    from localspec.models import registry
    from localspec.models import rollback
    from localspec.models.gguf_header import drafter_kind, drafter_words, read_file_metadata, summary

    from localspec.models import local as stores

    files: dict[str, Path] = {}
    if stores.is_ollama_name(what):
        files["model"] = stores.ollama_path(what)
    elif registry.looks_like_path(what):
        from localspec.models.spec import is_file, shown, user_path

        p = user_path(what)
        if not is_file(p, what):
            raise UsageError(f"no such file: {shown(what)}")
        files["model"] = p
    else:
        pair = registry.get(what)
        for role, spec in (("target", pair.target), ("draft", pair.draft)):
            if spec is not None:
                lp = download.local_path(spec)
                if lp is None:
                    raise UsageError(f"{what}: {role} {spec.label} is not downloaded; run `localspec models pull {what}`")
                files[role] = lp
    out, metas = {}, {}
    for role, p in files.items():
        metas[role] = read_file_metadata(p)
        kind = drafter_kind(metas[role])
        out[role] = {"path": str(p), "size": p.stat().st_size, **summary(metas[role]),
                     "rollback": rollback.kind_for_arch(str(metas[role].get("general.architecture", ""))),
                     "drafter": kind or ("draft model" if role == "draft" else None)}
    if "draft" in metas:
        from localspec.models.gguf_header import pair_kind

        kind, why = pair_kind(metas["target"], metas["draft"])
        out["compatible"] = kind is not None
        out["difference"] = why
        out["drafting"] = kind  # same-vocab, cross-vocab (through text), head; None: it cannot draft
    if as_json:
        typer.echo(json.dumps(out, indent=1))
        return
    for role, facts in out.items():  # every value is read from a file: shown without control characters
        if isinstance(facts, dict):
            typer.echo(f"{role}:")
            for k, v in facts.items():
                if k == "drafter":
                    v = drafter_words(metas[role], role)
                typer.echo(printable(f"  {k}: {rollback.WORDS.get(v, v) if k == 'rollback' else v}"))
    if "compatible" in out:
        from localspec.models.pair import KIND_WORDS

        if not out["compatible"]:
            verdict = f"INCOMPATIBLE: {out['difference']}"
        elif out["drafting"] == "cross-vocab":
            verdict = f"compatible, drafts through text (another vocabulary: {out['difference']})"
        else:
            verdict = f"compatible, drafts with the {KIND_WORDS[out['drafting']]}" if out["drafting"] != "head" \
                else "compatible, drafts as a head on the target's hidden states"
        typer.echo(printable("pair: " + verdict))


@models_app.command("add")
def models_add(
    name: Annotated[str, typer.Argument(help="A name for the pair.")],
    target: Annotated[str, typer.Option("--target", help="Local path, hf://OWNER/REPO/FILE.gguf or OWNER/REPO[:QUANT]")],
    draft: Annotated[Optional[str], typer.Option("--draft", help="Local path, hf://OWNER/REPO/FILE.gguf or OWNER/REPO[:QUANT]")] = None,
    k: Annotated[int, typer.Option("-k", help="Default draft tokens.")] = 4,
    ctx: Annotated[int, typer.Option("--ctx", help="Default context size.")] = 4096,
    description: Annotated[str, typer.Option("--description", help="A line shown by `localspec models list`.")] = "",
):
    """Add your own pair (stored in your user config, never in the shipped file). Names: letters, digits, . - _"""
    from localspec.models import hubname as hfname
    from localspec.models import local, registry, remote

    registry.check_name(name)
    t = hfname.file_spec(target, local.ollama_file)
    d = hfname.file_spec(draft, local.ollama_file) if draft else None
    from localspec.models.gguf_header import drafter_kind, pair_incompatibility

    metas = remote.header_metadata(t, d) if d is not None else remote.header_metadata(t)  # local or remote
    why = pair_incompatibility(*metas) if metas is not None and d is not None else None
    if why:
        sys.stderr.write(printable(f"warning: this draft cannot speculate for the target ({why}); `run` will use "
                                   "prompt lookup") + "\n")
    path = registry.add(name, t, d, k=k, ctx=ctx, description=description)
    if metas is None:
        kind = "unknown (the headers could not be read now)"
    elif d is not None:
        from localspec.models.gguf_header import pair_kind
        from localspec.models.pair import KIND_WORDS

        how = pair_kind(*metas)[0]
        kind = drafter_kind(metas[1]) or ("draft model" + (f", {KIND_WORDS[how]}" if how == "cross-vocab" else ""))
    else:
        kind = "mtp" if drafter_kind(metas[0]) == "mtp" else "prompt lookup"
    sys.stderr.write(printable(f"added pair {name} to {path} (drafter: {kind})") + "\n")



@models_app.command("pairs")
def models_pairs(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False):
    """Which of the models on this machine can draft for which, and how (same vocabulary, through text, head), from
    their GGUF headers alone: downloaded pairs and hub models, Ollama's store, LM Studio's folders, llama.cpp's cache."""
    from localspec.models import download
    from localspec.models import local as stores
    from localspec.models import registry

    models = stores.local_models()
    seen = {m.path.resolve() for m in models}
    pairs, _ = registry.load()
    for name, p in pairs.items():  # downloaded pair files too, named by the pair
        for role, spec in (("target", p.target), ("draft", p.draft)):
            lp = download.local_path(spec) if spec is not None else None
            if lp is not None and lp.resolve() not in seen:
                seen.add(lp.resolve())
                models.append(stores.LocalModel("pair", f"{name} ({role})", lp, lp.stat().st_size))
    rows, bad = stores.pairs(models)
    if as_json:
        typer.echo(json.dumps({"pairs": rows, "unreadable": bad}, indent=1))
        return
    for b in bad:
        sys.stderr.write(printable(f"skipped {b['path']}: {b['error']}") + "\n")
    if not rows:
        typer.echo(f"no pairs among the {len(models)} local model(s)")
        return
    from localspec.cli.table import print_table

    print_table(["target", "draft", "how", "draft size"],
                [[printable(r["target"]), printable(r["draft"]), r["how"],
                  f"{r['size_ratio']:.0%} of the target" if r["size_ratio"] is not None else "?"] for r in rows])
