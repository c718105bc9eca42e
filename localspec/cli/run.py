"""`localspec run`: one prompt, the answer streamed to stdout."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from typing import Annotated, Optional

import typer

from localspec.cli.options import (CtxOpt, DraftGpuOpt, DraftOpt, ExactnessOpt, GpuOpt, KOpt, MaxTokOpt, MethodOpt,
                                    ModelOpt, NoPromptCacheOpt, RpcOpt, SplitOpt, SystemOpt, TemplateOpt, TempOpt, ThreadsOpt, _opt, flags, read_stdin,
                                    state,
                                    use_template)
from localspec.cli.render import Status, result_json, short_summary, summary_line
from localspec.errors import UsageError
from localspec.seq import common_prefix

EPILOG = (
    "Examples:\n\n"
    "  localspec run \"Explain Python decorators\"\n\n"
    "  git diff | localspec run \"Write a commit message for this diff\"\n\n"
    "  localspec run -m ./model.gguf -d ./draft.gguf --method draft -k 4 \"hello\"\n\n"
    "  localspec run --json -n 64 \"List three primes\" | jq .tokens_per_second"
)


def json_object(sess, engine, fin, stats, cfg, **kw) -> dict:
    """`run --json`'s object. `draft` names the draft file, a draft head's too: the engine holds a head (EAGLE-3,
    DFlash, DSpark) on the target's context rather than as a draft model, so its file is the one the session loaded."""
    d = result_json(fin, stats, engine, cfg, **kw)
    if d.get("draft") is None and getattr(engine, "draft_kind", None) == "head" and sess.draft_path is not None:
        d["draft"] = sess.draft_path.name
    return d


