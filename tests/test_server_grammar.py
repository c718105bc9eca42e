"""Structured output (`response_format` json_object / json_schema) with speculation kept on: the answer follows
the schema, and at temperature 0 it is the same with method none, lookup and draft (each verify row is masked by
the grammar state after the drafts before it). A schema llguidance cannot compile, or one no finite value
satisfies, is a 400 naming the problem."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from helpers import post

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


def test_auto_drafts_the_tokens_the_schema_forces_and_the_answer_is_the_same(open_api):
    """Under a json_schema the declared keys, their quotes and colons are the only tokens the grammar allows where
    they stand: `auto` drafts them (source "grammar"), they are accepted, and the answer is plain decoding's."""
    c = open_api.client(max_retries=0)
    plain, _ = ask(c, "none")
    text, stats = ask(c, "auto", k=3)
    assert text == plain
    check(json.loads(text))
    src = stats["sources"]["grammar"]
    assert src["drafted"] >= 3 and src["accepted"] == src["drafted"], src
    free = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Pick a colour as JSON."}],
                                     max_tokens=16, temperature=0, extra_body={"localspec": {"method": "auto"}})
    assert "grammar" not in free.model_extra["localspec"]["sources"]  # no schema: nothing is forced


def test_a_batch_slot_drafts_forced_tokens_only_where_a_verify_row_is_cheap(session):
    """In a batch slot the grammar's forced tokens are drafted where a second verify row costs next to nothing (a
    GPU's curve), not on a compute-bound CPU's curve, where the other slots' rows already fill the machine. Each case
    starts with an empty suffix cache: the same answer cached (an earlier test's, or the other case's) is a repeat,
    which the suffix drafter drafts whole, forced tokens and all."""
    from localspec.core.batch import BatchEngine
    from localspec.core.engine import GenConfig
    from localspec.drafters.suffix_corpus import private_scope, release_scope
    from localspec.server.grammar import constraint_for

    e = session.engine
    prompt = e.raw_prompt("Pick a colour as JSON.")
    b = BatchEngine(e, 2)
    scope = e.suffix_scope
    try:
        drafted = {}
        for name, curve in (("cpu", {1: 1.0, 2: 1.75, 3: 2.25, 4: 2.85, 5: 3.45}),
                            ("gpu", {n: 1.0 + 0.02 * (n - 1) for n in range(1, 10)})):
            e.suffix_scope = private_scope()
            b._curve = curve
            b._ratios.clear()
            cfg = GenConfig(method="auto", k=3, max_tokens=40, constraint=constraint_for(FORMAT, e.target))
            fin = b.generate_all([(prompt, cfg)])[0]
            release_scope(e.suffix_scope)
            check(json.loads(fin.text))
            drafted[name] = fin.stats.drafted_by["grammar"]
        assert drafted["cpu"] == 0 and drafted["gpu"] >= 3, drafted
    finally:
        e.suffix_scope = scope
        b.close()


def test_the_grammar_says_which_tokens_it_forces(session):
    """Grammar.forced: the tokens of a declared key's text, up to a limit, and none where the model has a choice."""
    from localspec.server.grammar import constraint_for

    model = session.engine.target
    g = constraint_for(FORMAT, model)
    first = g.forced(16)
    assert first and b"colour" in b"".join(model.piece(t) for t in first)
    assert g.forced(1) == first[:1] and g.forced(0) == []
    assert g.consume(first)
    assert g.forced(16) == []  # the colour's value: one of three
    assert not np.all(g.allowed() == g.allowed()[0])


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
    from localspec.core.generation import grammar_masks as _grammar_masks
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


# schemas no finite JSON value satisfies: each way to a value needs the value itself, inside itself
def _cycle(key: str) -> dict:
    return {"type": "object", "properties": {"a": {"$ref": f"#/{key}/A"}}, "required": ["a"],
            key: {"A": {"type": "object", "properties": {"b": {"$ref": f"#/{key}/B"}}, "required": ["b"]},
                  "B": {"type": "object", "properties": {"a": {"$ref": f"#/{key}/A"}}, "required": ["a"]}}}


