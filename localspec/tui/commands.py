"""The chat's slash commands: the table /help, the command palette and docs/chat.md list, one small handler per
command, and the palette's provider. A handler parses its argument and asks the session to make the change; the
session checks the value (as it checks a flag), so nothing here re-decides what a valid method, k or temperature
is. A setting's error is worded with the chat's own commands (`/k`, not `-k` or draft_tokens)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from textual.command import DiscoveryHit, Hit, Hits, Provider

from localspec.defaults import EXACTNESS, METHODS
from localspec.errors import LocalspecError, SettingError, UsageError
from localspec.store.cachefile import atomic_write
from localspec.tui.widgets.transcript import Transcript

# every slash command: (command, argument, what it does); /help, the command palette and docs/chat.md list these
SLASH = [
    ("/help", "", "list the commands and keys"),
    ("/method", "|".join(METHODS), "how to speculate"),
    ("/k", "N", "draft tokens per step (auto: the most it may use; 2x, at most 8, repeating earlier text)"),
    ("/exactness", "|".join(EXACTNESS), "bit: identical to plain decoding; lossless: k uncapped (see the README, Exactness)"),
    ("/temp", "F", "temperature (0 = greedy: the same answer every time)"),
    ("/system", "TEXT", "system prompt (empty: none)"),
    ("/new", "", "start a new chat (also /clear)"),
    ("/history", "", "list stored chats"),
    ("/load", "ID", "switch to a stored chat"),
    ("/rename", "TITLE", "rename this chat"),
    ("/delete", "", "delete this chat from the history (asks)"),
    ("/save", "PATH", "write this chat as .md or .json (asks before overwriting)"),
    ("/model", "NAME|PATH", "switch to another pair or model"),
    ("/compare", "", "rerun the last prompt with plain decoding: speed (and output at temperature 0) compared"),
    ("/quit", "", "quit (also /exit, /bye)"),
]
QUIT_COMMANDS = ("/quit", "/exit", "/bye")
KEYS_HELP = ("keys: Enter send · Shift+Enter / Ctrl+J new line · Up earlier prompts · Esc / Ctrl+C stop · "
             "F2 colours in finished answers · F3 details · F4 stats panel · Ctrl+P commands · Ctrl+Q quit")
HELP = "commands:\n" + "\n".join(f"  {(c + ' ' + a).strip():<32} {h}" for c, a, h in SLASH) + "\n" + KEYS_HELP

# the setting each command changes; an error about a setting names the command (draft_tokens -> /k)
COMMAND_SETTINGS = {"/method": "method", "/k": "draft_tokens", "/exactness": "exactness", "/temp": "temperature",
                    "/system": "system", "/model": "model"}
SETTING_WORDS = {key: cmd for cmd, key in COMMAND_SETTINGS.items()}
# the values a command takes, offered by the command palette
CHOICES = {"/method": METHODS, "/exactness": EXACTNESS}


def error_text(exc: LocalspecError, cmd: str | None = None) -> str:
    """An error as the chat shows it: settings named by their commands; a setting's error from a command that does
    not name it otherwise says which command it answers."""
    if not isinstance(exc, SettingError) or not exc.settings:
        return str(exc)
    text = exc.worded(SETTING_WORDS)
    if cmd and cmd not in text:
        text = f"{cmd}: {text}"
    return text


# ------------------------------------------------------------------ handlers: (app, argument) -> None
def help_table():
    """HELP as two columns: a description too long for the window wraps in its own column."""
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True)
    table.add_column()
    for cmd, arg, help_text in SLASH:
        table.add_row(Text((cmd + " " + arg).strip()), Text(help_text))
    out = Table.grid()
    out.add_row(Text("commands:"))
    out.add_row(Padding(table, (0, 0, 0, 2)))
    out.add_row(Text(KEYS_HELP))
    return out


def show_help(app, arg: str) -> None:
    app.query_one(Transcript).add("help", HELP, body=help_table())


def set_method(app, arg: str) -> None:
    app.change_setting("method", arg)


def set_exactness(app, arg: str) -> None:
    app.change_setting("exactness", arg)
    app.notify(f"exactness {arg} from the next answer")  # the header does not show it


def set_k(app, arg: str) -> None:
    try:
        k = int(arg)
    except ValueError:
        raise UsageError("/k takes a whole number >= 0") from None
    app.change_setting("draft_tokens", k)


def set_temp(app, arg: str) -> None:
    try:
        t = float(arg)
    except ValueError:
        raise UsageError("/temp takes a number >= 0") from None
    app.change_setting("temperature", t)


def set_system(app, arg: str) -> None:
    app.change_setting("system", arg or None)
    app.notify("system prompt " + ("set" if arg else "cleared"))


def not_while_generating(app) -> None:
    if app.generating:
        raise UsageError("stop the answer first (Esc)")


def not_while_busy(app) -> None:
    """Commands that replace the chat wait for the answer, and for a prompt waiting for the models (it would land
    in another chat than the one it was typed in)."""
    not_while_generating(app)
    if app.waiting is not None:
        raise UsageError("a prompt waits for the models: wait for its answer, or Esc takes it back")


def new_chat(app, arg: str) -> None:
    not_while_busy(app)
    app.new_chat()


def show_history(app, arg: str) -> None:
    app.need_history()
    chats = app.store.chats(limit=30)
    if not chats:
        app.query_one(Transcript).add("history", "no stored chats yet")
        return
    lines = ["stored chats (newest first; /load N opens one):"]
    for c in chats:
        mark = "*" if c.id == app.chat_id else " "
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
        lines.append(f"{mark}{c.id:>4}  {when}  {c.n_messages:>3} msgs  {c.title}")
    app.query_one(Transcript).add("history", "\n".join(lines))


def load_chat(app, arg: str) -> None:
    if not arg.isdigit():
        raise UsageError("/load takes a chat number (/history lists them)")
    not_while_busy(app)
    app.need_history()
    app.open_chat(int(arg))
    if app.engine is not None:
        app.warm_cache(app.chat_id, app.chat_messages())


def rename_chat(app, arg: str) -> None:
    app.need_history()
    if app.chat_id is None:
        raise UsageError("nothing to rename yet: this chat is stored once you send a message")
    app.store.rename(app.chat_id, arg)
    app.chat_title = " ".join(arg.split())
    app.notify(f"chat {app.chat_id} is now “{app.chat_title}”")


def delete_chat(app, arg: str) -> None:
    app.need_history()
    not_while_busy(app)
    if app.chat_id is None:
        raise UsageError("nothing to delete: this chat is not stored yet")
    chat_id, title = app.chat_id, app.chat_title

    def answer(yes: bool) -> None:
        if not yes:
            app.notify(f"chat {chat_id} kept")
            return
        try:
            app.store.delete(chat_id)
        except LocalspecError as exc:
            app.notify(f"history: {exc}", severity="error")
            return
        if app.chat_id == chat_id:
            app.new_chat()
        app.notify(f"chat {chat_id} deleted")

    app.ask(f"Delete chat {chat_id} “{title}” from the history? This cannot be undone.", answer)


def save_chat(app, arg: str) -> None:
    if not arg:
        raise UsageError("/save takes a path ending in .md or .json")
    path = Path(arg).expanduser()
    if path.suffix.lower() not in (".md", ".json"):
        raise UsageError("/save writes .md or .json files")
    from localspec.store.exports import to_json, to_markdown

    if path.suffix.lower() == ".json":
        content = to_json(transcript_data(app))
    else:  # an answer stopped inside a code block gets its closing fence
        content = to_markdown(f"localspec chat ({app.pair_name})", list(app.messages))

    def write(ok: bool = True) -> None:
        if not ok:
            app.notify(f"{path} not overwritten")
            return
        try:
            atomic_write(path, content)  # a crash mid-write leaves the old file, never half of one
            app.notify(f"saved {path}")
        except OSError as exc:
            app.notify(f"cannot write {path}: {exc.strerror or exc}", severity="error")

    if path.exists():
        app.ask(f"{path} exists. Overwrite it?", write)
    else:
        write()


def transcript_data(app) -> dict:
    return {"pair": app.pair_name,
            "settings": {k: app.s.get(k) for k in ("method", "draft_tokens", "temperature", "system")},
            "messages": list(app.messages)}


def switch_model(app, arg: str) -> None:
    if not arg:
        raise UsageError("/model takes a pair name or a GGUF path")
    not_while_generating(app)
    app.load_models(arg)  # a prompt waiting for the models waits for these


def compare(app, arg: str) -> None:
    if app.generating:
        raise UsageError("wait for the answer first")
    if app.loading:  # the rerun would use the model being replaced
        raise UsageError("wait for the models to load first")
    if app.last_result is None or len(app.messages) < 2:
        raise UsageError("nothing to compare yet: ask something first")
    # the conversation up to (not including) the last answer, rerun with plain decoding
    app.start_generation(app.chat_messages()[:-1], method="none", compare_with=app.last_result)


def quit_chat(app, arg: str) -> None:
    app.action_request_quit()


HANDLERS: dict[str, Callable[[object, str], None]] = {
    "/help": show_help,
    "/method": set_method,
    "/k": set_k,
    "/exactness": set_exactness,
    "/temp": set_temp,
    "/system": set_system,
    "/new": new_chat,
    "/clear": new_chat,
    "/history": show_history,
    "/load": load_chat,
    "/rename": rename_chat,
    "/delete": delete_chat,
    "/save": save_chat,
    "/model": switch_model,
    "/compare": compare,
    **{word: quit_chat for word in QUIT_COMMANDS},
}


def run_slash(app, text: str) -> None:
    """Run one slash command line; a UsageError says what was wrong (the caller shows it)."""
    cmd, _, arg = text.partition(" ")
    handler = HANDLERS.get(cmd)
    if handler is None:
        raise UsageError(f"unknown command {cmd}; /help lists them")
    try:
        handler(app, arg.strip())
    except SettingError as exc:
        raise UsageError(error_text(exc, cmd)) from exc
    if cmd not in QUIT_COMMANDS:
        app.refresh_header()


class SlashCommands(Provider):
    """The app's own commands in the command palette: one that takes an argument is put in the prompt box to be
    completed; one that does not runs at once. A search also offers each value of a command with choices
    (`/method lookup`), which runs at once."""

    def _action(self, cmd: str, arg: str):
        if arg:
            return lambda: self.app.prefill(cmd + " ")
        return lambda: self.app.run_command_text(cmd)

    async def discover(self) -> Hits:
        for cmd, arg, help_text in SLASH:
            yield DiscoveryHit(f"{cmd} {arg}".strip(), self._action(cmd, arg), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for cmd, arg, help_text in SLASH:
            label = f"{cmd} {arg}".strip()
            score = max(matcher.match(label), matcher.match(help_text) * 0.5)
            if score > 0:
                yield Hit(score, matcher.highlight(label), self._action(cmd, arg), help=help_text)
            for choice in CHOICES.get(cmd, ()):
                line = f"{cmd} {choice}"
                score = matcher.match(line)
                if score > 0:
                    yield Hit(score * 0.9, matcher.highlight(line), self._action(line, ""), help=help_text)
