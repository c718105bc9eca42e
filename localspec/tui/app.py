"""The chat app. Generation runs in a thread worker that only posts messages and checks cancellation;
`create_app` is the one factory shared by the CLI and the tests."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Label, LoadingIndicator

from localspec.store.cachefile import atomic_write
from localspec.errors import LocalspecError, UsageError
from localspec.tui.widgets.header_bar import HeaderBar
from localspec.tui.widgets.prompt_box import PromptBox
from localspec.tui.widgets.stats_panel import StatsPanel, rate_text
from localspec.tui.widgets.transcript import Transcript
from localspec.tui.widgets.welcome import Welcome

# every slash command: (command, argument, what it does); /help, the command palette and the README list these
SLASH = [
    ("/help", "", "list the commands and keys"),
    ("/method", "auto|draft|lookup|none", "how to speculate"),
    ("/k", "N", "draft tokens per step (auto: the most it may use)"),
    ("/exactness", "auto|bit|lossless", "bit: identical to plain decoding; lossless: k uncapped (see README)"),
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
PANEL_MIN_WIDTH = 100  # below this many columns the stats panel hides itself (F4 shows it)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question whose safe answer is the default: No has the focus and Esc answers No. Keys typed while
    it is open (the user already typing the next prompt) are kept in `typed`, for the prompt box."""

    BINDINGS = [Binding("escape", "answer_no", "No", priority=True)]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question
        self.typed = ""

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Label(self.question)
            with Horizontal():
                yield Button("Yes", id="yes", variant="error")
                yield Button("No", id="no", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_key(self, event) -> None:
        if event.is_printable and event.character:
            self.typed += event.character
            event.stop()
            event.prevent_default()

    def action_answer_no(self) -> None:
        self.dismiss(False)

    @on(Button.Pressed)
    def done(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class SlashCommands(Provider):
    """The app's own commands in the command palette: one that takes an argument is put in the prompt box to be
    completed; one that does not runs at once."""

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


class LocalspecApp(App):
    CSS_PATH = "localspec.tcss"
    TITLE = "localspec"
    COMMANDS = App.COMMANDS | {SlashCommands}
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+c", "stop", "Stop", priority=True, show=False),
        Binding("f2", "toggle_colors", "Colours"),
        Binding("f3", "toggle_details", "Details"),
        Binding("f4", "toggle_panel", "Panel"),
        Binding("ctrl+q", "request_quit", "Quit", priority=True),
    ]

    class Loaded(Message):
        def __init__(self, engine, name: str) -> None:
            self.engine, self.name = engine, name
            super().__init__()

    class LoadFailed(Message):
        def __init__(self, error: str) -> None:
            self.error = error
            super().__init__()

    class Token(Message):
        def __init__(self, view, text: str, drafted: bool, stats) -> None:
            self.view, self.text, self.drafted, self.stats = view, text, drafted, stats
            super().__init__()

    class Done(Message):
        def __init__(self, view, result, compare_with=None, cfg=None) -> None:
            self.view, self.result, self.compare_with, self.cfg = view, result, compare_with, cfg
            super().__init__()

    class Failed(Message):
        def __init__(self, view, error: str) -> None:
            self.view, self.error = view, error
            super().__init__()

    class Notice(Message):
        def __init__(self, text: str) -> None:
            self.text = text
            super().__init__()

    class Warmed(Message):
        def __init__(self, chat_id, tokens: int) -> None:
            self.chat_id, self.tokens = chat_id, tokens
            super().__init__()

    def __init__(self, session, *, show_timings: bool = True, engine_loader=None, store=None,
                 resume: int | None = None) -> None:
        super().__init__()
        self.session = session
        self.show_timings = show_timings
        self.engine = None
        self.pair_name = _display_name(str(self.s.get("model")))
        self.messages: list[dict] = []  # the conversation as the chat template sees it (+ "state" for answers)
        self.generating = False
        self.show_colors = False  # finished answers: Markdown; True: keep the draft colours (F2)
        self.panel_choice: bool | None = None  # the stats panel: None = shown from PANEL_MIN_WIDTH columns (F4)
        self._cancel = threading.Event()
        self._engine_lock = threading.Lock()  # one user of the engine at a time: generation, cache warm-up, swap
        self._last_ui = 0.0
        self._loader = engine_loader
        self.last_result = None
        self.store = store  # history.History, or None: nothing is stored
        self.chat_id: int | None = None
        self.chat_title = ""
        self.writer = None  # the answer being stored as it streams
        self.warmed_tokens: int | None = None  # prompt tokens put in the KV cache ahead of a resumed chat's turn
        self._resume = resume

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                with Transcript(id="transcript"):
                    yield Welcome(id="welcome")
                yield LoadingIndicator(id="loading")
                yield PromptBox(id="prompt")
            yield StatsPanel(show_timings=self.show_timings, id="stats")
        yield Footer()

    @property
    def s(self) -> dict:
        """The effective settings (flags > env > file > tune results > pair defaults), changes made here on top."""
        return self.session.values()

    def on_mount(self) -> None:
        self.refresh_header()
        self.query_one(Welcome).show(self.pair_name)
        self.apply_panel()
        self.query_one(PromptBox).focus()
        self.set_interval(0.5, self.tick)  # live figures even between tokens
        if self._resume is not None:
            self.history_call(lambda: self.open_chat(self._resume))
        self.offer_interrupted()
        self.load_models(self.s["model"])

    def tick(self) -> None:
        """Twice a second while an answer streams: live figures and a sparkline point, even between tokens."""
        if self.generating and self.engine is not None and self.engine.last_stats is not None:
            self.query_one(StatsPanel).update_stats(self.engine.last_stats)

    def on_resize(self, event) -> None:
        self.apply_panel()

    def apply_panel(self) -> None:
        shown = self.panel_choice if self.panel_choice is not None else self.size.width >= PANEL_MIN_WIDTH
        self.query_one(StatsPanel).display = shown

    def refresh_header(self) -> None:
        backend = "CPU"
        if self.engine is not None and (self.engine.target.n_gpu_layers or 0) != 0:
            backend = "GPU offload"
        self.query_one(HeaderBar).show(self.pair_name, self.s.get("method") or "auto", self.current_k(),
                                       float(self.s.get("temperature") or 0.0), backend, self.show_colors)

    def current_k(self) -> int:
        k = self.s.get("draft_tokens")
        return 4 if k is None else int(k)

    # ------------------------------------------------------------------ loading
    @work(thread=True, exclusive=True, group="load")
    def load_models(self, model: str) -> None:
        before = dict(self.session.overrides)
        try:
            if model != self.s["model"]:
                self.session.set("model", model)
            if self._loader is not None:
                engine = self._loader(self.s)
            else:
                engine = self.session.load()
            if (self.s.get("method") or "auto") != "none":
                engine.exact_k(self.current_k())  # the one-time exactness probe runs behind the loading indicator
            with self._engine_lock:  # swap engines between generations, never under one
                old, self.engine = self.engine, engine
                if old is not None and old is not engine:
                    old.close()
            self.post_message(self.Loaded(engine, model))
        except LocalspecError as exc:
            self.session.overrides = before
            self.post_message(self.LoadFailed(str(exc)))
        except Exception as exc:  # a crash in loading must not take the app down
            self.session.overrides = before
            self.post_message(self.LoadFailed(f"{type(exc).__name__}: {exc}"))

    def on_localspec_app_loaded(self, msg: Loaded) -> None:
        self.engine = msg.engine
        self.pair_name = _display_name(msg.name)
        self.query_one("#loading").display = False
        mem = {self.engine.target.name: self.engine.target.memory_bytes()}
        if self.engine.draft is not None:
            mem[self.engine.draft.name] = self.engine.draft.memory_bytes()
        self.query_one(StatsPanel).set_memory(mem)
        self.query_one(Welcome).show(self.pair_name, self.engine.target.name,
                                     self.engine.draft.name if self.engine.draft is not None else None, loading=False)
        if self.engine.dropped_draft:
            self.notify(f"{self.engine.dropped_draft}; using prompt lookup", severity="warning")
        if getattr(self.engine, "template_warning", None):
            self.notify(self.engine.template_warning, severity="warning", timeout=10)
        self.refresh_header()
        if self.messages:
            self.warm_cache(self.chat_id, self.chat_messages())

    def on_localspec_app_load_failed(self, msg: LoadFailed) -> None:
        self.query_one("#loading").display = False
        view = self.query_one(Transcript).add("error", f"could not load the model: {msg.error}")
        view.add_class("error")
        self.notify(msg.error, severity="error", timeout=10)

    # ------------------------------------------------------------------ prompts and commands
    def prefill(self, text: str) -> None:
        box = self.query_one(PromptBox)
        box.recall(text)
        box.focus()

    def run_command_text(self, text: str) -> None:
        try:
            self.run_slash(text)
        except UsageError as exc:
            self.notify(str(exc), severity="error")

    @on(PromptBox.Submitted)
    def submitted(self, event: PromptBox.Submitted) -> None:
        text = event.text
        if text.startswith("/"):
            self.run_command_text(text)
            return
        if self.engine is None:
            self.notify("the model is still loading (or failed to load)", severity="warning")
            return
        if self.generating:
            self.notify("wait for the answer, or press Esc to stop it", severity="warning")
            return
        self.query_one(Transcript).add("user", text)
        self.messages.append({"role": "user", "content": text})
        self.history_call(lambda: self.store_user(text))
        self.start_generation(self.chat_messages())

    def chat_messages(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.s["system"]}] if self.s.get("system") else []
        return sys_msg + [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def run_slash(self, text: str) -> None:
        cmd, _, arg = text.partition(" ")
        arg = arg.strip()
        if cmd == "/help":
            self.query_one(Transcript).add("help", HELP)
        elif cmd in QUIT_COMMANDS:
            self.action_request_quit()
            return
        elif cmd == "/method":
            from localspec.core.engine import METHODS

            if arg not in METHODS:
                raise UsageError(f"/method takes one of {', '.join(METHODS)}")
            self.session.set("method", arg)
        elif cmd == "/exactness":
            if arg not in ("auto", "bit", "lossless"):
                raise UsageError("/exactness takes auto, bit or lossless")
            self.session.set("exactness", arg)
        elif cmd == "/k":
            if not arg.isdigit():
                raise UsageError("/k takes a whole number >= 0")
            self.session.set("draft_tokens", int(arg))
        elif cmd == "/temp":
            try:
                t = float(arg)
            except ValueError:
                raise UsageError("/temp takes a number >= 0") from None
            self.session.set("temperature", t)
        elif cmd == "/system":
            self.session.set("system", arg or None)
            self.notify("system prompt " + ("set" if arg else "cleared"))
        elif cmd in ("/new", "/clear"):
            if self.generating:
                raise UsageError("stop the answer first (Esc)")
            self.new_chat()
        elif cmd == "/history":
            self.show_history()
        elif cmd == "/load":
            if not arg.isdigit():
                raise UsageError("/load takes a chat number (/history lists them)")
            if self.generating:
                raise UsageError("stop the answer first (Esc)")
            self.need_history()
            self.open_chat(int(arg))
            if self.engine is not None:
                self.warm_cache(self.chat_id, self.chat_messages())
        elif cmd == "/rename":
            self.need_history()
            if self.chat_id is None:
                raise UsageError("nothing to rename yet: this chat is stored once you send a message")
            self.store.rename(self.chat_id, arg)
            self.chat_title = " ".join(arg.split())
            self.notify(f"chat {self.chat_id} is now “{self.chat_title}”")
        elif cmd == "/delete":
            self.delete_chat()
        elif cmd == "/save":
            if not arg:
                raise UsageError("/save takes a path ending in .md or .json")
            self.save(Path(arg).expanduser())
        elif cmd == "/model":
            if not arg:
                raise UsageError("/model takes a pair name or a GGUF path")
            if self.generating:
                raise UsageError("stop the answer first (Esc)")
            self.query_one("#loading").display = True
            self.load_models(arg)
        elif cmd == "/compare":
            self.compare()
        else:
            raise UsageError(f"unknown command {cmd}; /help lists them")
        self.refresh_header()

    # ------------------------------------------------------------------ generation
    def gen_config(self, method: str | None = None):
        return self.session.gen_config(**({"method": method} if method else {}))

    def start_generation(self, messages: list[dict], method: str | None = None, compare_with=None) -> None:
        try:
            cfg = self.gen_config(method)
        except UsageError as exc:
            self.notify(str(exc), severity="error")
            return
        view = self.query_one(Transcript).add("assistant", show_colors=self.show_colors)
        self.generating = True
        self._cancel.clear()
        if compare_with is None and self.store is not None and self.chat_id is not None:
            self.writer = self.history_call(lambda: self.store.answer(self.chat_id))
        self.generate(messages, cfg, view, compare_with)

    @work(thread=True, exclusive=True, group="gen")
    def generate(self, messages, cfg, view, compare_with) -> None:
        from localspec.core.engine import Finished

        from localspec.session import generation_slot

        try:
            with self._engine_lock:
                engine = self.engine
                tokens = engine.chat_prompt(messages)
                with generation_slot(waiting=lambda m: self.post_message(self.Notice(m))):
                    for ev in engine.generate(tokens, cfg, cancel=self._cancel):
                        if isinstance(ev, Finished):
                            self.post_message(self.Done(view, ev, compare_with, cfg))
                        else:
                            self.post_message(self.Token(view, ev.text, ev.drafted, engine.last_stats))
        except LocalspecError as exc:
            self.post_message(self.Failed(view, str(exc)))
        except Exception as exc:
            self.post_message(self.Failed(view, f"{type(exc).__name__}: {exc}"))

    def on_localspec_app_notice(self, msg: Notice) -> None:
        self.notify(msg.text)

    def on_localspec_app_token(self, msg: Token) -> None:
        msg.view.append(msg.text, msg.drafted)
        if self.writer is not None and msg.text:
            self.history_call(lambda: self.writer.append(msg.text))  # throttled inside
        now = time.monotonic()
        if now - self._last_ui > 0.1:
            self._last_ui = now
            msg.view.flush()
            self.query_one(StatsPanel).update_stats(msg.stats, sample=False)  # the sparkline samples in tick()
            self.query_one(Transcript).scroll_end(animate=False)

    def on_localspec_app_done(self, msg: Done) -> None:
        self.generating = False
        fin = msg.result
        st = fin.stats
        note = answer_note(st, self.show_timings)
        if fin.finish_reason == "cancelled":
            note = "stopped · " + note
        if msg.compare_with is not None:
            base, base_cfg = msg.compare_with
            temps = [c.sampling.temperature for c in (base_cfg, msg.cfg) if c is not None]
            note = compare_note(fin, base, max(temps, default=0.0), self.show_timings)
        else:
            state = "stopped" if fin.finish_reason == "cancelled" else "done"
            self.messages.append({"role": "assistant", "content": fin.text, "state": state})
            self.last_result = (fin, msg.cfg)
            self.finish_stored_answer(fin.text, state, _stats_record(st))
        msg.view.finish(note)
        self.query_one(StatsPanel).update_stats(st)
        self.query_one(Transcript).scroll_end(animate=False)

    def on_localspec_app_failed(self, msg: Failed) -> None:
        self.generating = False
        self.finish_stored_answer(None, "error")
        msg.view.finish(f"error: {msg.error}")
        msg.view.add_class("error")
        self.notify(msg.error, severity="error")

    def compare(self) -> None:
        if self.generating:
            raise UsageError("wait for the answer first")
        if self.last_result is None or len(self.messages) < 2:
            raise UsageError("nothing to compare yet: ask something first")
        # the conversation up to (not including) the last answer, rerun with plain decoding
        self.start_generation(self.chat_messages()[:-1], method="none", compare_with=self.last_result)

    # ------------------------------------------------------------------ history
    def history_call(self, fn):
        """Run a history operation; a failing database is reported, never fatal to the chat."""
        try:
            return fn()
        except LocalspecError as exc:
            self.notify(f"history: {exc}", severity="error", timeout=8)
            return None

    def need_history(self) -> None:
        if self.store is None:
            raise UsageError("the history is off (--no-history or history = false in the config)")

    def store_user(self, text: str) -> None:
        if self.store is None:
            return
        if self.chat_id is None:
            self.chat_id = self.store.new_chat(text, model=self.pair_name, system=self.s.get("system"))
            self.chat_title = self.store.get(self.chat_id).title
        else:
            self.store.set_chat_settings(self.chat_id, self.pair_name, self.s.get("system"))
        self.store.add_message(self.chat_id, "user", text)

    def finish_stored_answer(self, text: str | None, state: str, stats: dict | None = None) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            self.history_call(lambda: writer.finish(text, state, stats))

    def open_chat(self, chat_id: int) -> None:
        """Show a stored chat and continue it (its system prompt comes back with it)."""
        chat = self.store.get(chat_id)
        self.store.mark_interrupted(chat_id)
        if chat.system != self.s.get("system"):
            self.session.set("system", chat.system)
        self.chat_id, self.chat_title = chat.id, chat.title
        self.messages = [{"role": m["role"], "content": m["content"], "state": m["state"]}
                         for m in chat.messages if m["state"] != "error"]
        self.last_result = None
        self.warmed_tokens = None
        transcript = self.query_one(Transcript)
        transcript.clear_all()
        for m in self.messages:
            view = transcript.add(m["role"], m["content"] if m["role"] != "assistant" else "",
                                  show_colors=self.show_colors)
            if m["role"] == "assistant":
                view.append(m["content"], False)
                mark = {"stopped": "stopped · ", "interrupted": "interrupted · ", "streaming": "interrupted · "}
                view.finish(mark.get(m["state"], "") + "from the history")
        self.notify(f"chat {chat.id}: “{chat.title}” ({len(self.messages)} messages)")

    def new_chat(self) -> None:
        self.messages.clear()
        self.chat_id, self.chat_title = None, ""
        self.last_result = None
        self.query_one(Transcript).clear_all()

    def show_history(self) -> None:
        self.need_history()
        chats = self.store.chats(limit=30)
        if not chats:
            self.query_one(Transcript).add("history", "no stored chats yet")
            return
        lines = ["stored chats (newest first; /load N opens one):"]
        for c in chats:
            mark = "*" if c.id == self.chat_id else " "
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
            lines.append(f"{mark}{c.id:>4}  {when}  {c.n_messages:>3} msgs  {c.title}")
        self.query_one(Transcript).add("history", "\n".join(lines))

    def delete_chat(self) -> None:
        self.need_history()
        if self.generating:
            raise UsageError("stop the answer first (Esc)")
        if self.chat_id is None:
            raise UsageError("nothing to delete: this chat is not stored yet")
        chat_id, title = self.chat_id, self.chat_title

        def answer(yes: bool) -> None:
            if not yes:
                self.notify(f"chat {chat_id} kept")
                return
            try:
                self.store.delete(chat_id)
            except LocalspecError as exc:
                self.notify(f"history: {exc}", severity="error")
                return
            if self.chat_id == chat_id:
                self.new_chat()
            self.notify(f"chat {chat_id} deleted")

        self.ask(f"Delete chat {chat_id} “{title}” from the history? This cannot be undone.", answer)

    def offer_interrupted(self) -> None:
        """A chat whose answer was cut off by a crash is offered again, once."""
        if self.store is None:
            return
        chats = self.history_call(self.store.interrupted) or []
        latest = self.history_call(self.store.latest)
        for c in chats:
            if c.id == self.chat_id:
                continue
            how = "localspec chat --continue" if c.id == latest else f"localspec chat --resume {c.id}"
            self.notify(f"chat {c.id} “{c.title}” was cut off mid-answer: /load {c.id} reopens it "
                        f"(or start with {how})", severity="warning", timeout=15)
            self.history_call(lambda: self.store.mark_interrupted(c.id))

    @work(thread=True, group="warm")
    def warm_cache(self, chat_id, messages: list[dict]) -> None:
        """Put a reopened chat in the KV cache now, so its next turn decodes only the new message."""
        try:
            with self._engine_lock:
                engine = self.engine
                if engine is None or chat_id != self.chat_id:
                    return
                tokens = engine.chat_prompt(messages)
                engine.prefill(tokens)
            self.post_message(self.Warmed(chat_id, len(tokens)))
        except LocalspecError as exc:  # e.g. the chat no longer fits the context: the turn will say so
            self.post_message(self.Notice(f"could not preload the chat: {exc}"))
        except Exception as exc:
            self.post_message(self.Notice(f"could not preload the chat: {type(exc).__name__}: {exc}"))

    def on_localspec_app_warmed(self, msg: Warmed) -> None:
        if msg.chat_id == self.chat_id:
            self.warmed_tokens = msg.tokens

    # ------------------------------------------------------------------ actions
    def action_stop(self) -> None:
        if isinstance(self.screen, ConfirmScreen):  # the app's Esc binding comes first: it answers No there
            self.screen.action_answer_no()
            return
        if self.generating:
            self._cancel.set()

    def action_toggle_details(self) -> None:
        panel = self.query_one(StatsPanel)
        panel.set_expert(not panel.expert)
        if panel.expert and not panel.display:
            self.panel_choice = True
            self.apply_panel()

    def action_toggle_panel(self) -> None:
        self.panel_choice = not self.query_one(StatsPanel).display
        self.apply_panel()

    def action_toggle_colors(self) -> None:
        self.show_colors = not self.show_colors
        for m in self.query_one(Transcript).messages():
            m.set_colors(self.show_colors)
        self.refresh_header()

    def ask(self, question: str, then) -> None:
        """A yes/no question (No by default); what the user typed meanwhile goes back into the prompt box."""
        screen = ConfirmScreen(question)

        def answered(yes: bool | None) -> None:
            if screen.typed:
                box = self.query_one(PromptBox)
                box.insert(screen.typed)
                box.focus()
            then(bool(yes))

        self.push_screen(screen, answered)

    def action_request_quit(self) -> None:
        if not self.generating:
            self.exit()
            return

        def answer(yes: bool) -> None:
            if yes:
                self._cancel.set()
                self.exit()

        self.ask("An answer is being generated. Quit anyway?", answer)

    def on_unmount(self) -> None:
        self._cancel.set()
        if self.writer is not None:  # quit during an answer: what came so far is kept, marked stopped
            self.finish_stored_answer(self.writer.text, "stopped")

    # ------------------------------------------------------------------ saving
    def transcript_data(self) -> dict:
        return {"pair": self.pair_name, "settings": {k: self.s.get(k) for k in ("method", "draft_tokens", "temperature", "system")},
                "messages": list(self.messages)}

    def save(self, path: Path) -> None:
        if path.suffix.lower() not in (".md", ".json"):
            raise UsageError("/save writes .md or .json files")
        from localspec.store.exports import to_json, to_markdown

        data = self.transcript_data()
        if path.suffix.lower() == ".json":
            content = to_json(data)
        else:  # an answer stopped inside a code block gets its closing fence
            content = to_markdown(f"localspec chat ({self.pair_name})", data["messages"])

        def write(ok: bool = True) -> None:
            if not ok:
                self.notify(f"{path} not overwritten")
                return
            try:
                atomic_write(path, content)  # a crash mid-write leaves the old file, never half of one
                self.notify(f"saved {path}")
            except OSError as exc:
                self.notify(f"cannot write {path}: {exc.strerror or exc}", severity="error")

        if path.exists():
            self.ask(f"{path} exists. Overwrite it?", write)
        else:
            write()


def answer_note(st, show_timings: bool = True) -> str:
    """The line under an answer, in plain words; a rate over too small a sample is a dash."""
    parts = [f"{st.completion_tokens} tokens"]
    if show_timings:
        parts.append(f"{rate_text(st.rate())} tokens/s")
    parts.append(f"{st.acceptance_rate:.0%} of drafts accepted" if st.drafted else "nothing drafted")
    return " · ".join(parts)


def drafter_used(st) -> str:
    """The drafter that produced most of an answer's steps ("none" when it never drafted)."""
    used = {m: n for m, n in st.method_used.items() if m != "none"}
    return max(used, key=used.get) if used else "none"


def compare_note(plain, base, temperature: float, show_timings: bool = True) -> str:
    """/compare's verdict: `plain` is the rerun with plain decoding, `base` the answer it is compared with. A
    speed-up is reported only when `base` speculated; above temperature 0 the outputs are not compared."""
    p, b = plain.stats.rate(), base.stats.rate()
    if base.stats.drafted == 0:
        return ("compare: the earlier answer did not speculate (nothing was drafted), so there is no speed-up to "
                "measure" + (f" · plain decoding: {rate_text(p)} tokens/s" if show_timings else ""))
    speeds = f"plain {rate_text(p)} tokens/s vs {drafter_used(base.stats)} {rate_text(b)} tokens/s"
    ratio = f" → {b / p:.2f}x" if (p and b) else " → speed-up — (too short to measure)"
    if temperature > 0:
        head = f"compare: at temperature {temperature:g} the outputs differ by sampling, so only the speed is compared"
        return head + (f" · {speeds}{ratio}" if show_timings else "")
    same = "identical" if plain.tokens == base.tokens else "different"
    if not show_timings:
        return f"compare: output {same}"
    return f"compare: {speeds}{ratio} · output {same}"


def _stats_record(st) -> dict:
    """What the history keeps about an answer's speed."""
    return {"tokens": st.completion_tokens, "tokens_per_second": st.rate(), "method": st.method,
            "drafted": st.drafted, "accepted": st.accepted, "cached_prompt_tokens": st.cached_prompt_tokens}


def _display_name(model: str) -> str:
    """A pair name as is; a path as its file name."""
    from localspec.models.registry import looks_like_path

    return Path(model).name if looks_like_path(model) else model


def create_app(session, *, show_timings: bool = True, engine_loader=None, store=None,
               resume: int | None = None) -> LocalspecApp:
    """The one app factory, used by `localspec chat` and by the tests. `session`: a session.Session, or a dict of
    settings given as flags. `store`: a history.History to store the chat in (None: nothing is stored);
    `resume`: a stored chat to reopen."""
    from localspec.session import Session

    if not isinstance(session, Session):
        session = Session(dict(session), quiet=True)
    return LocalspecApp(session, show_timings=show_timings, engine_loader=engine_loader, store=store, resume=resume)
