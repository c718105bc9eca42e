"""`localspec chat`: Textual app driven with Pilot, plus a snapshot of the main screen."""

import asyncio
import json

import pytest

from localspec.tui.app import create_app
from localspec.tui.widgets.message import MessageView
from localspec.tui.widgets.stats_panel import StatsPanel
from tinymodels import write_model

SIZE = (120, 36)


def settings(model, draft=None, **kw):
    s = {"model": str(model), "draft": str(draft) if draft else None, "method": "draft", "draft_tokens": 2,
         "temperature": 0.0, "max_tokens": 40, "system": None, "p_min": 0.0, "lookup_min": 2, "lookup_max": 4,
         "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": None, "ctx_size": 1024, "gpu_layers": 0,
         "draft_gpu_layers": 0, "threads": None}
    s.update(kw)
    return s


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))


async def until(pilot, cond, timeout=30.0):
    t = 0.0
    while not cond():
        await pilot.pause(0.05)
        t += 0.05
        if t > timeout:
            raise AssertionError("timed out waiting")


async def send(pilot, text):
    box = pilot.app.query_one("#prompt")
    box.load_text(text)
    box.focus()
    await pilot.press("enter")


async def answer(pilot, text):
    app = pilot.app
    before = len(app.query(MessageView))
    await send(pilot, text)

    def done():
        views = app.query(MessageView)
        return len(views) >= before + 2 and views.last().role == "assistant" and views.last().finished

    await until(pilot, done)
    return app.query(MessageView).last()


def test_chat_roundtrip_matches_engine(target_path):
    app = create_app(settings(target_path, target_path))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            view = await answer(pilot, "the cat")
            assert view.role == "assistant" and view.finished and view.text
            expected = app.engine.complete(app.engine.chat_prompt([{"role": "user", "content": "the cat"}]),
                                           app.gen_config()).text
            assert view.text == expected
            assert any(d for _, d in view.spans)  # accepted draft tokens are marked for colouring
            stats = app.query_one(StatsPanel).last
            assert stats.completion_tokens == 40 and stats.acceptance_rate == 1.0
            assert "tokens/s" in view.note and "100% of drafts accepted" in view.note
            # a finished answer is shown as Markdown; the streaming view (with the draft colours) is hidden
            assert view.query_one(".final").display and not view.query_one(".stream").display
            # multi-turn: the second answer reuses the first turn's KV cache
            await answer(pilot, "and the dog")
            assert app.engine.last_stats.cached_prompt_tokens > 0
            assert [m["role"] for m in app.messages] == ["user", "assistant", "user", "assistant"]
            await pilot.press("f2")  # keep the draft colours in finished answers
            assert app.show_colors is True
            assert view.query_one(".stream").display and not view.query_one(".final").display

    asyncio.run(go())


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("long") / "long.gguf", 3, n_ctx_train=65536)


def test_cancel_keeps_answer_and_chat_goes_on(long_model):
    app = create_app(settings(long_model, None, method="lookup", max_tokens=60000, ctx_size=62000))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            await send(pilot, "the cat")
            await until(pilot, lambda: app.generating and len(app.query(MessageView).last().text) > 10)
            await pilot.press("escape")
            await until(pilot, lambda: not app.generating)
            view = app.query(MessageView).last()
            assert view.note.startswith("stopped") and view.text
            assert app.engine.last_stats.completion_tokens < 60000
            app.session.set("max_tokens", 5)
            view2 = await answer(pilot, "again")
            assert view2.finished and not view2.note.startswith("stopped")

    asyncio.run(go())


def test_slash_commands_switch_method_and_k(target_path):
    app = create_app(settings(target_path, target_path))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            await send(pilot, "/method lookup")
            await send(pilot, "/k 3")
            await send(pilot, "/temp 0")
            assert app.s["method"] == "lookup" and app.s["draft_tokens"] == 3
            assert "method lookup" in str(app.query_one("#header").render()) and "k 3" in str(app.query_one("#header").render())
            await answer(pilot, "the cat and the dog")
            assert app.engine.last_stats.method == "lookup"
            await send(pilot, "/method fast")  # refused with a notification, nothing changes
            assert app.s["method"] == "lookup"
            await send(pilot, "/help")
            assert any(m.role == "help" for m in app.query(MessageView))

    asyncio.run(go())


def test_save_never_overwrites_without_asking(target_path, tmp_path):
    app = create_app(settings(target_path, target_path, max_tokens=8))
    md, js = tmp_path / "chat.md", tmp_path / "chat.json"

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            view = await answer(pilot, "the cat")
            await send(pilot, f"/save {md}")
            await send(pilot, f"/save {js}")
            await until(pilot, lambda: md.exists() and js.exists())
            text = md.read_text()
            assert "## user" in text and "the cat" in text and view.text.strip()[:5] in text
            data = json.loads(js.read_text())
            assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
            md.write_text("my notes")
            await send(pilot, f"/save {md}")
            await pilot.pause(0.2)
            await pilot.click("#no")
            await pilot.pause(0.2)
            assert md.read_text() == "my notes"
            await send(pilot, f"/save {md}")
            await pilot.pause(0.2)
            await pilot.click("#yes")
            await until(pilot, lambda: md.read_text() != "my notes")

    asyncio.run(go())


