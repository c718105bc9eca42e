"""core/response.py: one handle for a generation, pulled (the Engine) or pushed (the batch), read the same way."""

import pytest

from conftest import PROMPTS
from localspec.core.engine import GenConfig
from localspec.core.generation import Finished, Piece
from localspec.core.response import Response
from localspec.errors import SettingError


def test_a_pulled_response_streams_pieces_then_holds_the_finished(engine):
    cfg = GenConfig(method="lookup", k=3, max_tokens=30)
    resp = engine.respond(engine.raw_prompt(PROMPTS[0]), cfg)
    assert resp.stats is None and not resp.done  # nothing runs until it is read
    texts = []
    for piece in resp:
        texts.append(piece.text)
        assert resp.stats is not None and resp.stats.running  # live figures while it runs
        assert resp.text == "".join(texts)
    assert resp.done and resp.finished.text == resp.text == engine.complete(engine.raw_prompt(PROMPTS[0]), cfg).text
    assert resp.result() is resp.finished and not resp.stats.running


def test_a_pushed_response_reads_as_a_pulled_one(engine, batch):
    cfg = GenConfig(method="lookup", k=3, max_tokens=30)
    pulled = engine.respond(engine.raw_prompt(PROMPTS[1]), cfg).result()
    resp = batch.submit(engine.raw_prompt(PROMPTS[1]), cfg)
    seen = []
    resp.listen(seen.append)
    while batch.active:
        batch.step()
    assert isinstance(seen[-1], Finished) and all(isinstance(e, Piece) for e in seen[:-1])
    assert resp.result().tokens == pulled.tokens and resp.text == pulled.text


def test_an_error_comes_after_the_pieces_before_it():
    r = Response()
    r.push(Piece("a", 1, False))
    r.push(SettingError("{logit_bias} bans every token", "logit_bias"))
    got = []
    with pytest.raises(SettingError):
        for p in r:
            got.append(p.text)
    assert got == ["a"] and r.text == "a" and r.done


@pytest.fixture(scope="module")
def byte_first(tmp_path_factory):
    """A model whose first answer token to "the cat" is the first byte of a two-byte character."""
    from localspec.core.engine import Engine
    from tinymodels import write_model

    e = Engine.load(write_model(tmp_path_factory.mktemp("bytes") / "m.gguf", 3), None, n_ctx=256)
    yield e
    e.close()


def test_so_far_holds_a_character_cut_short_that_text_does_not_release(byte_first):
    """A run that did not stream keeps so_far when it is cut off (a dead RPC worker): the first token alone was
    an empty `text`, so the answer kept was empty although a token had been counted."""
    cfg = GenConfig(method="none", max_tokens=5)
    resp = byte_first.respond(byte_first.raw_prompt("the cat"), cfg)
    first = next(iter(resp))
    assert first.text == "" and resp.text == "" and resp.stats.completion_tokens == 1
    assert resp.so_far == "\ufffd"  # as the Finished would end it
    whole = resp.result().text
    assert resp.so_far == whole and not whole.startswith("\ufffd")  # the next byte completed the character


def test_so_far_of_a_pushed_response(byte_first):
    from localspec.core.batch import BatchEngine

    b = BatchEngine(byte_first, 2)
    try:
        resp = b.submit(byte_first.raw_prompt("the cat"), GenConfig(method="none", max_tokens=5))
        while not resp.stats or resp.stats.completion_tokens < 1:
            b.step()
        assert resp.text == "" and resp.so_far == "\ufffd"
    finally:
        b.close()
