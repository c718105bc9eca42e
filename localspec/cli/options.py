"""What every command shares: the option types for settings, how the CLI words a setting, the error line, and
two patches that make typer/rich help and pipes behave."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from localspec import settings as config
from localspec.defaults import METHODS
from localspec.errors import UsageError


def _plain_type_names() -> None:
    """Help shows TEXT / N / X / PATH, not typer's internal type names (`<bool>`, `<str>`, `<list[str]>`)."""
    try:
        from typer.core import _TyperParameter
    except ImportError:  # pragma: no cover - other typer versions print click's own metavars
        return
    orig = getattr(_TyperParameter, "display_type", None)
    if orig is None or getattr(orig, "_localspec", False):
        return
    names = {"<bool>": None, "<str>": "TEXT", "<int>": "N", "<float>": "X", "<list[str]>": "TEXT", "<path>": "PATH",
             "<Path>": "PATH"}

    def display_type(self, ctx):
        label = orig(self, ctx)
        if getattr(self, "is_flag", False):
            return None
        return names.get(label, label.strip("<>").upper() if isinstance(label, str) else label)

    display_type._localspec = True
    _TyperParameter.display_type = display_type


_plain_type_names()


def _rich_pipe_is_quiet() -> None:
    """rich ends the process with exit 1 when stdout's reader goes away (`localspec --help | head -1`); a closed
    pipe is the reader's choice, not an error: raise BrokenPipeError so main() ends quietly like for the answer."""
    from rich.console import Console

    def on_broken_pipe(self) -> None:
        quiet_pipe()
        raise BrokenPipeError

    Console.on_broken_pipe = on_broken_pipe


_rich_pipe_is_quiet()


def quiet_pipe() -> None:
    """stdout's reader went away: send what is left to /dev/null so the interpreter's last flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def err(msg: str) -> None:
    from localspec.printable import printable

    sys.stderr.write(f"error: {printable(msg)}\n")  # messages quote file names and model files' strings
    sys.stderr.flush()


# how the CLI names a setting in an error message (the library names the setting itself)
SETTING_WORDS = {"draft_tokens": "-k", "max_tokens": "-n", "ctx_size": "-c", "draft": "-d PATH or a pair with a draft"}


def setting_words(key: str) -> str:
    return SETTING_WORDS.get(key) or "--" + key.replace("_", "-")


# ----------------------------------------------------------------- shared options
def _setting_help(key: str, text: str | None = None) -> str:
    typ, default, desc = config.SETTINGS[key]
    shown = {None: None}.get(default, default)
    d = f" (default: {shown})" if shown not in (None, "") else ""
    return (text or desc[0].upper() + desc[1:] + ".") + d


def _opt(key: str, *names: str, help: str | None = None, typ=None):
    """An option for a setting: None when not given (so env, config file, tune results and pair defaults apply);
    the help shows the built-in default."""
    t = typ or config.SETTINGS[key][0]
    return Annotated[Optional[t], typer.Option(*names, help=_setting_help(key, help), show_default=False, metavar=_META[t])]


_META = {str: "TEXT", int: "N", float: "X"}

ModelOpt = _opt("model", "-m", "--model", help="Pair name, GGUF path, hf://OWNER/REPO/FILE.gguf, OWNER/REPO[:QUANT] or ollama:NAME[:TAG].")
DraftOpt = _opt("draft", "-d", "--draft", help="Draft GGUF path, hub name, or a pair name (its draft).")
MethodOpt = _opt("method", "--method", help="How to speculate: " + " | ".join(METHODS) + ".")
KOpt = _opt("draft_tokens", "-k", "--draft-tokens", help="Draft tokens per step (auto: the most it may use; twice that, at most 8, where it repeats earlier text from the suffix cache); default: the pair's k, else 4.")
TempOpt = _opt("temperature", "-t", "--temperature", "--temp", help="Sampling temperature; 0 = greedy.")
SystemOpt = _opt("system", "-s", "--system", help="System prompt.")
MaxTokOpt = _opt("max_tokens", "-n", "--max-tokens", help="Most tokens to generate.")
CtxOpt = _opt("ctx_size", "-c", "--ctx-size", help="Context size in tokens; default: the pair's, else 4096.")
GpuOpt = _opt("gpu_layers", "-ngl", "--gpu-layers", "--n-gpu-layers", help="Target layers offloaded to the GPU (-1 = all; default: all when llama.cpp has a GPU, else 0).")
DraftGpuOpt = _opt("draft_gpu_layers", "--draft-gpu-layers", "-ngld", help="Draft layers offloaded to the GPU (-1 = all; default: all when llama.cpp has a GPU, else 0).")
ThreadsOpt = _opt("threads", "--threads", help="CPU threads; default: all cores.")
ExactnessOpt = _opt("exactness", "--exactness", help="Exactness level: auto | bit | lossless (see the README, Exactness).")
RpcOpt = _opt("rpc", "--rpc", help="llama.cpp RPC workers HOST:PORT[,...] for the target's layers (`localspec worker`); the draft stays local.")
SplitOpt = _opt("tensor_split", "--tensor-split", help="With --rpc: share of the target's layers per worker, e.g. 3,1.")
NoPromptCacheOpt = Annotated[bool, typer.Option("--no-prompt-cache", help="Neither restore nor keep prompt states on disk (or set prompt_cache = false).")]
TemplateOpt = Annotated[Optional[Path], typer.Option("--chat-template", help="Jinja chat template file to use instead of the model's.", show_default=False, metavar="FILE")]


def use_template(sess, path: Optional[Path]) -> None:
    """--chat-template: read (and check) the file before any model loads."""
    if path is not None:
        from localspec.core.chat_template import read_template_file

        sess.chat_template = read_template_file(path)


def flags(**kw) -> dict:
    """The options the user actually gave (None = not given)."""
    return {k: v for k, v in kw.items() if v is not None}



def read_stdin() -> str | None:
    if sys.stdin is None or sys.stdin.isatty():
        return None
    try:
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read standard input: {exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("standard input is not UTF-8 text") from None



class CliState:
    """What one `localspec` invocation carries between its command and main(): --debug, whether the command
    already reported an interruption itself (its partial answer and summary), and the exit code for it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.debug = False
        self.interrupt_reported = False
        self.interrupt_exit = 130  # 128 + the signal that stopped us (SIGINT 130, SIGHUP 129, SIGTERM 143)
        self.signals = 0  # stop signals received


state = CliState()