def test_overwrite_dialog_defaults_to_no_esc_cancels_and_typing_is_kept(tmp_path):
    """The data-loss bug: "Overwrite it?" had Yes focused and ignored Esc, so the next prompt typed plus Enter
    overwrote the file and the typed text was lost."""
    from localspec.tui.screens.confirm import ConfirmScreen

    app = create_app(settings(tmp_path / "missing.gguf"))  # /save needs no model
    md = tmp_path / "notes.md"
    md.write_text("my notes")

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            box = app.query_one("#prompt")
            await send(pilot, f"/save {md}")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            assert app.screen.focused is not None and app.screen.focused.id == "no"
            await pilot.press("h", "i", "enter")  # the user goes on typing their next prompt
            await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
            await pilot.pause(0.1)
            assert md.read_text() == "my notes"
            assert box.text == "hi"  # what was typed is in the prompt box, not sent, not lost
            box.clear()
            await send(pilot, f"/save {md}")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
            await pilot.pause(0.1)
            assert md.read_text() == "my notes"

    asyncio.run(go())


def test_saved_markdown_of_a_stopped_answer_closes_its_code_fence(tmp_path):
    from localspec.store.exports import open_fence

    app = create_app(settings(tmp_path / "missing.gguf"))
    md = tmp_path / "chat.md"

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            # what a stopped answer leaves: a code block that never got its closing fence
            app.messages[:] = [{"role": "user", "content": "write hello world"},
                               {"role": "assistant", "content": "Here:\n\n```python\nprint('hel", "state": "stopped"},
                               {"role": "user", "content": "thanks"}]
            await send(pilot, f"/save {md}")
            await until(pilot, md.exists)
            text = md.read_text()
            assert open_fence(text) is None, text
            assert text.index("print('hel") < text.rindex("```") < text.index("## user", text.index("print"))

    asyncio.run(go())


def test_chat_is_stored_as_it_happens_and_history_commands(target_path, tmp_path):
    from localspec.store.history import History
    from localspec.tui.screens.confirm import ConfirmScreen
    from localspec.errors import UsageError

    store = History(tmp_path / "h.sqlite3")
    app = create_app(settings(target_path, target_path, max_tokens=8), store=store)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            view = await answer(pilot, "the cat")
            first = app.chat_id
            c = store.get(first)
            assert [(m["role"], m["state"]) for m in c.messages] == [("user", "done"), ("assistant", "done")]
            assert c.messages[1]["content"] == view.text and c.title == "the cat"
            assert c.messages[1]["stats"]["tokens"] == 8
            await send(pilot, "/rename cats and dogs")
            assert store.get(first).title == "cats and dogs"
            await send(pilot, "/new")
            assert app.chat_id is None and app.messages == [] and not app.query(MessageView)
            await answer(pilot, "the dog")
            second = app.chat_id
            assert second != first
            await send(pilot, "/history")
            listing = [m for m in app.query(MessageView) if m.role == "history"][-1].text
            assert "cats and dogs" in listing and f"*{second:>4}" in listing
            await send(pilot, f"/load {first}")
            assert app.chat_id == first and [m["content"] for m in app.messages][0] == "the cat"
            assert [m.role for m in app.query(MessageView)] == ["user", "assistant"]
            await until(pilot, lambda: app.warmed_tokens is not None)
            await send(pilot, "/delete")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("enter")  # No is the default
            await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
            assert store.get(first).id == first and app.chat_id == first
            await send(pilot, "/delete")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.click("#yes")
            await until(pilot, lambda: app.chat_id is None)
            with pytest.raises(UsageError):
                store.get(first)
            assert [c.id for c in store.chats()] == [second]

    asyncio.run(go())


def test_resumed_chat_reuses_the_kv_cache_on_its_first_turn(target_path, tmp_path):
    from localspec.store.history import History
    from localspec.seq import common_prefix

    store = History(tmp_path / "h.sqlite3")
    cid = store.new_chat("the cat")
    store.add_message(cid, "user", "the cat")
    store.answer(cid).finish("the dog and the cat in the x", "done")
    app = create_app(settings(target_path, None, method="lookup", max_tokens=6), store=store, resume=cid)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            assert [m.role for m in app.query(MessageView)] == ["user", "assistant"]  # shown before the model loads
            await until(pilot, lambda: app.engine is not None and app.warmed_tokens is not None)
            await answer(pilot, "and the dog")
            old = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "the dog and the cat in the x"}]
            new = old + [{"role": "user", "content": "and the dog"}]
            shared = common_prefix(app.engine.chat_prompt(old), app.engine.chat_prompt(new))
            assert shared > 10
            assert app.engine.last_stats.cached_prompt_tokens >= shared  # the first turn after resume reused it
            c = store.get(cid)
            assert [m["role"] for m in c.messages] == ["user", "assistant", "user", "assistant"]

    asyncio.run(go())


