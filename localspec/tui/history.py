"""The chat's side of the history: storing the chat as it happens, reopening a stored chat (its prompt put in
the KV cache ahead of its next turn) and offering a chat a crash cut off. Part of the app (a mixin of
LocalspecApp), which holds the state it works on: `store`, `chat_id`, `chat_title`, `messages`, `writer`."""

from __future__ import annotations

from textual import work

from localspec.errors import LocalspecError, UsageError
from localspec.tui.messages import Notice, Warmed
from localspec.tui.widgets.transcript import Transcript


class ChatHistory:
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
            self.change_setting("system", chat.system)
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
            self.post_message(Warmed(chat_id, len(tokens)))
        except LocalspecError as exc:  # e.g. the chat no longer fits the context: the turn will say so
            self.post_message(Notice(f"could not preload the chat: {exc}"))
        except Exception as exc:
            self.post_message(Notice(f"could not preload the chat: {type(exc).__name__}: {exc}"))