UNSATISFIABLE = {
    "self": {"$ref": "#"},
    "self-property": {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]},
    "defs-cycle": _cycle("$defs"),
    "definitions-cycle": _cycle("definitions"),
    "root-ref-cycle": {"$ref": "#/$defs/A", "$defs": _cycle("$defs")["$defs"]},
    "array-cycle": {"$defs": {"L": {"type": "array", "items": {"$ref": "#/$defs/L"}, "minItems": 1}},
                    "$ref": "#/$defs/L"},
    "anyOf-all-cyclic": {"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/B"}, {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/A"}}, "required": ["x"]}]}, "B": {"allOf": [{"$ref": "#/$defs/A"}]}},
        "$ref": "#/$defs/A"},
    "pointer-cycle": {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "q": {"$ref": "#/properties/p"}}, "required": ["q"]}}, "required": ["p"]},
}
# recursive schemas that do have finite values (a way out of the recursion): they must keep working
SATISFIABLE = {
    "tree": {"type": "object", "properties": {"v": {"type": "integer"},
                                              "kids": {"type": "array", "items": {"$ref": "#"}}},
             "required": ["v", "kids"]},
    "list": {"$defs": {"Node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {
        "anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}, "required": ["v", "next"]}}, "$ref": "#/$defs/Node"},
    "optional-cycle": {**_cycle("$defs"), "required": []},  # {} and objects without "a"
    "pydantic": {"$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}}, "type": "object",
                 "properties": {"u": {"$ref": "#/$defs/Unit"}}, "required": ["u"]},
    "pydantic-v1": {"definitions": {"Unit": {"enum": ["c", "f"], "type": "string"}}, "type": "object",
                    "properties": {"u": {"$ref": "#/definitions/Unit"}}, "required": ["u"]},
}


def _rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("name", UNSATISFIABLE)
def test_a_schema_no_value_satisfies_is_a_400_naming_response_format(open_api, name):
    status, _, err = post(open_api, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": _rf(UNSATISFIABLE[name])})
    assert status == 400 and err["error"]["param"] == "response_format", err
    assert "satisf" in err["error"]["message"], err
    status, _, err = post(open_api, "/v1/responses", {"input": "hi", "max_output_tokens": 4,
                                                      "response_format": _rf(UNSATISFIABLE[name])})
    assert status == 400 and err["error"]["param"] == "response_format", err


@pytest.mark.parametrize("name", SATISFIABLE)
def test_recursive_and_defs_schemas_that_have_values_are_served(open_api, name):
    status, _, body = post(open_api, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "response_format": _rf(SATISFIABLE[name])})
    assert status == 200, body
    text = body["choices"][0]["message"]["content"]
    assert text.startswith("{"), body
    if name.startswith("pydantic"):
        assert json.loads(text) in ({"u": "c"}, {"u": "f"})
    status, _, body = post(open_api, "/v1/responses", {"input": "hi", "max_output_tokens": 24,
                                                       "response_format": _rf(SATISFIABLE[name])})
    assert status == 200 and body["output"][0]["content"][0]["text"].startswith("{"), body


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "g"}}, "auto"])
def test_a_tool_schema_no_value_satisfies_is_a_400_naming_the_tool(open_api, monkeypatch, choice):
    import localspec.server.app as A

    monkeypatch.setattr(A, "template_text", lambda eng: "... <tool_call> ...")  # auto: a lazy grammar is built
    ok = {"type": "function", "function": {"name": "f", "parameters": SATISFIABLE["pydantic"]}}
    for name, schema in UNSATISFIABLE.items():
        bad = {"type": "function", "function": {"name": "g", "parameters": schema}}
        status, _, err = post(open_api, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [ok, bad],
            "tool_choice": choice})
        assert status == 400 and err["error"]["param"] == "tools[1]", (name, err)


def test_a_ring_of_definitions_is_refused_and_the_same_ring_with_a_way_out_is_accepted():
    """A ring of definitions, each needing the next, is refused; the same ring with one way out is accepted. (The
    check is a fixpoint over the definitions, not a search of the recursion.)"""
    from localspec.server.grammar import grammar_of
    from localspec.server.openai import APIError

    n = 60
    ring = {f"D{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/D{(i + 1) % n}"},
                                                       "y": {"$ref": f"#/$defs/D{(i * 7 + 3) % n}"}},
                      "required": ["x"]} for i in range(n)}
    with pytest.raises(APIError) as e:
        grammar_of(_rf({"$defs": ring, "$ref": "#/$defs/D0"}))
    assert e.value.status == 400 and e.value.param == "response_format"
    ring["D17"] = {"anyOf": [ring["D17"], {"type": "null"}]}
    assert grammar_of(_rf({"$defs": ring, "$ref": "#/$defs/D0"}))


@pytest.mark.parametrize("schema", [
    {**_cycle("$defs"), "required": [], "additionalProperties": False},
    {**UNSATISFIABLE["pointer-cycle"], "required": [], "additionalProperties": False},
])
def test_an_optional_part_no_value_satisfies_is_cut_off(schema):
    """A property whose value could never end is left out of the grammar: after "{" only "}" may follow (the
    answer cannot walk into the endless part, where it would be cut off unfinished)."""
    import llguidance

    from localspec.server.grammar import _byte_tokenizer, grammar_of

    m = llguidance.LLMatcher(_byte_tokenizer(), grammar_of(_rf(schema)), log_level=0)
    assert m.consume_tokens([ord("{")])
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
    assert [bytes([int(b)]) for b in bits.nonzero()[0] if b < 256] == [b"}"]


