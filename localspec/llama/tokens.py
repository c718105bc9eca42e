"""A loaded model's vocabulary: text to tokens and back, control tokens kept out of message content, the facts the
pair check reads. Mixed into llama/model.py's Model, which provides `_vocab`, `n_vocab` and the piece caches."""

from __future__ import annotations

import ctypes
from typing import Sequence

from localspec.llama.lib import ll as _ll
from localspec.llama.vocab import VocabInfo

_C_SPACE = " \t\n\v\f\r"  # isspace() in the C locale, as llama.cpp strips around tokens

VOCAB_TYPES = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}


class Tokens:
    """The vocabulary half of Model."""

    def is_eog(self, token: int) -> bool:
        return bool(_ll.llama_vocab_is_eog(self._vocab, token))

    def vocab_info(self) -> VocabInfo:
        ll = _ll
        v = self._vocab
        return VocabInfo(
            vocab_type=VOCAB_TYPES.get(int(ll.llama_vocab_type(v)), "unknown"),
            n_vocab=self.n_vocab,
            bos=int(ll.llama_vocab_bos(v)),
            eos=int(ll.llama_vocab_eos(v)),
            add_bos=bool(ll.llama_vocab_get_add_bos(v)),
            add_eos=bool(ll.llama_vocab_get_add_eos(v)),
            token_text=_LazyTokenText(self),
        )

    def token_text(self, token: int) -> bytes:
        ptr = _ll.llama_vocab_get_text(self._vocab, token)
        return ptr or b""

    # ------------------------------------------------------------- text <-> ids
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.tokenize_bytes(text.encode("utf-8"), add_special=add_special, parse_special=parse_special)

    def tokenize_bytes(self, data: bytes, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Tokens of raw bytes (the text may end inside a UTF-8 character)."""
        n_max = len(data) + 16
        buf = (_ll.llama_token * n_max)()
        n = _ll.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (_ll.llama_token * n_max)()
            n = _ll.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """Bytes of one token as it appears in generated text; special: a special token rendered as its text
        ('<|im_start|>'), else as nothing."""
        cache = self._special_piece_cache if special else self._piece_cache
        b = cache.get(token)
        if b is None:
            buf = ctypes.create_string_buffer(64)
            n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            b = cache[token] = buf.raw[:n]
        return b

    def is_control(self, token: int) -> bool:
        return bool(_ll.llama_vocab_is_control(self._vocab, token))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def special_text(self, which: str) -> str:
        """The text of the BOS or EOS token ("" if the model has none), as chat templates print it."""
        tok = {"bos": _ll.llama_vocab_bos, "eos": _ll.llama_vocab_eos}[which](self._vocab)
        return self.token_text(tok).decode("utf-8", "replace") if tok >= 0 else ""

    def tokenize_segments(self, segments: Sequence[tuple[str, bool]]) -> list[int]:
        """Tokenize a rendered chat prompt given as (text, is_content) pieces, with BOS as the vocab wants it.

        Control tokens are recognised only in the template's markup (is_content False); message content is always
        plain text, so '<|im_end|>' written by a user stays text. Otherwise the result equals llama.cpp's own
        tokenization of the joined text with parse_special: the markup is split at its control tokens (longest
        text first, with the tokens' lstrip/rstrip attributes) and each text run between control tokens, markup
        and content together, is tokenized whole, as llama.cpp tokenizes the fragments between special tokens.
        """
        items: list[str | int] = []  # text runs and control token ids
        rstrip_next = False

        def add_text(t: str) -> None:
            nonlocal rstrip_next
            if rstrip_next:
                t = t.lstrip(_C_SPACE)
                rstrip_next = not t
            if not t:
                return
            if items and isinstance(items[-1], str):
                items[-1] += t
            else:
                items.append(t)

        for text, is_content in segments:
            if is_content:
                add_text(text)
                continue
            for part in self._split_control(text):
                if isinstance(part, str):
                    add_text(part)
                    continue
                tok, attr = part
                if attr & _ll.LLAMA_TOKEN_ATTR_LSTRIP and items and isinstance(items[-1], str):
                    items[-1] = items[-1].rstrip(_C_SPACE)
                    if not items[-1]:
                        items.pop()
                items.append(tok)
                rstrip_next = bool(attr & _ll.LLAMA_TOKEN_ATTR_RSTRIP)
        out: list[int] = []
        v = self._vocab
        bos = int(_ll.llama_vocab_bos(v))
        if _ll.llama_vocab_get_add_bos(v) and bos >= 0 and not (items and items[0] == bos):
            out.append(bos)  # a template that prints bos_token itself gets it once, not twice
        for item in items:
            if isinstance(item, int):
                out.append(item)
            else:
                out += self.tokenize(item, add_special=False, parse_special=False)
        return out

    def has_control_text(self, text: str) -> bool:
        """Whether `text` holds the text of a control token (as llama.cpp would parse it in markup): a string
        that must stay plain text when a chat template prints it (ChatTemplate.segments)."""
        return any(not isinstance(p, str) for p in self._split_control(text))

    def _split_control(self, text: str) -> list:
        """`text` split into str runs and (token, attr) for every control/unknown token llama.cpp would match."""
        specials: dict[str, tuple[int, int]] = {}
        mask = _ll.LLAMA_TOKEN_ATTR_CONTROL | _ll.LLAMA_TOKEN_ATTR_UNKNOWN
        for t in set(self.tokenize(text, add_special=False, parse_special=True)):
            attr = int(_ll.llama_vocab_get_attr(self._vocab, t))
            if attr & mask and self.token_text(t):
                specials[self.token_text(t).decode("utf-8", "replace")] = (t, attr)
        parts: list = [text]
        for s in sorted(specials, key=len, reverse=True):
            split: list = []
            for p in parts:
                if not isinstance(p, str):
                    split.append(p)
                    continue
                for i, chunk in enumerate(p.split(s)):
                    if i:
                        split.append(specials[s])
                    if chunk:
                        split.append(chunk)
            parts = split
        return parts


class _LazyTokenText(Sequence):
    """token id -> text bytes without materialising 150k strings up front."""

    def __init__(self, model: Tokens) -> None:
        self._m = model

    def __len__(self) -> int:
        return self._m.n_vocab

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._m.token_text(j) for j in range(*i.indices(len(self)))]
        return self._m.token_text(i)