def test_an_interrupted_chat_is_offered_at_start(tmp_path):
    import subprocess
    import sys

    from localspec.store import history as H

    store = H.History(tmp_path / "h.sqlite3")
    cid = store.new_chat("tell me a story")
    store.add_message(cid, "user", "tell me a story")
    w = store.answer(cid)
    w.append("once upon")
    w.flush()
    H._unregister(w)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    store._write("UPDATE messages SET pid = ? WHERE id = ?", (dead, w.message_id))  # as if its process had crashed
    app = create_app(settings(tmp_path / "missing.gguf"), store=store)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.2)
            notes = [n.message for n in app._notifications]
            assert any("cut off" in n and "--continue" in n and f"/load {cid}" in n for n in notes), notes
            assert store.interrupted() == []  # offered once
            await send(pilot, f"/load {cid}")
            view = app.query(MessageView).last()
            assert view.text == "once upon" and view.note.startswith("interrupted")
            await pilot.pause(0.2)
            assert view.query_one(".final").source == "once upon" and view.query_one(".final").children

    asyncio.run(go())


def test_missing_model_shows_error_in_app(tmp_path):
    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: any(m.role == "error" for m in app.query(MessageView)))
            err = [m for m in app.query(MessageView) if m.role == "error"][0]
            assert "not found" in err.text
            await send(pilot, "hello")  # the app is still alive and says why it cannot answer
            assert app.engine is None and app.is_running

    asyncio.run(go())


def test_snapshot_main_screen(target_path, draft_path, snap_compare):
    app = create_app(settings(target_path, draft_path, max_tokens=24, method="draft", draft_tokens=2), show_timings=False)

    async def run_before(pilot):
        app.query_one("#prompt").cursor_blink = False  # a blinking cursor would make the picture random
        await until(pilot, lambda: app.engine is not None)
        await answer(pilot, "the cat")

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


# ---------------------------------------------------------------- the chat window
def lines_of(widget) -> list[str]:
    from textual.geometry import Region

    return [strip.text.rstrip() for strip in widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))]


def test_welcome_placeholder_and_plain_word_stats_with_details_behind_f3(target_path, draft_path):
    app = create_app(settings(target_path, draft_path, max_tokens=12))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            welcome = "\n".join(lines_of(app.query_one("#welcome")))
            assert "target.gguf" in welcome and "draft.gguf" in welcome and "green" in welcome
            assert "Esc stop" in welcome and "Ctrl+P" in welcome
            assert app.query_one("#prompt").placeholder
            await answer(pilot, "the cat")
            figures = "\n".join(lines_of(app.query_one("#figures")))
            for words in ("drafts accepted", "tokens per step", "first token", "prompt reused"):
                assert words in figures
            expert = app.query_one("#expert")
            assert not expert.display
            await pilot.press("f3")
            await pilot.pause(0.1)
            assert expert.display
            text = "\n".join(lines_of(expert))
            assert "acceptance by draft position" in text and "verify time" in text and "k cap" in text
            await pilot.press("f4")
            assert not app.query_one("#stats").display
            await pilot.press("f4")
            assert app.query_one("#stats").display

    asyncio.run(go())


def test_stats_panel_hides_below_100_columns_and_f4_brings_it_back(tmp_path):
    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=(90, 30)) as pilot:
            await pilot.pause(0.1)
            assert not app.query_one("#stats").display
            await pilot.press("f4")
            assert app.query_one("#stats").display
            await pilot.resize_terminal(120, 30)
            await pilot.pause(0.1)
            assert app.query_one("#stats").display

    asyncio.run(go())


def test_model_names_and_sizes_never_break_mid_word(tmp_path):
    app = create_app(settings(tmp_path / "missing.gguf"))
    long = "qwen2.5-coder-1.5b-instruct-q4_k_m-with-a-very-long-suffix.gguf"

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            panel = app.query_one(StatsPanel)
            panel.set_memory({long: 1066 * 2**20, "small.gguf": 12345 * 2**20})
            await pilot.pause(0.1)
            lines = [l for l in lines_of(app.query_one("#memory")) if l.strip()]
            assert lines[0] == "memory"
            name = lines[1]
            assert name == long or (name.endswith("…") and long.startswith(name[:-1]))
            assert lines[2] == "\u00a0\u00a01,066\u00a0MiB" and lines[3] == "small.gguf"
            assert lines[4] == "\u00a0\u00a012,345\u00a0MiB"
            header = lines_of(app.query_one("#header"))
            assert len(header) == 1

    asyncio.run(go())


def test_command_palette_lists_every_slash_command(tmp_path):
    from textual.command import CommandPalette
    from textual.widgets import OptionList

    from localspec.tui.commands import SLASH

    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+p")
            await until(pilot, lambda: isinstance(app.screen, CommandPalette))
            await pilot.pause(0.5)
            results = app.screen.query_one(OptionList)
            shown = "\n".join(str(results.get_option_at_index(i).prompt) for i in range(results.option_count))
            for cmd, arg, _ in SLASH:
                assert f"{cmd} {arg}".strip() in shown, cmd
            await pilot.press(*"/help", "enter")  # a command without an argument runs at once
            await until(pilot, lambda: any(m.role == "help" for m in app.query(MessageView)))

    asyncio.run(go())