# ----------------------------------------------------------------- strict semantics: declared properties only
def accepts(grammar: str, text: str) -> bool:
    """Whether `grammar` takes `text` whole (on a byte tokenizer: the same for every model)."""
    import llguidance

    from localspec.server.grammar import _byte_tokenizer

    m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "pet": {"type": "object", "properties": {"kind": {"type": "string"}}}},
          "required": ["name", "age"]}


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}


def test_json_schema_allows_only_declared_properties_unless_it_says_otherwise():
    from localspec.server.grammar import grammar_of

    closed = grammar_of(fmt(PERSON))
    assert accepts(closed, '{"name": "Ann", "age": 3}')
    assert accepts(closed, '{"name": "Ann", "age": 3, "pet": {"kind": "cat"}}')
    assert not accepts(closed, '{"name": "Ann", "age": 3, "city": "Oslo"}')
    assert not accepts(closed, '{"name": "Ann", "age": 3, "pet": {"kind": "cat", "legs": 4}}')  # nested too
    opened = grammar_of(fmt({**PERSON, "additionalProperties": True}))
    assert accepts(opened, '{"name": "Ann", "age": 3, "city": "Oslo"}')
    assert not accepts(opened, '{"name": "Ann", "age": 3, "pet": {"kind": "cat", "legs": 4}}')  # only where said
    pet_open = {**PERSON, "properties": {**PERSON["properties"], "pet": {"type": "object", "properties": {
        "kind": {"type": "string"}}, "additionalProperties": True}}}
    assert accepts(grammar_of(fmt(pet_open)), '{"name": "Ann", "age": 3, "pet": {"kind": "cat", "legs": 4}}')
    typed = grammar_of(fmt({**PERSON, "additionalProperties": {"type": "integer"}}))
    assert accepts(typed, '{"name": "Ann", "age": 3, "n": 4}')
    assert not accepts(typed, '{"name": "A", "age": 3, "n": "x"}')
    # an object that declares no properties is any object; json_object too
    free = grammar_of(fmt({"type": "object", "properties": {"meta": {"type": "object"}}}))
    assert accepts(free, '{"meta": {"anything": [1, 2]}}')
    assert accepts(grammar_of({"type": "json_object"}), '{"a": 1, "b": 2}')


def test_defs_and_array_items_are_closed_and_the_schema_given_is_not_changed():
    import copy

    from localspec.server.grammar import grammar_of

    schema = {"$defs": {"Pet": {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"]}},
              "type": "object", "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}}},
              "required": ["pets"]}
    before = copy.deepcopy(schema)
    g = grammar_of(fmt(schema))
    assert schema == before
    assert accepts(g, '{"pets": [{"kind": "cat"}]}')
    assert not accepts(g, '{"pets": [{"kind": "cat", "age": 2}]}') and not accepts(g, '{"pets": [], "x": 1}')


def test_objects_built_from_parts_keep_each_parts_keys():
    """allOf parts declare keys of one object: none of them may make the others' keys extra."""
    from localspec.server.grammar import grammar_of

    both = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                      {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert accepts(grammar_of(fmt(both)), '{"a": 1, "b": 2}')


def test_json_schema_without_additional_properties_gives_only_the_declared_keys(open_api):
    c = open_api.client(max_retries=0)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
              "required": ["colour"]}
    for method in ("none", "draft"):
        r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "the cat"}], max_tokens=60,
                                      temperature=0, response_format=fmt(schema),
                                      extra_body={"localspec": {"method": method}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert set(json.loads(r.choices[0].message.content)) <= {"colour", "n"}


def test_tool_parameters_are_closed_at_every_level():
    from localspec.server import tool_grammar as TG

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"pet": {"type": "object", "properties": {"kind": {"type": "string"}}}},
        "required": ["pet"]}}}
    g = TG.choice_grammar([tool], "required", None)
    assert accepts(g, '{"name": "f", "arguments": {"pet": {"kind": "cat"}}}')
    assert not accepts(g, '{"name": "f", "arguments": {"pet": {"kind": "cat", "legs": 4}}}')


def test_the_grammar_drafter_walks_the_matcher_once_per_grammar_state():
    """A step asks the grammar drafter twice at one state (offer, then propose): the forced tokens are computed once,
    again at the next state, and again where a bigger k may find more than the first walk was allowed to."""
    from localspec.drafters.grammar import GrammarDrafter

    class Forced:
        walks = 0

        def forced(self, limit):
            self.walks += 1
            return [7, 8, 9][:limit]

    con = Forced()
    d = GrammarDrafter(con)
    ctx = [1, 2, 3]
    assert d.offer(ctx, 4).k == 3 and d.propose(ctx, 4, None, None).tokens == [7, 8, 9]
    assert d.propose(ctx, 2, None, None).tokens == [7, 8] and con.walks == 1
    assert d.offer(ctx + [7], 2).k == 2 and con.walks == 2
    assert d.propose(ctx + [7], 4, None, None).tokens == [7, 8, 9] and con.walks == 3  # the walk stopped at 2
    assert d.offer(ctx, 0) is None and con.walks == 3
