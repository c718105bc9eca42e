"""Structured output (`response_format` json_object / json_schema) with speculation kept on: the answer follows
the schema, and at temperature 0 it is the same with method none, lookup and draft (each verify row is masked by
the grammar state after the drafts before it). A schema llguidance cannot compile is a 400 naming the problem."""

from __future__ import annotations

import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from test_server_hardening import open_api, session  # noqa: E402,F401  (fixtures)

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["colour", "ok", "n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}


def check(obj):
    assert set(obj) == {"colour", "ok", "n"} and obj["colour"] in ("red", "green", "blue")
    assert isinstance(obj["ok"], bool) and isinstance(obj["n"], int) and 0 <= obj["n"] <= 99


def ask(c, method, fmt=FORMAT, prompt="Pick a colour as JSON.", k=None):
    ls = {"method": method, **({"k": k} if k else {})}
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": prompt}], max_tokens=64,
                                  temperature=0, response_format=fmt, extra_body={"localspec": ls})
    return r.choices[0].message.content, r.model_extra["localspec"]


def test_json_schema_output_validates_and_is_the_same_with_and_without_speculation(open_api):
    c = open_api.client(max_retries=0)
    texts = {}
    for method in ("none", "lookup", "draft"):
        texts[method], stats = ask(c, method)
        check(json.loads(texts[method]))
        if method == "draft":
            assert stats["drafted"] > 0  # speculation stayed on under the grammar
    assert texts["none"] == texts["lookup"] == texts["draft"], texts
    free = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Pick a colour as JSON."}],
                                     max_tokens=16, temperature=0).choices[0].message.content
    with pytest.raises(ValueError):
        check(json.loads(free))  # the tiny model does not write this JSON by itself: the grammar did


def test_json_object_output_is_an_object(open_api):
    c = open_api.client(max_retries=0)
    a, _ = ask(c, "none", {"type": "json_object"})
    b, _ = ask(c, "draft", {"type": "json_object"})
    assert a == b
    if a.rstrip().endswith("}"):  # 64 tokens may cut a long object; what came is a JSON object's start
        assert isinstance(json.loads(a), dict)
    assert a.lstrip().startswith("{")


@pytest.mark.parametrize("fmt,words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "format": "no-such-format"}}}}}, "format"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "yaml"}, "yaml"),
])
def test_an_unsupported_schema_is_a_400_naming_it(open_api, fmt, words):
    c = open_api.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, "none", fmt)
    err = e.value.body if "message" in e.value.body else e.value.body["error"]
    assert err["param"] == "response_format" and words in err["message"], err


def test_the_grammar_masks_each_verify_row_and_rolls_back():
    """The engine's hook on its own: drafts after the first refused one are dropped, each row gets the state after
    the drafts before it, and the matcher ends where it began."""
    from localspec.core.engine import _grammar_masks
    from localspec.drafters.base import Proposal

    class Digits:  # allows only the token "next digit" after a run: 1 then 2 then 3 ...
        def __init__(self):
            self.seq = []

        def allowed(self):
            a = np.zeros(10, dtype=bool)
            a[(self.seq[-1] + 1) % 10 if self.seq else 1] = True
            return a

        def consume(self, toks):
            self.seq += list(toks)
            return True

        def rollback(self, n):
            del self.seq[len(self.seq) - n:]
            return True

    g = Digits()
    p, masks = _grammar_masks(g, Proposal([1, 2, 3]))
    assert p.tokens == [1, 2, 3] and [int(np.argmax(m)) for m in masks] == [1, 2, 3, 4] and g.seq == []
    p, masks = _grammar_masks(g, Proposal([1, 5, 6, 7], q=np.ones((4, 10))))
    assert p.tokens == [1, 5] and p.q.shape[0] == 2 and len(masks) == 3 and g.seq == []
    assert [int(np.argmax(m)) for m in masks[:2]] == [1, 2]
