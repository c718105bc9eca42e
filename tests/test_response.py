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
