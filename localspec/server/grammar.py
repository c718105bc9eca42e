"""Structured output: `response_format` `json_object` / `json_schema` decoded under a grammar (llguidance), with
speculation kept on. The engine masks each verify row with the grammar state after the drafts before it and rolls
the matcher back after the look-ahead (GenConfig.constraint; core/engine.py), so the output at temperature 0 is
the same with and without speculation.

A schema llguidance cannot compile, or one no finite JSON value satisfies, is a 400 naming the field and what was
refused, checked before the request queues.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from localspec.server.openai import APIError

# one JSON layout (`{"a": 1, "b": [2, 3]}`, as json.dumps writes it): free whitespace lets a model pad forever;
# a schema's own "x-guidance" options override it
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def format_schema(response_format, param: str = "response_format") -> dict | None:
    """The JSON Schema a request's `response_format` asks for (None: free text), as given. 400 for a bad or
    unsupported one."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise APIError(400, "response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                       param=param)
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = response_format.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON Schema object", param=param)
        return schema
    raise APIError(400, f"response_format.type {kind!r} is not supported; use text, json_object or json_schema",
                   param=param)


def schema_of(response_format, where: str = "response_format", param: str | None = None) -> dict | None:
    """The schema to enforce for `response_format` (strict semantics: `closed`; parts no finite value satisfies
    cut off), None for free text; 400 naming `param` (default `where`) for one llguidance cannot enforce."""
    schema = format_schema(response_format, param or where)
    return None if schema is None else usable_schema(closed(schema), where, param or where)[0]


def grammar_of(response_format) -> str | None:
    """The llguidance grammar of a request's `response_format` (None: free text). 400 for a bad or unsupported
    one."""
    schema = format_schema(response_format)
    return None if schema is None else usable_schema(closed(schema), "response_format", "response_format")[1]


# subschema places: keys holding one schema, keys holding a list of them (allOf's are parts of one object)
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "additionalProperties",
        "unevaluatedProperties", "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "prefixItems", "items")
_OPEN = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "anyOf", "oneOf", "$ref",
         "if", "dependentSchemas")