@pytest.mark.parametrize("word", ["/quit", "/exit", "/bye"])
def test_quit_words(tmp_path, word):
    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, word)
            await pilot.pause(0.2)
            assert not app.is_running

    asyncio.run(go())


def test_up_recall_puts_the_cursor_at_the_end(tmp_path):
    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            box = app.query_one("#prompt")
            await send(pilot, "/k 3")
            await send(pilot, "/temp 0.5")
            await pilot.press("up")
            assert box.text == "/temp 0.5" and box.cursor_location == (0, len("/temp 0.5"))
            await pilot.press("up")
            assert box.text == "/k 3" and box.cursor_location == (0, 4)
            await pilot.press("x")  # typing goes on at the end
            assert box.text == "/k 3x"

    asyncio.run(go())


def test_rates_over_one_token_show_a_dash(target_path):
    app = create_app(settings(target_path, None, method="none", max_tokens=1))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            view = await answer(pilot, "the cat")
            assert "— tokens/s" in view.note
            assert "— tokens/s" in "\n".join(lines_of(app.query_one("#tps")))

    asyncio.run(go())


def test_compare_never_claims_a_speedup_without_speculation_and_not_outputs_when_sampling(target_path, draft_path):
    app = create_app(settings(target_path, draft_path, method="draft", max_tokens=24))

    async def compare(pilot):
        await send(pilot, "/compare")
        await until(pilot, lambda: app.query(MessageView).last().finished and not app.generating)
        return app.query(MessageView).last().note

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            await answer(pilot, "the cat")
            assert app.engine.last_stats.drafted > 0
            note = await compare(pilot)
            assert "output identical" in note and "plain" in note
            await send(pilot, "/temp 0.8")
            await answer(pilot, "the dog")
            assert app.engine.last_stats.drafted > 0
            note = await compare(pilot)
            assert "differ by sampling" in note and "identical" not in note and "different" not in note
            await send(pilot, "/temp 0")
            await send(pilot, "/method none")
            await answer(pilot, "a dog")
            note = await compare(pilot)
            assert "did not speculate" in note and "→" not in note and "speedup" not in note

    asyncio.run(go())


def test_sparkline_plots_the_recent_rate(tmp_path):
    from localspec.core.stats import Stats

    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            panel = app.query_one(StatsPanel)
            st = Stats(started=100.0, running=False, elapsed_s=10.0)
            for i in range(40):  # 20 tokens/s over the last two seconds, slower before
                st.token_emitted(now=100.0 + (i * 0.4 if i < 20 else 8.0 + (i - 20) * 0.1))
            panel.update_stats(st)
            panel.update_stats(st)
            assert panel.rates == [st.recent_rate()] * 2 and abs(panel.rates[0] - 10.0) < 1e-9
            assert panel.rates[0] != st.tokens_per_second

    asyncio.run(go())


class ScriptedEngine:
    """An engine double that streams a fixed Markdown answer: the snapshot of a finished answer (headings, a list,
    highlighted code) then does not depend on what tiny random models say. The app's real code path runs."""

    ANSWER = ("Reverse a list in **Python** with slicing:\n\n"
              "```python\ndef reverse(xs: list) -> list:\n    return xs[::-1]\n```\n\n"
              "- `xs[::-1]` makes a copy\n- `xs.reverse()` works in place\n")

    def __init__(self):
        from types import SimpleNamespace

        self.target = SimpleNamespace(name="scripted-target.gguf", n_gpu_layers=0, memory_bytes=lambda: 987 * 2**20)
        self.draft = SimpleNamespace(name="scripted-draft.gguf", memory_bytes=lambda: 123 * 2**20)
        self.dropped_draft = None
        self.draft_kind = "same-vocab"
        self.template_warning = None  # the notices the session reads after a load
        self.last_stats = None

    def exact_k(self, k):
        return k

    def chat_prompt(self, messages):
        return list(range(10 * len(messages)))

    def prefill(self, tokens):
        return len(tokens)

    def generate(self, tokens, cfg, cancel=None):
        from localspec.core.engine import Finished, Piece
        from localspec.core.stats import Stats

        st = self.last_stats = Stats(method="draft", prompt_tokens=len(tokens), k_cap=cfg.k)
        words = self.ANSWER.split(" ")
        for i, w in enumerate(words):
            st.token_emitted(now=float(i))
            if i % 3 == 0:
                st.record_step(2, 1)
                st.method_used["draft"] += 1
                st.k_used[2] += 1
            yield Piece(w if i == len(words) - 1 else w + " ", i, i % 3 == 1)
        st.elapsed_s = 1.0
        yield Finished(self.ANSWER, list(range(len(words))), "stop", st)

    def close(self):
        pass


