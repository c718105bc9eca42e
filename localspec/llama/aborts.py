"""What happens when llama.cpp aborts the process (GGML_ABORT: a dead RPC worker, a failed assertion): hooks that
save work, then one `error:` line and exit 1. ggml.py installs `on_ggml_abort` as ggml's abort callback."""

from __future__ import annotations

import os
import re
import sys
from typing import Callable, Sequence

from localspec import rpcwire as rpc

# Hooks run when llama.cpp aborts the process (GGML_ABORT: a worker died mid-decode, a failed assertion). The
# process dies right after them: they must be quick and must not raise (exceptions are ignored).
_abort_hooks: list[Callable[[], None]] = []
rpc_in_use: list[str] = []  # endpoints of loaded models, for naming the worker that died


def on_abort(callback: Callable[[], None]) -> Callable[[], None]:
    """Run `callback` before the process dies of a llama.cpp abort (e.g. save the chat transcript).
    Returns it, so it works as a decorator. Adding one twice runs it once."""
    if callback not in _abort_hooks:
        _abort_hooks.append(callback)
    return callback


def abort_message(message: str, endpoints: Sequence[str]) -> str:
    """The one line a user sees for llama.cpp's abort `message`."""
    msg = " ".join(message.split())
    m = re.match(r"^\S+?:\d+: (.*)$", msg)  # ggml_abort prefixes "FILE:LINE: "
    core = m.group(1) if m else msg
    if endpoints and ("RPC" in msg or "connect" in msg or "handshake" in msg):
        dead = rpc.refusing(endpoints)
        who = ", ".join(dead or endpoints)
        s = "" if len(dead or endpoints) == 1 else "s"
        return (f"error: RPC worker{s} {who} stopped responding; the answer so far is kept; start the worker again "
                f"(localspec worker) and rerun (llama.cpp: {core})")
    return f"error: llama.cpp aborted: {core}"


def on_ggml_abort(message: bytes | None) -> None:
    """ggml_abort calls this (from whichever thread aborted) before abort(): flush, run the hooks, say one line,
    exit 1 (instead of a gdb backtrace, SIGABRT and a core dump)."""
    try:
        text = (message or b"").decode("utf-8", "replace")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        for hook in list(_abort_hooks):
            try:
                hook()
            except BaseException:
                pass
        try:
            sys.stdout.flush()
        except Exception:
            pass
        line = abort_message(text, list(rpc_in_use))
        lead = "\n" if sys.stdout.isatty() and sys.stderr.isatty() else ""
        os.write(2, (lead + line + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(1)
