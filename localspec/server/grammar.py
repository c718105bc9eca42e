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
from localspec.server.json_schema import JSON_STYLE, closed, cut_endless

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
    cut, endless = cut_endless(schema)
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