def test_snapshot_finished_answer_is_markdown_with_highlighted_code(tmp_path, snap_compare):
    app = create_app(settings(tmp_path / "scripted.gguf", max_tokens=64, method="draft", draft_tokens=2),
                     show_timings=False, engine_loader=lambda s: ScriptedEngine())

    async def run_before(pilot):
        app.query_one("#prompt").cursor_blink = False
        await until(pilot, lambda: app.engine is not None)
        view = await answer(pilot, "how do I reverse a list?")
        assert view.query_one(".final").display  # the Markdown view, not the streaming text
        await pilot.pause(0.5)  # let the Markdown widget lay out its blocks

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_a_model_without_chat_template_gets_a_warning_in_the_chat(tmp_path):
    """The fallback 'role: content' transcript was used silently in the chat (run warned, chat did not)."""
    plain_model = write_model(tmp_path / "plain.gguf", 5, chat_template=None)
    app = create_app(settings(plain_model, method="none"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            await pilot.pause(0.1)
            notes = [n.message for n in app._notifications]
            assert any("no chat template" in n for n in notes), notes

    asyncio.run(go())


# ---------------------------------------------------------------- one place decides
def test_a_bad_setting_is_refused_by_the_session_and_named_by_its_command(tmp_path):
    """The chat showed the session's errors with setting keys ("draft tokens (draft_tokens) must be ..."), and
    checked /method and /exactness itself."""
    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: any(m.role == "error" for m in app.query(MessageView)))  # no model: fine
            await pilot.pause(0.05)
            for cmd, word in (("/k 999", "/k"), ("/method fast", "/method"), ("/exactness exact", "/exactness"),
                              ("/temp -1", "/temp"), ("/temp nan", "/temp")):
                before = len(app._notifications)
                await send(pilot, cmd)
                await pilot.pause(0.05)
                notes = [n.message for n in list(app._notifications)[before:]]
                assert len(notes) == 1 and word in notes[0], (cmd, notes)
                assert "draft_tokens" not in notes[0] and "-k" not in notes[0].replace("/k", ""), notes
            assert (app.s["draft_tokens"], app.s["method"], app.s["temperature"]) == (2, "draft", 0.0)  # unchanged
            await send(pilot, "/exactness lossless")  # a good value goes through, and says so
            assert app.s["exactness"] == "lossless"
            assert "exactness lossless" in list(app._notifications)[-1].message

    asyncio.run(go())


def test_settings_are_resolved_once_per_change_not_on_every_look(tmp_path, monkeypatch):
    """`app.s` resolved every setting (config file, tune results) on each access, three times per header refresh."""
    import localspec.session as S

    calls = []
    real = S.resolve_settings
    monkeypatch.setattr(S, "resolve_settings", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: any(m.role == "error" for m in app.query(MessageView)))
            app.s  # noqa: B018 - resolved again after the failed load put the overrides back
            calls.clear()
            for _ in range(3):
                app.refresh_header()
            app.chat_messages()
            assert calls == []
            await send(pilot, "/k 3")  # one resolution to check the change, one for the new values
            assert len(calls) <= 2 and app.s["draft_tokens"] == 3
            assert "k 3" in str(app.query_one("#header").render())
            app.session.set("draft_tokens", 5)  # a change made on the session directly is seen too
            assert app.s["draft_tokens"] == 5

    asyncio.run(go())


def test_the_palette_completes_a_commands_choices(tmp_path):
    from textual.command import CommandPalette

    from localspec.defaults import METHODS

    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+p")
            await until(pilot, lambda: isinstance(app.screen, CommandPalette))
            await pilot.press(*"/method lookup")
            await pilot.pause(0.5)
            await pilot.press("enter")
            await until(pilot, lambda: app.s["method"] == "lookup")
            assert "lookup" in METHODS

    asyncio.run(go())


def test_compare_names_the_drafter_that_produced_the_answer():
    from types import SimpleNamespace

    from localspec.core.stats import Stats
    from localspec.tui.notes import compare_note

    st = Stats(method="auto", started=0.0, running=False, elapsed_s=2.0)
    for i in range(20):
        st.token_emitted(now=i * 0.1)
    st.record_step(4, 3)
    st.method_used.update({"lookup": 5, "draft": 2, "none": 9})
    plain = Stats(method="none", started=0.0, running=False, elapsed_s=4.0)
    for i in range(20):
        plain.token_emitted(now=i * 0.2)
    note = compare_note(SimpleNamespace(stats=plain, tokens=[1]), SimpleNamespace(stats=st, tokens=[1]), 0.0)
    assert f"vs {st.main_method} " in note and st.main_method == "lookup" and "output identical" in note


def test_help_wraps_each_description_in_its_own_column(tmp_path):
    """/help was one block of text: a long description wrapped to column 0, under the commands."""
    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, "/help")
            await until(pilot, lambda: any(m.role == "help" for m in app.query(MessageView)))
            await pilot.pause(0.1)
            view = [m for m in app.query(MessageView) if m.role == "help"][0]
            lines = lines_of(view.query_one(".body"))
            rows = lines[1:lines.index(next(ln for ln in lines if ln.startswith("keys:")))]
            assert any(ln.startswith(" " * 20) for ln in rows)  # this window is narrow enough to wrap some
            for ln in rows:
                assert ln.startswith("  /") or ln.startswith(" " * 20), ln

    asyncio.run(go())


