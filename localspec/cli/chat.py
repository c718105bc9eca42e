"""`localspec chat`: the terminal chat app on a session, with the stored history."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from localspec.cli.history import _history, chat_id_in_range
from localspec.cli.options import (CtxOpt, DraftGpuOpt, DraftOpt, ExactnessOpt, GpuOpt, KOpt, MaxTokOpt, MethodOpt,
                                    ModelOpt, NoPromptCacheOpt, RpcOpt, SplitOpt, SystemOpt, TemplateOpt, TempOpt, ThreadsOpt, flags,
                                    use_template)
from localspec.errors import UsageError


def chat(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    method: MethodOpt = None,
    draft_tokens: KOpt = None,
    temperature: TempOpt = None,
    system: SystemOpt = None,
    max_tokens: MaxTokOpt = None,
    exactness: ExactnessOpt = None,
    ctx_size: CtxOpt = None,
    gpu_layers: GpuOpt = None,
    draft_gpu_layers: DraftGpuOpt = None,
    threads: ThreadsOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
    cont: Annotated[bool, typer.Option("--continue", help="Reopen the most recent stored chat.")] = False,
    resume: Annotated[Optional[int], typer.Option("--resume", help="Reopen stored chat ID (`localspec history list`).", show_default=False, callback=chat_id_in_range)] = None,
    no_history: Annotated[bool, typer.Option("--no-history", help="Store nothing (or set history = false in the config).")] = False,
    chat_template: TemplateOpt = None,
    no_prompt_cache: NoPromptCacheOpt = False,
):
    """Chat in the terminal, with live speculation statistics. Chats are stored as they happen (`localspec history`)."""
    from localspec.store.history import History
    from localspec.session import Session
    from localspec.tui.app import create_app

    sess = Session(flags(model=model, draft=draft, method=method, draft_tokens=draft_tokens, temperature=temperature,
                         system=system, max_tokens=max_tokens, ctx_size=ctx_size, gpu_layers=gpu_layers,
                         draft_gpu_layers=draft_gpu_layers, threads=threads, history=False if no_history else None,
                         exactness=exactness, rpc=rpc, tensor_split=tensor_split,
                         prompt_cache=False if no_prompt_cache else None),
                   quiet=True)
    sess.prompt_states = True
    sess.check()
    use_template(sess, chat_template)
    if cont and resume is not None:
        raise UsageError("--continue reopens the latest chat and --resume ID a given one: use one of them")
    if (cont or resume is not None) and not sess["history"]:
        raise UsageError("--continue and --resume read the history, which is off (--no-history or history = false)")
    chat_id = None
    if cont or resume is not None:
        store = _history(create=False)
        chat_id = store.latest() if cont else store.get(resume).id
        if chat_id is None:
            raise UsageError("no stored chat to continue yet")
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("chat needs a terminal (stdin and stdout); for pipes and scripts use `localspec run`")
    store = History() if sess["history"] else None
    try:
        create_app(sess, store=store, resume=chat_id).run()
    finally:
        if store is not None:
            store.close()
