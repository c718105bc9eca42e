"""The chat app. Generation runs in a thread worker that only posts messages (tui/messages.py) and checks
cancellation; the slash commands are in tui/commands.py, the dialogs in tui/screens/, the widgets in tui/widgets/.
`create_app` is the one factory shared by the CLI and the tests."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, LoadingIndicator

from localspec import defaults as D
from localspec.errors import LocalspecError, UsageError
from localspec.tui import commands
from localspec.tui.commands import SlashCommands, error_text
from localspec.tui.history import ChatHistory
from localspec.tui.messages import Done, Failed, Loaded, LoadFailed, Notice, Token, Warmed
from localspec.tui.notes import answer_note, compare_note, stats_record
from localspec.tui.screens.confirm import ConfirmScreen
from localspec.tui.widgets.header_bar import HeaderBar
from localspec.tui.widgets.message import MessageView
from localspec.tui.widgets.prompt_box import PromptBox
from localspec.tui.widgets.stats_panel import StatsPanel
from localspec.tui.widgets.transcript import Transcript
from localspec.tui.widgets.welcome import Welcome

PANEL_MIN_WIDTH = 100  # below this many columns the stats panel hides itself (F4 shows it)
WAITING_NOTE = "waiting · will be sent when the models are loaded (Esc takes it back)"


class LocalspecApp(ChatHistory, App):
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

    def __init__(self, session, *, show_timings: bool = True, engine_loader=None, store=None,
                 resume: int | None = None) -> None:
        super().__init__()
        self.session = session
        self.show_timings = show_timings
        self.engine = None
        self._settings: tuple[dict, dict] | None = None  # (the overrides they were resolved with, the values)
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
        self._loads = 0  # loads started and not yet finished (a /model may start one while another runs)
        # a prompt sent while the models load: (its text, its view); sent once they are loaded. One at a time, as
        # one answer streams at a time: a second prompt stays in the box.
        self.waiting: tuple[str, MessageView] | None = None

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
        """The effective settings (flags > env > file > tune results > pair defaults), changes made here on top.
        Resolved once, and again only when the session's overrides change (resolving reads the config file and
        the tune results)."""
        cached = self._settings
        if cached is None or cached[0] != self.session.overrides:
            cached = self._settings = (dict(self.session.overrides), self.session.values())
        return cached[1]

    def change_setting(self, key: str, value) -> None:
        """A change made in the chat (/method, /k ...). The session checks it as it checks a flag and raises a
        SettingError naming the setting; on error nothing changes."""
        self.session.set(key, value)
        self._settings = None

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
        self.query_one(HeaderBar).show(self.pair_name, self.s.get("method") or D.METHOD, self.current_k(),
                                       float(self.s.get("temperature") or 0.0), backend, self.show_colors)

    def current_k(self) -> int:
        k = self.s.get("draft_tokens")
        return D.DRAFT_TOKENS if k is None else int(k)

    # ------------------------------------------------------------------ loading
    @property
    def loading(self) -> bool:
        return self._loads > 0

    def load_models(self, model: str) -> None:
        """Load `model` (a pair or a path) behind the loading indicator; a prompt sent meanwhile waits for it."""
        self._loads += 1
        self.query_one("#loading").display = True
        self._load(model)

    @work(thread=True, exclusive=True, group="load")
    def _load(self, model: str) -> None:
        before = dict(self.session.overrides)
        try:
            if model != self.s["model"]:
                self.change_setting("model", model)
            if self._loader is not None:
                engine = self._loader(dict(self.s))
            else:
                engine = self.session.load()
            self.session.prepare(engine)  # the one-time exactness probe runs behind the loading indicator
            with self._engine_lock:  # swap engines between generations, never under one
                old, self.engine = self.engine, engine
                if old is not None and old is not engine:
                    old.close()
            self.post_message(Loaded(engine, model))
        except LocalspecError as exc:
            self.session.overrides, self._settings = before, None
            self.post_message(LoadFailed(error_text(exc)))
        except Exception as exc:  # a crash in loading must not take the app down
            self.session.overrides, self._settings = before, None
            self.post_message(LoadFailed(f"{type(exc).__name__}: {exc}"))

    def _screen_gone(self) -> bool:
        """The app is closing and its widgets are gone: a late load result has nowhere to be shown."""
        return not self.query("#loading")

    @on(Loaded)
    def loaded(self, msg: Loaded) -> None:
        self.engine = msg.engine
        self._loads -= 1
        if self._screen_gone():
            return
        self.pair_name = _display_name(msg.name)
        self.query_one("#loading").display = self.loading
        mem = {self.engine.target.name: self.engine.target.memory_bytes()}
        if self.engine.draft is not None:
            mem[self.engine.draft.name] = self.engine.draft.memory_bytes()
        panel = self.query_one(StatsPanel)
        panel.set_memory(mem)
        panel.draft_kind = self.engine.draft_kind
        self.query_one(Welcome).show(self.pair_name, self.engine.target.name,
                                     self.engine.draft.name if self.engine.draft is not None else None, loading=False)
        for note in self.session.notices(self.engine):
            self.notify(note, severity="warning", timeout=10)
        self.refresh_header()
        if self.loading:
            return
        if self.waiting is not None:  # its turn puts the chat in the KV cache anyway
            text, view = self.waiting
            self.waiting = None
            view.finish("")
            self.send(text, view)
        elif self.messages:
            self.warm_cache(self.chat_id, self.chat_messages())

    @on(LoadFailed)
    def load_failed(self, msg: LoadFailed) -> None:
        self._loads -= 1
        if self._screen_gone():
            return
        self.query_one("#loading").display = self.loading
        view = self.query_one(Transcript).add("error", f"could not load the model: {msg.error}")
        view.add_class("error")
        self.notify(msg.error, severity="error", timeout=10)
        if self.waiting is not None and not self.loading:
            text, waiting_view = self.waiting
            self.waiting = None
            waiting_view.finish(f"not sent: the model did not load · {self.give_back(text)}")

    # ------------------------------------------------------------------ prompts and commands
    def prefill(self, text: str) -> None:
        box = self.query_one(PromptBox)
        box.recall(text)
        box.focus()

    def run_command_text(self, text: str) -> None:
        try:
            commands.run_slash(self, text)
        except UsageError as exc:
            self.notify(error_text(exc), severity="error")

    def give_back(self, text: str) -> str:
        """Put a prompt that was not sent back in the prompt box, so nothing typed is lost; where something new was
        typed there meanwhile, that stays and Up recalls the prompt (the box keeps every prompt sent). Says where
        the prompt is."""
        box = self.query_one(PromptBox)
        if box.text.strip():
            return "Up recalls it"
        box.recall(text)
        box.focus()
        return "it is back in the prompt box"

    @on(PromptBox.Submitted)
    def submitted(self, event: PromptBox.Submitted) -> None:
        text = event.text
        if text.startswith("/"):
            self.run_command_text(text)
            return
        if self.generating:
            where = self.give_back(text)
            self.notify(f"wait for the answer, or press Esc to stop it ({where})", severity="warning")
            return
        if self.waiting is not None:
            where = self.give_back(text)
            self.notify(f"a prompt already waits for the models; this one is not sent ({where})", severity="warning")
            return
        if self.loading:
            view = self.query_one(Transcript).add("user", text)
            view.finish(WAITING_NOTE)
            self.waiting = (text, view)
            self.notify("the models are loading: your prompt will be sent when the models are loaded")
            return
        if self.engine is None:
            where = self.give_back(text)
            self.notify(f"no model is loaded (the error above says why); /model NAME|PATH loads one ({where})",
                        severity="warning")
            return
        self.send(text)

    def send(self, text: str, view: MessageView | None = None) -> None:
        """Send a prompt: shown (in `view`, where it is already shown), stored, answered."""
        if view is None:
            self.query_one(Transcript).add("user", text)
        self.messages.append({"role": "user", "content": text})
        self.history_call(lambda: self.store_user(text))
        self.start_generation(self.chat_messages())

    def chat_messages(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.s["system"]}] if self.s.get("system") else []
        return sys_msg + [{"role": m["role"], "content": m["content"]} for m in self.messages]

    # ------------------------------------------------------------------ generation
    def gen_config(self, method: str | None = None):
        return self.session.gen_config(**({"method": method} if method else {}))

    def start_generation(self, messages: list[dict], method: str | None = None, compare_with=None) -> None:
        try:
            cfg = self.gen_config(method)
        except UsageError as exc:
            self.notify(error_text(exc), severity="error")
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
                with generation_slot(waiting=lambda m: self.post_message(Notice(m))):
                    for ev in engine.generate(tokens, cfg, cancel=self._cancel):
                        if isinstance(ev, Finished):
                            self.post_message(Done(view, ev, compare_with, cfg))
                        else:
                            self.post_message(Token(view, ev.text, ev.drafted, engine.last_stats))
        except LocalspecError as exc:
            self.post_message(Failed(view, str(exc)))
        except Exception as exc:
            self.post_message(Failed(view, f"{type(exc).__name__}: {exc}"))

    @on(Notice)
    def show_notice(self, msg: Notice) -> None:
        self.notify(msg.text)

    @on(Token)
    def answer_token(self, msg: Token) -> None:
        msg.view.append(msg.text, msg.drafted)
        if self.writer is not None and msg.text:
            self.history_call(lambda: self.writer.append(msg.text))  # throttled inside
        now = time.monotonic()
        if now - self._last_ui > 0.1:
            self._last_ui = now
            msg.view.flush()
            self.query_one(StatsPanel).update_stats(msg.stats, sample=False)  # sparkline: tick()
            self.query_one(Transcript).scroll_end(animate=False)

    @on(Done)
    def answer_done(self, msg: Done) -> None:
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
            self.finish_stored_answer(fin.text, state, stats_record(st))
        msg.view.finish(note)
        self.query_one(StatsPanel).update_stats(st)
        self.query_one(Transcript).scroll_end(animate=False)

    @on(Failed)
    def answer_failed(self, msg: Failed) -> None:
        self.generating = False
        self.finish_stored_answer(None, "error")
        msg.view.finish(f"error: {msg.error}")
        msg.view.add_class("error")
        self.notify(msg.error, severity="error")

    @on(Warmed)
    def warmed(self, msg: Warmed) -> None:
        if msg.chat_id == self.chat_id:
            self.warmed_tokens = msg.tokens

    # ------------------------------------------------------------------ actions
    def check_action(self, action: str, parameters) -> bool | None:
        # Esc / Ctrl+C (a priority binding, seen before any screen's) stop on the chat screen and answer No in a
        # dialog; on another screen (the command palette) they are that screen's own keys: Esc closes it.
        if action == "stop" and len(self.screen_stack) > 1 and not isinstance(self.screen, ConfirmScreen):
            return False
        return True

    def action_stop(self) -> None:
        if isinstance(self.screen, ConfirmScreen):  # the app's Esc binding comes first: it answers No there
            self.screen.action_answer_no()
            return
        if self.generating:
            self._cancel.set()
        elif self.waiting is not None:  # take back a prompt waiting for the models
            text, view = self.waiting
            self.waiting = None
            view.remove()
            self.notify(f"prompt not sent ({self.give_back(text)})")

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
        if not self.generating and self.waiting is None:
            self.exit()
            return
        question = ("An answer is being generated. Quit anyway?" if self.generating
                    else "A prompt waits for the models to load. Quit anyway?")

        def answer(yes: bool) -> None:
            if yes:
                self._cancel.set()
                self.exit()

        self.ask(question, answer)

    def on_unmount(self) -> None:
        self._cancel.set()
        if self.writer is not None:  # quit during an answer: what came so far is kept, marked stopped
            self.finish_stored_answer(self.writer.text, "stopped")


def _display_name(model: str) -> str:
    """A pair name as is; a path as its file name; without control characters (a file name's escapes would reach
    the terminal through the title)."""
    from localspec.models.registry import looks_like_path
    from localspec.printable import printable

    return printable(Path(model).name if looks_like_path(model) else model)


def create_app(session, *, show_timings: bool = True, engine_loader=None, store=None,
               resume: int | None = None) -> LocalspecApp:
    """The one app factory, used by `localspec chat` and by the tests. `session`: a session.Session, or a dict of
    settings given as flags. `store`: a history.History to store the chat in (None: nothing is stored);
    `resume`: a stored chat to reopen."""
    from localspec.session import Session

    if not isinstance(session, Session):
        session = Session(dict(session), quiet=True)
    return LocalspecApp(session, show_timings=show_timings, engine_loader=engine_loader, store=store, resume=resume)