def test_the_panel_says_which_drafter_auto_used_and_the_exactness_with_its_reason(tmp_path):
    """Under --method auto the panel said only "method auto", not what actually drafted."""
    from localspec.core.stats import Stats

    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            panel = app.query_one(StatsPanel)
            st = Stats(method="auto", exactness="lossless", exactness_reason="lossless: asked for")
            st.record_step(3, 2)
            st.method_used.update({"none": 4, "lookup": 3, "draft": 1})
            panel.update_stats(st)
            await pilot.press("f3")
            await pilot.pause(0.1)
            assert "method           auto → lookup" in lines_of(app.query_one("#figures"))
            expert = "\n".join(lines_of(app.query_one("#expert")))
            assert "exactness        lossless" in expert and "lossless: asked for" in expert

    asyncio.run(go())


def test_every_listed_command_has_a_handler_and_every_handler_is_listed():
    from localspec.tui.commands import HANDLERS, QUIT_COMMANDS, SLASH

    listed = {cmd for cmd, _, _ in SLASH}
    assert listed <= set(HANDLERS)
    assert set(HANDLERS) - listed == {"/clear", *QUIT_COMMANDS} - {"/quit"}  # aliases, named in /help's text


def test_the_details_panel_shows_a_hybrid_models_rollback(tmp_path):
    """On a recurrent/hybrid target the details (F3) say how rejected drafts were undone, with restores and replays."""
    from localspec.core.stats import Stats

    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            panel = app.query_one(StatsPanel)
            st = Stats(method="lookup", rollback="checkpoint", restores=3, replayed_tokens=5)
            st.record_step(3, 1)
            panel.update_stats(st)
            await pilot.press("f3")
            await pilot.pause(0.1)
            expert = " ".join(lines_of(app.query_one("#expert")))  # the panel wraps long lines
            assert "rollback: checkpoint (3 restores, 5 tokens replayed)" in expert

    asyncio.run(go())