def closed(schema, _part: bool = False):
    """`schema` with OpenAI's strict semantics (and llama-server's): an object schema that declares `properties`
    allows those only, unless it says otherwise (`additionalProperties`, `patternProperties`...). JSON Schema's
    default would let a model add keys until the token limit cuts the JSON. Left as they are: objects that
    declare no properties (any object), and objects built from parts (allOf, a `$ref` beside properties, anyOf /
    oneOf beside them), where a key one part declares would be extra to another."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _DATA:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):
            out[k] = {name: closed(sub) for name, sub in v.items()}
        elif k == "allOf" and isinstance(v, list):
            out[k] = [closed(x, _part=True) for x in v]
        elif k in _ONE or k in _MANY:
            out[k] = closed(v)
        else:
            out[k] = v
    if "properties" in out and not _part and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out


def usable_schema(schema, where: str, param: str) -> tuple[dict, str]:
    """(the schema to enforce, its llguidance grammar) for a request's JSON Schema; a 400 naming `param` (`where`:
    the field, for the message) when llguidance cannot compile it or no value satisfies it. Where the schema's
    references loop, the schema to enforce has the parts no finite value satisfies cut off (set to false):
    llguidance builds a grammar rule per reference and would let the answer walk into such a part, where it can
    never end."""
    import llguidance

    def compile_(s) -> str:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(s, defaults=JSON_STYLE)
        except ValueError as exc:
            raise APIError(400, f"{where}: the schema is not valid: {exc}", param=param) from None
        problem = grammar_problem(grammar)
        if problem is not None:
            raise APIError(400, f"{where}: unsupported JSON Schema: {problem}", param=param,
                           code="unsupported_schema")
        return grammar

    grammar = compile_(schema)  # first: llguidance refuses a schema nested too deeply for the walks below
    cut, endless = _cut_endless(schema)
    if endless is not None:
        raise APIError(400, f"{where}: the JSON Schema is unsatisfiable: no finite JSON value satisfies it (each "
                            f"value needs another inside it through {endless!r})", param=param,
                       code="unsupported_schema")
    if cut is not schema:
        try:
            return cut, compile_(cut)
        except APIError:
            pass  # a pointer that ran through a part cut off: the schema as it came
    return schema, grammar


def grammar_problem(grammar: str) -> str | None:
    """Why llguidance refuses `grammar` (one line), or None. Besides its own checks, a grammar whose matcher
    allows nothing from the start (llguidance proves no text can follow, e.g. a schema that is only a
    reference to itself) is refused: a request under it would end with an empty answer."""
    import llguidance

    try:
        is_err, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except ValueError as exc:
        is_err, messages = True, [exc]
    if is_err:
        return " ".join(str(messages[0]).split()) if messages else "not supported"
    m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    first = m.compute_bitmask()
    if m.is_error():
        return "unsatisfiable: the grammar allows no output: " + " ".join(m.get_error().split("<state>")[0].split())
    if m.is_accepting() or any(first):
        return None
    return "unsatisfiable: the grammar allows no output"


class _Bytes:
    """A tokenizer of the 256 bytes (and an end token): a grammar's first byte is checked on it, the same for
    every model."""
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def _byte_tokenizer():
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    global _BYTES
    with _LOCK:
        if _BYTES is None:
            _BYTES = llguidance.LLTokenizer(TokenizerWrapper(_Bytes()), n_vocab=257)
        return _BYTES


_BYTES = None


# keywords whose values are JSON data, not schemas (a "$ref" key in a `const` is data); and keywords that map names
# to schemas (a property may be called "$ref" or "enum")
_DATA = frozenset({"const", "enum", "default", "examples"})
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def map_refs(node, fn):
    """A copy of the JSON Schema `node` in which each subschema that holds a `$ref` is replaced by fn(subschema)
    (its own subschemas mapped first). A subschema with its own `$id` is a resource of its own, whose references
    resolve against it: it is kept as it is."""
    if isinstance(node, list):
        return [map_refs(x, fn) for x in node]
    if not isinstance(node, dict) or "$id" in node:
        return node
    out = {}
    for k, v in node.items():
        if k in _DATA:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):
            out[k] = {name: map_refs(sub, fn) for name, sub in v.items()}
        else:
            out[k] = map_refs(v, fn)
    return fn(out) if isinstance(out.get("$ref"), str) else out


def rebase(schema, at: str):
    """`schema` as a part of a larger schema, at the JSON pointer `at` there: its local references ("#",
    "#/$defs/...", "#/properties/...") point at the same places under `at`, so its `$defs` / `definitions` are
    found where they now are (a pointer names a place in the whole document, and llguidance reads the whole
    grammar's schema as the document)."""
    def move(sub):
        ref = sub["$ref"]
        return {**sub, "$ref": "#" + at + ref[1:]} if ref == "#" or ref.startswith("#/") else sub

    return map_refs(schema, move)


def _pointer(ref: str) -> tuple[str, ...] | None:
    """The keys a local JSON pointer reference ("#", "#/$defs/A") follows; None for any other reference (an
    anchor, another document)."""
    from urllib.parse import unquote

    if ref == "#":
        return ()
    if not ref.startswith("#/"):
        return None
    return tuple(unquote(k).replace("~1", "/").replace("~0", "~") for k in ref[2:].split("/"))


def _at(schema, path: tuple[str, ...]):
    node = schema
    for k in path:
        if isinstance(node, list) and k.isdigit() and int(k) < len(node):
            node = node[int(k)]
        elif isinstance(node, dict) and k in node:
            node = node[k]
        else:
            return None
    return node if isinstance(node, (dict, bool)) else None


def _nested_id(node, top: bool = True) -> bool:
    """Whether a subschema below the top sets its own `$id` (references inside it resolve against it)."""
    if isinstance(node, list):
        return any(_nested_id(x, False) for x in node)
    if not isinstance(node, dict):
        return False
    if "$id" in node and not top:
        return True
    return any(_nested_id(list(v.values()) if k in _NAMED and isinstance(v, dict) else v, False)
               for k, v in node.items() if k not in _DATA)


def _cut_endless(schema) -> tuple[dict, str | None]:
    """(schema, None) where no local reference loops. Where references loop, which parts have a finite value is
    found as a least fixpoint (a grammar's productive rules): a part is satisfiable when llguidance accepts it with
    each reference inside it read as "any value" if its target is already known satisfiable and as `false`
    otherwise; repeated until nothing changes. Then (the schema with each reference to a part that is not
    satisfiable set to `false`, None), or (schema, the reference) when the schema itself is not satisfiable.
    References that are no local pointers, or a nested `$id`, leave the schema to llguidance as it is."""
    import graphlib

    import llguidance

    if _nested_id(schema):
        return schema, None
    doc = {k: v for k, v in schema.items() if k != "$id"}  # the top's own `$id` is the document's: pointers hold
    parts = {(): doc}  # the schema and each place a reference points at, by path
    needs: dict[tuple, set] = {}  # part -> the places its references point at
    names: dict[tuple, str] = {}  # place -> a reference that names it, for the message
    todo = [()]
    while todo:
        path = todo.pop()
        found: set[tuple] = set()

        def note(sub):
            target = _pointer(sub["$ref"])
            found.add(target)
            names.setdefault(target, sub["$ref"])
            return sub

        map_refs(parts[path], note)
        if None in found:
            return schema, None
        needs[path] = found
        for t in found - parts.keys():
            part = _at(doc, t)
            if part is None:
                return schema, None
            parts[t] = part
            todo.append(t)
    try:
        graphlib.TopologicalSorter(needs).prepare()
        return schema, None  # no loop: llguidance reports an unsatisfiable definition itself
    except graphlib.CycleError:
        pass

    root_options = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}

    def read_as(good):
        return lambda sub: {k: v for k, v in sub.items() if k != "$ref"} if _pointer(sub["$ref"]) in good else False

    def satisfiable(part) -> bool:
        if isinstance(part, bool):
            return part
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(part, defaults={**JSON_STYLE, **root_options})
            return not llguidance.LLMatcher.validate_grammar_with_warnings(g)[0]
        except ValueError:
            return False

    users: dict[tuple, set] = {p: set() for p in parts}
    for p, ts in needs.items():
        for t in ts:
            users[t].add(p)
    good: set[tuple] = set()
    queue = list(parts)
    while queue:
        p = queue.pop()
        if p not in good and satisfiable(map_refs(parts[p], read_as(good))):
            good.add(p)
            queue.extend(users[p] - good)
    if () not in good:
        bad = sorted(t for t in needs[()] if t not in good) or [()]
        return schema, names.get(bad[0], "#")
    cut = map_refs(doc, lambda sub: sub if _pointer(sub["$ref"]) in good else False)
    return ({**cut, "$id": schema["$id"]} if "$id" in schema else cut), None