def run(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt. Piped stdin comes first, then a blank line, then PROMPT.", show_default=False)] = None,
    model: ModelOpt = None,
    draft: DraftOpt = None,
    method: MethodOpt = None,
    draft_tokens: KOpt = None,
    exactness: ExactnessOpt = None,
    p_min: _opt("p_min", "--p-min", help="The draft model stops drafting when its top probability falls below this.") = None,
    lookup_min: _opt("lookup_min", "--lookup-min", help="Shortest n-gram for prompt lookup.") = None,
    lookup_max: _opt("lookup_max", "--lookup-max", help="Longest n-gram for prompt lookup.") = None,
    max_tokens: MaxTokOpt = None,
    temperature: TempOpt = None,
    top_k: _opt("top_k", "--top-k", help="Sample from the k most likely tokens only; 0 = off.") = None,
    top_p: _opt("top_p", "--top-p", help="Nucleus sampling; 1 = off.") = None,
    min_p: _opt("min_p", "--min-p", help="Drop tokens below this fraction of the top probability; 0 = off.") = None,
    seed: _opt("seed", "--seed", help="Sampling seed (0 to 2^63-1); default: random.") = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop at this text (repeatable).", show_default=False)] = None,
    system: SystemOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template: the prompt goes in as-is.")] = False,
    chat_template: TemplateOpt = None,
    ctx_size: CtxOpt = None,
    gpu_layers: GpuOpt = None,
    draft_gpu_layers: DraftGpuOpt = None,
    threads: ThreadsOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="Nothing on stderr but errors.")] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="The full breakdown at the end (timings, steps, k, controller).")] = False,
    no_stream: Annotated[bool, typer.Option("--no-stream", help="Print the answer at the end.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout at the end.")] = False,
    no_prompt_cache: NoPromptCacheOpt = False,
):
    """Answer one prompt (stdin is joined to it), streaming to stdout."""
    from localspec.session import Session, generation_slot

    sess = Session(flags(
        model=model, draft=draft, method=method, draft_tokens=draft_tokens, exactness=exactness, p_min=p_min, lookup_min=lookup_min,
        lookup_max=lookup_max, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        seed=seed, system=system, ctx_size=ctx_size, gpu_layers=gpu_layers, draft_gpu_layers=draft_gpu_layers, threads=threads,
        rpc=rpc, tensor_split=tensor_split, prompt_cache=False if no_prompt_cache else None,
    ), quiet=quiet)
    sess.prompt_states = True
    piped = read_stdin()
    parts = [p for p in (piped, prompt) if p is not None and p.strip() != ""]
    if not parts:
        raise UsageError("no prompt: pass PROMPT or pipe text on stdin (see localspec run --help)")
    text = "\n\n".join(parts)
    status = Status(quiet)
    from localspec.llama.aborts import on_abort

    sess.check()  # bad sampling/k/thread values fail before loading gigabytes
    use_template(sess, chat_template)
    if sys.stderr.isatty():
        sess.announce = status.info
    engine = sess.load()
    try:
        s = sess.values()
        gen_cfg = sess.gen_config(stop)
        for note in sess.notices():
            if raw and note == engine.template_warning:
                continue  # a raw prompt uses no template
            status.info(f"warning: {note}")
        def render(text: str) -> list[int]:
            if raw:
                return engine.raw_prompt(text)
            system = [{"role": "system", "content": s["system"]}] if s["system"] else []
            return engine.chat_prompt(system + [{"role": "user", "content": text}])

        tokens = render(text)
        if len(parts) == 2:  # piped text and a question: the next question about the same text shares the text's state
            gen_cfg = dataclasses.replace(gen_cfg, shared_upto=min(
                common_prefix(tokens, render(piped + "\n\n" + other)) for other in ("0", "1")))
        stream = not (no_stream or as_json)
        out = sys.stdout
        resp = engine.respond(tokens, gen_cfg)  # its text so far is kept when interrupted
        printed = []  # set once the answer is out (the abort hook then has nothing to do)

        def keep_the_answer() -> None:
            """llama.cpp aborts the process (an RPC worker died): --json and --no-stream print what they have."""
            status.clear()  # the error line that follows must not land on the end of the live status line
            if printed or stream:
                return
            partial = resp.so_far
            if as_json:
                d = json_object(sess, engine, None, resp.stats, gen_cfg, interrupted=True, text=partial)
                out.write(json.dumps(d | {"finish_reason": "error"}) + "\n")
            else:
                out.write(partial + ("" if partial.endswith("\n") else "\n"))
            out.flush()

        on_abort(keep_the_answer)
        with contextlib.ExitStack() as slot:
            try:
                slot.enter_context(generation_slot(waiting=None if quiet else status.info))
            except KeyboardInterrupt:  # no answer begun: say what the stop ended (even with -q: it is the outcome)
                state.interrupt_reported = True
                sys.stderr.write("interrupted while waiting for another localspec generation to finish\n")
                sys.stderr.flush()
                raise typer.Exit(state.interrupt_exit) from None
            status.start(lambda: resp.stats)
            try:
                for piece in resp:
                    if stream and piece.text:
                        out.write(piece.text)
                        out.flush()
                    status.update(resp.stats)
            except KeyboardInterrupt:
                state.interrupt_reported = True
                status.stop()
                stats = resp.stats
                partial = resp.so_far
                printed.append(True)
                if stream:
                    out.write("\n")
                elif as_json:
                    out.write(json.dumps(json_object(sess, engine, None, stats, gen_cfg, interrupted=True, text=partial)) + "\n")
                else:
                    out.write(partial + ("" if partial.endswith("\n") else "\n"))
                out.flush()
                if not quiet and stats is not None:
                    sys.stderr.write((summary_line if verbose else short_summary)(stats, "interrupted") + "\n")
                raise typer.Exit(state.interrupt_exit)
            finally:
                status.stop()
        fin = resp.finished
        stats = fin.stats
        printed.append(True)
        if as_json:
            out.write(json.dumps(json_object(sess, engine, fin, stats, gen_cfg)) + "\n")
        elif stream:
            if not fin.text.endswith("\n"):
                out.write("\n")
        else:
            out.write(fin.text + ("" if fin.text.endswith("\n") else "\n"))
        out.flush()
        if not quiet:
            sys.stderr.write((summary_line if verbose else short_summary)(stats, fin.finish_reason) + "\n")
    finally:
        sess.close()