def test_the_details_panel_says_which_kind_of_drafting_ran_and_each_sources_figures(tmp_path):
    """The figures name the kind of drafting that produced most drafts (through text for a draft model of another
    vocabulary, as `run --json` says cross-vocab); F3 lists drafted and accepted tokens per drafting source."""
    from localspec.core.stats import Stats

    app = create_app(settings(tmp_path / "missing.gguf"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            panel = app.query_one(StatsPanel)
            panel.draft_kind = "cross-vocab"
            st = Stats(method="auto")
            for source, (d, a) in (("draft", (4, 3)), ("lookup", (2, 2)), ("draft", (2, 1))):
                st.record_step(d, a, source)
                st.method_used[source] += 1
            panel.update_stats(st)
            await pilot.press("f3")
            await pilot.pause(0.1)
            assert "drafting         through text" in lines_of(app.query_one("#figures"))
            expert = lines_of(app.query_one("#expert"))
            at = expert.index("drafted by source (accepted/drafted)")
            assert expert[at + 1:at + 3] == [" draft  through text          4/6  67%",
                                             " lookup model-free            2/2 100%"]
            panel.draft_kind = None  # a head given with -d, and no draft at all
            st2 = Stats(method="eagle3")
            st2.record_step(3, 3, "eagle3")
            st2.method_used["eagle3"] += 1
            panel.update_stats(st2)
            await pilot.pause(0.1)
            assert "drafting         head" in lines_of(app.query_one("#figures"))
            panel.update_stats(Stats(method="none"))
            await pilot.pause(0.1)
            assert "drafting         none" in lines_of(app.query_one("#figures"))
            assert "drafted by source  —" in lines_of(app.query_one("#expert"))

    asyncio.run(go())


# the target's words with the last two changed: the same weights, another vocabulary (drafts through text)
@pytest.fixture(scope="module")
def near_path(target_path, tmp_path_factory):
    from localspec.models.gguf_header import read_file_metadata
    from tinymodels import WORDS

    seed = int(str(read_file_metadata(target_path, tokens=False)["general.name"]).split("-")[1])
    return write_model(tmp_path_factory.mktemp("near") / "near.gguf", seed, words=WORDS[:-2] + ["ta", "no"])


class TakeTurns:
    """A policy that hands each step to the next of its drafters in turn that has something to offer, k = 3, and
    counts what each was told of its proposals (`told`: name -> (drafted, accepted))."""

    switched = None

    def __init__(self, drafters, told):
        self.drafters, self.turn = drafters, 0
        inside = []  # a chained drafter tells its model part in turn: only the generation's own call counts
        for d in drafters.values():
            def accept(n_drafted, n_accepted, d=d):  # the drafters live on with the engine: wrapped once
                if not inside:
                    drafted, accepted = told.get(d.name, (0, 0))
                    told[d.name] = (drafted + n_drafted, accepted + n_accepted)
                inside.append(d)
                try:
                    return type(d).accept(d, n_drafted, n_accepted)
                finally:
                    inside.pop()

            d.accept = accept

    def choose(self, context):
        names = sorted(self.drafters)
        for _ in names:
            self.turn += 1
            d = self.drafters[names[self.turn % len(names)]]
            if d.offer(context, 3) is not None:
                return d, 3
        return None, 0

    def observe(self, *args):
        pass

    def reason(self):
        return ""

    def uncap(self, k):
        pass

    def set_verify_prices(self, ratios):
        pass


def test_each_sources_figures_are_what_its_drafter_was_told_it_got(target_path, near_path, monkeypatch):
    """Over answers drafted in turn by prompt lookup, the suffix cache, a draft model of another vocabulary and that
    draft chained with the suffix cache, the panel's drafted and accepted tokens per source equal what the
    generation told each drafter of its proposals."""
    from localspec.core.engine import Engine

    told: dict = {}
    make_policy = Engine.make_policy

    def take_turns(self, cfg, exact):
        policy, method, k = make_policy(self, cfg, exact)
        return TakeTurns(policy.drafters, told), method, k

    monkeypatch.setattr(Engine, "make_policy", take_turns)
    app = create_app(settings(target_path, near_path, method="auto", draft_tokens=4, max_tokens=60,
                              exactness="lossless"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            assert app.engine.draft_kind == "cross-vocab"
            panel = app.query_one(StatsPanel)
            seen = set()
            for prompt in ("the cat and the dog and the cat and the dog", "the cat and the dog and the cat"):
                told.clear()
                await answer(pilot, prompt)
                st = app.engine.last_stats
                assert panel.sources(st) == told
                assert sum(d for d, _ in told.values()) == st.drafted
                assert sum(a for _, a in told.values()) == st.accepted
                seen |= set(told)
            assert seen == {"draft", "draft+suffix", "lookup", "suffix"}
            figures = lines_of(app.query_one("#figures"))
            assert f"drafting         {'through text' if st.main_method == 'draft' else 'model-free'}" in figures

    asyncio.run(go())


def test_a_load_result_arriving_while_the_app_closes_is_dropped(tmp_path):
    """A load result that reaches the app after its screen's widgets are gone (run_test tearing the screen down) is
    dropped: no error entry, no notice, no exception (`query_one("#loading")` would raise NoMatches)."""
    from localspec.tui.messages import LoadFailed

    app = create_app(settings(tmp_path / "missing.gguf"))
    notices: list[str] = []

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: not app.loading)  # the model is missing: its own failure is shown first
            shown = [v.text for v in app.query(MessageView)]
            assert any("could not load the model" in t for t in shown)
            app.notify = lambda message, **kw: notices.append(str(message))
            app.query_one("#loading").remove()  # as the teardown does
            await pilot.pause()
            app.post_message(LoadFailed("late failure"))
            await pilot.pause()
            assert [v.text for v in app.query(MessageView)] == shown
            assert notices == [] and app.is_running and app._exception is None

    asyncio.run(go())


# ---------------------------------------------------------------- typed while the models load
def gated_loader(gate, fail: str | None = None):
    """A loader that holds the app in "loading the models" until `gate` is set, then loads a ScriptedEngine (or
    fails with `fail`). The wait is bounded so that a failing test never leaves a thread behind."""
    from localspec.errors import ModelLoadError

    def load(s):
        gate.wait(timeout=60)
        if fail:
            raise ModelLoadError(fail)
        return ScriptedEngine()

    return load


def notes_of(app) -> list[str]:
    return [n.message for n in app._notifications]


def test_a_prompt_sent_while_the_models_load_waits_and_is_sent_once_they_are(tmp_path):
    """A prompt sent in the first seconds ("loading the models …") was dropped: the box emptied, nothing was sent."""
    import threading

    gate = threading.Event()
    app = create_app(settings(tmp_path / "scripted.gguf", max_tokens=64), engine_loader=gated_loader(gate))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            box = app.query_one("#prompt")
            await send(pilot, "hello there")
            await pilot.pause(0.1)
            assert app.engine is None  # still loading
            [view] = [m for m in app.query(MessageView) if m.role == "user"]
            assert view.text == "hello there" and "waiting" in view.note
            assert "will be sent when the models are loaded" in view.note
            assert any("will be sent when the models are loaded" in n for n in notes_of(app)), notes_of(app)
            # commands are not held back by the loading: they run at once
            await send(pilot, "/k 3")
            assert app.s["draft_tokens"] == 3 and "k 3" in str(app.query_one("#header").render())
            # a command that would replace the chat under the waiting prompt is refused, and says why
            await send(pilot, "/new")
            await pilot.pause(0.1)
            assert "waits for the models" in notes_of(app)[-1]
            assert [m.text for m in app.query(MessageView) if m.role == "user"] == ["hello there"]
            # one prompt waits at a time: a second one stays in the box, and the app says so
            await send(pilot, "and another")
            await pilot.pause(0.1)
            assert box.text == "and another"
            assert any("already waits" in n for n in notes_of(app)), notes_of(app)
            assert [m.text for m in app.query(MessageView) if m.role == "user"] == ["hello there"]
            gate.set()
            await until(pilot, lambda: app.query(MessageView).last().role == "assistant"
                        and app.query(MessageView).last().finished)
            assert app.query(MessageView).last().text == ScriptedEngine.ANSWER
            assert [(m["role"], m["content"]) for m in app.messages] == [("user", "hello there"),
                                                                         ("assistant", ScriptedEngine.ANSWER)]
            assert view.note == "" and app.waiting is None
            assert box.text == "and another"  # the second prompt is still there, ready to send

    asyncio.run(go())


def test_a_prompt_waiting_for_models_that_fail_to_load_goes_back_to_the_box(tmp_path):
    import threading

    gate = threading.Event()
    app = create_app(settings(tmp_path / "scripted.gguf"), engine_loader=gated_loader(gate, fail="no such file"))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            box = app.query_one("#prompt")
            await send(pilot, "hello there")
            await pilot.pause(0.1)
            gate.set()
            await until(pilot, lambda: any(m.role == "error" for m in app.query(MessageView)))
            await pilot.pause(0.1)
            err = [m for m in app.query(MessageView) if m.role == "error"][0]
            assert "no such file" in err.text
            assert box.text == "hello there"  # not sent, not lost
            [view] = [m for m in app.query(MessageView) if m.role == "user"]
            assert "not sent" in view.note and app.messages == [] and app.waiting is None
            # with no model at all, a prompt is refused, says why, and stays in the box too
            box.clear()
            await send(pilot, "again")
            await pilot.pause(0.1)
            assert box.text == "again" and "no model" in notes_of(app)[-1]

    asyncio.run(go())


def test_esc_takes_back_a_waiting_prompt_and_quitting_asks_first(tmp_path):
    import threading

    from localspec.tui.screens.confirm import ConfirmScreen

    gate = threading.Event()
    app = create_app(settings(tmp_path / "scripted.gguf"), engine_loader=gated_loader(gate))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            box = app.query_one("#prompt")
            await send(pilot, "hello there")
            await pilot.pause(0.1)
            await pilot.press("ctrl+q")  # an unsent prompt is not thrown away without asking
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
            assert app.is_running and app.waiting is not None
            await pilot.press("escape")
            await pilot.pause(0.1)
            assert box.text == "hello there" and app.waiting is None
            assert not [m for m in app.query(MessageView) if m.role == "user"]
            gate.set()
            await until(pilot, lambda: app.engine is not None)
            await pilot.pause(0.2)
            assert app.messages == [] and not app.generating  # nothing was sent

    asyncio.run(go())


class GatedEngine(ScriptedEngine):
    """A ScriptedEngine whose answer holds after its first piece until `gate` is set."""

    def __init__(self, gate):
        super().__init__()
        self.gate = gate

    def generate(self, tokens, cfg, cancel=None):
        for i, ev in enumerate(super().generate(tokens, cfg, cancel)):
            if i == 1:
                self.gate.wait(timeout=60)
            yield ev


def test_a_prompt_refused_while_an_answer_streams_stays_in_the_box(tmp_path):
    import threading

    gate = threading.Event()
    app = create_app(settings(tmp_path / "scripted.gguf"), engine_loader=lambda s: GatedEngine(gate))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            box = app.query_one("#prompt")
            await until(pilot, lambda: app.engine is not None)
            await send(pilot, "first")
            await until(pilot, lambda: app.generating)
            await send(pilot, "second")
            await pilot.pause(0.1)
            assert box.text == "second" and "wait for the answer" in notes_of(app)[-1]
            gate.set()
            await until(pilot, lambda: not app.generating)
            assert [m["content"] for m in app.messages if m["role"] == "user"] == ["first"]

    asyncio.run(go())


def test_esc_in_the_command_palette_closes_it_and_leaves_a_waiting_prompt_alone(tmp_path):
    """The app's Esc (stop) came before the palette's own Esc: the palette stayed open, and a prompt waiting for
    the models would have been taken back instead."""
    import threading

    from textual.command import CommandPalette

    gate = threading.Event()
    app = create_app(settings(tmp_path / "scripted.gguf"), engine_loader=gated_loader(gate))

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, "hello there")
            await pilot.pause(0.1)
            await pilot.press("ctrl+p")
            await until(pilot, lambda: isinstance(app.screen, CommandPalette))
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, CommandPalette))
            assert app.waiting is not None and app.waiting[0] == "hello there"
            gate.set()
            await until(pilot, lambda: len(app.messages) == 2)

    asyncio.run(go())


def test_a_model_file_name_reaches_the_title_without_escapes_or_markup():
    """A file name holding terminal escapes or markup brackets is shown as plain text in the chat's header."""
    from localspec.tui.app import _display_name
    from localspec.tui.widgets.header_bar import HeaderBar

    name = _display_name("/models/tiny\x1b]0;pwned\x07[bold]x[red].gguf")
    assert "\x1b" not in name and "\x07" not in name
    bar = HeaderBar()
    bar.show(name, "auto", 4, 0.0, "cpu", True)
    assert "[bold]x[red].gguf" in str(bar.render())