class _Vocab:
    """The target's vocabulary as llguidance reads it: each token's bytes (control tokens marked with 0xff)."""

    def __init__(self, model) -> None:
        toks = []
        for t in range(model.n_vocab):
            b = model.piece(t)
            if not b:
                text = model.token_text(t)
                b = b"\xff" + text if text else b""
            toks.append(b)
        self.tokens = toks
        self.eos_token_id = [t for t in range(model.n_vocab) if model.is_eog(t)] or [model.vocab_info().eos]
        self.bos_token_id = None
        self.special_token_ids = []
        self._model = model
        self._by_bytes: dict | None = None
        self._longest = 1

    def __call__(self, data: bytes) -> list[int]:
        """The model's tokenization when it spells `data` exactly; otherwise (a SentencePiece vocabulary adds a
        space in front) the longest-match one, which the grammar accepts just as well."""
        ids = self._model.tokenize(data.decode("utf-8", "replace"), add_special=False, parse_special=False)
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        if self._by_bytes is None:
            self._by_bytes = {}
            for i, b in enumerate(self.tokens):
                if b and not b.startswith(b"\xff"):
                    self._by_bytes.setdefault(b, i)
            self._longest = max(map(len, self._by_bytes), default=1)
        out, pos = [], 0
        while pos < len(data):
            for n in range(min(self._longest, len(data) - pos), 0, -1):
                i = self._by_bytes.get(data[pos:pos + n])
                if i is not None:
                    out.append(i)
                    pos += n
                    break
            else:
                pos += 1  # a byte no token spells (no byte tokens in this vocabulary)
        return out


