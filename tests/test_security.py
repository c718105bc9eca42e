"""Untrusted input: NUL bytes are kept, the text generated before an interrupt stays readable, thread counts are
refused before llama.cpp sees them. (Control tokens in content and templates in a sandbox: test_chat_template.py.)"""

import json

import pytest

from helpers import cli, one_error_line

pytestmark = pytest.mark.usefixtures("isolated_config")

IM_END = 4  # the tiny vocab's end-of-turn marker (a control token)


# ------------------------------------------------------------------ NUL bytes
def test_nul_byte_in_stdin_reaches_the_model(target_path, engine):
    with_nul = engine.chat_prompt([{"role": "user", "content": "abc\x00def"}])
    cut = engine.chat_prompt([{"role": "user", "content": "abc"}])
    assert len(with_nul) > len(cut) and with_nul.count(IM_END) == 1
    r = cli(["run", "-m", str(target_path), "-n", "1", "--json"], stdin=b"abc\x00def")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == len(with_nul)


# ------------------------------------------------------------------ the partial answer survives an interrupt
def test_last_text_after_keyboard_interrupt(engine):
    from localspec.core.engine import Finished, GenConfig, Piece

    gen = engine.generate(engine.raw_prompt("the cat"), GenConfig(method="lookup", max_tokens=100))
    got = ""
    for _ in range(30):
        ev = next(gen)
        assert isinstance(ev, Piece)
        got += ev.text
    assert got and engine.last_text == got
    with pytest.raises(KeyboardInterrupt):
        gen.throw(KeyboardInterrupt)  # Ctrl-C inside the loop (e.g. in llama_decode)
    assert engine.last_text == got
    fin = engine.complete(engine.raw_prompt("the dog"), GenConfig(method="none", max_tokens=5))
    assert isinstance(fin, Finished) and engine.last_text == fin.text


# ------------------------------------------------------------------ thread counts
def test_threads_refused_before_llama_cpp(target_path):
    from localspec.llama.model import Model
    from localspec.llama.sysinfo import max_threads
    from localspec.errors import UsageError

    hi = max_threads()
    assert 4 <= hi <= 512
    for bad in (0, -1, hi + 1, 100000):
        with pytest.raises(UsageError, match=f"threads must be between 1 and {hi}"):
            Model(target_path, n_ctx=64, n_threads=bad)
    Model(target_path, n_ctx=64, n_threads=hi).close()


@pytest.mark.parametrize("threads", ["100000", "1000", "0"])
def test_cli_threads_refused(target_path, threads):
    line = one_error_line(cli(["run", "-m", str(target_path), "--threads", threads, "hi"], timeout=30), 2)
    assert "threads must be between 1 and" in line