def tokenizer_for(model):
    """llguidance's tokenizer for `model`, built once per loaded model (a second or so on a big vocabulary)."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    with _LOCK:
        tok = _TOKENIZERS.get(model)
        if tok is None:
            v = _Vocab(model)
            eos = v.eos_token_id
            v.eos_token_id = eos[0]
            tok = _TOKENIZERS[model] = llguidance.LLTokenizer(TokenizerWrapper(v), n_vocab=model.n_vocab,
                                                              eos_token=eos)
        return tok


class Grammar:
    """GenConfig.constraint for one request: the matcher is made on first use (in the worker thread)."""

    def __init__(self, grammar: str, model) -> None:
        self.grammar = grammar
        self.model = model
        self.n_vocab = model.n_vocab
        self.matcher = None
        self.mask_s = 0.0  # time spent computing masks (the per-step cost of the grammar)
        self.masks = 0

    def _m(self):
        if self.matcher is None:
            import llguidance

            self.matcher = llguidance.LLMatcher(tokenizer_for(self.model), self.grammar, log_level=0)
        return self.matcher

    def allowed(self) -> np.ndarray:
        import time

        t0 = time.perf_counter()
        m = self._m()
        if m.is_error() or m.is_stopped():  # nothing but the end of the answer
            a = np.zeros(self.n_vocab, dtype=bool)
            for t in (tokenizer_for(self.model).eos_tokens or []):
                a[t] = True
        else:
            bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
            a = np.unpackbits(bits, bitorder="little")[:self.n_vocab].astype(bool)
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        return a

    def consume(self, tokens) -> bool:
        return self._m().consume_tokens([int(t) for t in tokens])

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (the only ones it allows there), from the current state."""
        m = self._m()
        if limit <= 0 or m.is_error() or m.is_stopped():
            return []
        return [int(t) for t in m.compute_ff_tokens()[:limit]]

    def rollback(self, n: int) -> bool:
        return self._m().rollback(n)


def constraint_for(response_format, model) -> Grammar | None:
    g = grammar_of(response_format)
    return Grammar(g, model) if g is not None else None



class Lazy:
    """A constraint that lets the model write anything until its answer matches `trigger` (a regular expression:
    a tool call's start, e.g. `<tool_call>` or a fenced JSON object up to a tool's name), then holds the rest to
    `grammar`, which reads the answer from where the match starts: a tool call under tool_choice "auto" (the model
    chooses whether to call; once it does, the call follows the tool's schema). The match may start inside a token:
    the grammar is given the text from there (tokenized again; a grammar reads bytes, not token ids). Rolls back
    like Grammar, also to before the trigger."""

    WINDOW = 512  # bytes of recent text a trigger match may span (a match longer than this is never found)

    def __init__(self, grammar: str, model, trigger: str) -> None:
        import re

        self.inner = Grammar(grammar, model)
        self.model = model
        self.trigger = re.compile(trigger.encode())
        self.tokens: list[int] = []
        self.text = bytearray()  # the answer so far (before the trigger)
        self.ends: list[int] = []  # per consumed token: len(text) after it
        self.start: int | None = None  # the token in which the grammar took over
        self.done = 0  # tokens consumed when the trigger matched: a rollback below it frees the answer again
        self._all = np.ones(model.n_vocab, dtype=bool)

    @property
    def active(self) -> bool:
        return self.start is not None

    def allowed(self) -> np.ndarray:
        return self.inner.allowed() if self.start is not None else self._all

    def forced(self, limit: int) -> list[int]:
        return self.inner.forced(limit) if self.start is not None else []

    def _match(self, new: int):
        """The first trigger match that ends in the last `new` bytes (an earlier one was seen before)."""
        pos = max(0, len(self.text) - self.WINDOW)
        while True:
            m = self.trigger.search(self.text, pos)
            if m is None or m.end() > len(self.text) - new:
                return m
            pos = m.start() + 1

    def consume(self, tokens) -> bool:
        for t in (int(x) for x in tokens):
            self.tokens.append(t)
            if self.start is not None:
                if not self.inner.consume([t]):
                    return False
                self.ends.append(len(self.text))
                continue
            piece = self.model.piece(t)
            self.text += piece
            self.ends.append(len(self.text))
            m = self._match(len(piece)) if piece else None
            if m is None:
                continue
            rest = tokenizer_for(self.model).tokenize_bytes(bytes(self.text[m.start():]))
            if self.inner.consume(rest):
                self.start = next(i for i, e in enumerate(self.ends) if e > m.start())
                self.done = len(self.tokens)
            else:
                self.inner.matcher = None  # what follows the trigger is no call: stay free (a fresh matcher)
        return True

    def rollback(self, n: int) -> bool:
        if n <= 0:
            return True
        keep = len(self.tokens) - n
        if self.start is not None:
            if keep < self.done:  # back to before the trigger matched
                self.inner.matcher, self.start = None, None
            else:
                self.inner.rollback(n)
        del self.tokens[keep:]
        del self.ends[keep:]
        del self.text[self.ends[-1] if self.ends else 0:]
        return True
