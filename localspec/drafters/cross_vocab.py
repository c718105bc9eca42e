"""A draft model with another vocabulary (its own tokenizer): it drafts in its own tokens, their text is turned into
the target's tokens, and the target verifies those as any draft.

The draft's context is the draft's tokenization of the target's text: the target's prompt and answer rendered as
bytes (special tokens as their text, so chat markup the draft shares becomes its own control tokens; the target's BOS
left out for the draft's own). Each step the text after a safe boundary a little before its first change is
tokenized again (_retokenize) and the draft model's cache keeps the common prefix (Model.sync), so where the target
finished a word differently than the draft had split it, the draft's tokens are redone from that boundary on and
nothing drifts over a long answer, while a step tokenizes only about the new text (the whole of a few thousand tokens
takes llama.cpp several milliseconds, as much as a draft decode).

A proposal: the draft decodes its own tokens greedily (its argmax is its best guess of the target's likeliest token,
which is what a deterministic proposal is accepted by); their bytes are appended to the text, and the target's tokens
for them are the target's tokenization of the context's last tokens' text plus the new bytes, cut after the context's
part. A target token whose text is not exactly the drafted bytes (a byte sequence the target's tokenizer cannot
represent, an unknown token), a draft control or end-of-generation token, or a target token that would span the
context's end stops the proposal there; the answer goes on from the target's own token. The last target token of the
conversion is dropped unless the draft went past it (the word may not be finished), so the proposal is the target
tokens the drafted text fixes.

Proposals are deterministic (q one-hot), so verification stays exact: at temperature 0 the output is plain decoding's,
above it Leviathan's rule with a one-hot q keeps the target's distribution (a seed: keyed draws, as any drafter).
"""

from __future__ import annotations

import bisect
import time
from typing import Sequence

import numpy as np

from localspec.drafters.base import Drafter, Proposal
from localspec.drafters.draft_model import confident
from localspec.sample.sampling import SamplingParams
from localspec.seq import common_prefix

RETOKENIZE_MARGIN = 16  # bytes before the text's first change whose draft tokens are kept as they were
CHECK_TOKENS = 4  # kept draft tokens tokenized again with the new text: they must come out the same
ANCHOR_TOKENS = 3  # context tokens whose text precedes the drafted bytes when they are tokenized for the target
DRAFT_STEPS_PER_TOKEN = 2  # draft tokens decoded per target token asked for, at most (plus 2): tokenizers differ


class TextVocab:
    """Bytes <-> tokens of a loaded Model, as the cross-vocabulary drafter needs them: tokenization of raw bytes
    (the text may end inside a UTF-8 character), pieces with special tokens rendered as their text, control tokens,
    and the space some tokenizers put in front of a text (SentencePiece's prefix space)."""

    def __init__(self, model) -> None:
        self.model = model
        probe = self.tokenize(b"a", parse_special=False)
        rendered = b"".join(model.piece(t) for t in probe)
        self.lead = max(len(rendered) - 1, 0) if rendered.endswith(b"a") else 0
        info = model.vocab_info()
        self.bos = info.bos if info.add_bos and info.bos >= 0 else None

    def tokenize(self, data: bytes, parse_special: bool) -> list[int]:
        return self.model.tokenize_bytes(data, add_special=False, parse_special=parse_special)

    def special_piece(self, token: int) -> bytes:
        """The token's bytes with a special token rendered as its text ('<|im_start|>')."""
        return self.model.piece(token, special=True)

    def is_control(self, token: int) -> bool:
        return self.model.is_control(token) or self.model.is_eog(token)


def to_target(tv: TextVocab, anchor: bytes, new: bytes) -> list[int] | None:
    """The target's tokens for bytes `new` written after a context whose last tokens' text is `anchor`: the target's
    tokenization of anchor + new, after the tokens that make up the anchor, as long as each token's text is exactly
    the next bytes of `new` (what the target cannot represent ends the list). None where a token spans the anchor's
    end (the new bytes would merge with the context's last token: no more bytes can undo that)."""
    ids = tv.tokenize(anchor + new, parse_special=False)
    pieces = [tv.model.piece(t) for t in ids]
    want, pos, i = tv.lead + len(anchor), 0, 0
    while i < len(ids) and pos < want:
        pos += len(pieces[i])
        i += 1
    if pos != want or b"".join(pieces[:i])[tv.lead:] != anchor:
        return None
    out, off = [], 0
    for t, p in zip(ids[i:], pieces[i:]):
        if not p or new[off:off + len(p)] != p or tv.is_control(t):
            break
        out.append(t)
        off += len(p)
    return out


class CrossVocabDrafter(Drafter):
    """A draft Model whose vocabulary differs from the target's (see the module's docstring). Named "draft": it is
    the draft model of the pair, chosen by --method draft and costed by auto like the same-vocabulary one; the
    engine's draft_kind says "cross-vocab"."""

    name = "draft"
    prior_alpha = 0.5
    kind = "cross-vocab"

    def __init__(self, model, target, p_min: float = 0.75, cost: float | None = None) -> None:
        self.model = model
        self.target = target
        self.p_min = p_min
        self._cost = cost
        self.dv = TextVocab(model)
        self.tv = TextVocab(target)
        self._t: list[int] = []  # target tokens whose text is in _text
        self._ends: list[int] = []  # _text's length after each of them
        self._text = bytearray()
        self._d: list[int] = []  # the draft's tokenization of _text
        self._dends: list[int] = []  # _text's length after each of them (while aligned)
        self._aligned = False  # the draft tokens' text is exactly _text: a tail can be tokenized again alone
        self._fresh = False  # _d is up to date with _text
        self.synced: list[int] = []  # the target context the draft model's cache last followed

    def cost(self) -> float | None:
        return self._cost

    def lag(self, context: Sequence[int]) -> int:
        """Target tokens whose text the draft model's cache lacks."""
        return len(context) - common_prefix(self.synced, context)

    # ------------------------------------------------------------ text
    def draft_context(self, context: Sequence[int]) -> list[int]:
        """The draft's tokens for the target's `context`: its tokenization of the context's text."""
        n = common_prefix(self._t, context)
        changed = n < len(self._t) or n < len(context)
        unchanged_bytes = self._ends[n - 1] if n else 0  # the text before this byte stays as it was
        if n < len(self._t):
            del self._t[n:], self._ends[n:]
            del self._text[self._ends[-1] if self._ends else 0:]
        tv = self.tv
        for i in range(n, len(context)):
            t = int(context[i])
            if not (i == 0 and t == tv.bos):  # the draft puts its own BOS in front
                self._text += tv.special_piece(t)
            self._t.append(t)
            self._ends.append(len(self._text))
        if changed or not self._fresh:
            self._retokenize(unchanged_bytes if self._fresh else 0)
            self._fresh = True
        return ([self.dv.bos] if self.dv.bos is not None else []) + self._d

    def _retokenize(self, unchanged: int) -> None:
        """Make _d the draft's tokenization of _text, whose first `unchanged` bytes are as when _d was made.

        A safe boundary: the draft tokens ending RETOKENIZE_MARGIN bytes or more before the change are kept, the
        text after the CHECK_TOKENS tokens before that boundary is tokenized again, and the result is taken only
        where it reproduces those tokens (no merge reaches across the boundary); the tokens after them replace the
        tail. Otherwise (a tokenizer that puts a space in front of every text, bytes it cannot render back) the whole
        text is tokenized again. Either way _d is the tokenization of the whole text, a step costs what the new text
        costs, and nothing drifts."""
        dv, text = self.dv, bytes(self._text)
        if self._aligned and self._d:
            j = bisect.bisect_right(self._dends, unchanged - RETOKENIZE_MARGIN)
            i = max(j - CHECK_TOKENS, 0)
            start = self._dends[i - 1] if i else 0
            redo = dv.tokenize(text[start:], parse_special=True)
            if redo[:j - i] == self._d[i:j]:
                tail = redo[j - i:]
                ends, pos = self._dends[:j], self._dends[j - 1] if j else 0
                for t in tail:
                    pos += len(dv.special_piece(t))
                    ends.append(pos)
                if pos == len(text):
                    self._d[j:] = tail
                    self._dends = ends
                    return
        self._d = dv.tokenize(text, parse_special=True)
        pos, self._dends = 0, []
        for t in self._d:
            pos += len(dv.special_piece(t))
            self._dends.append(pos)
        self._aligned = pos == len(text)

    def _anchor(self, context: Sequence[int]) -> bytes:
        """The text of the context's last few tokens, after its last control token."""
        out: list[bytes] = []
        for t in reversed(context[-ANCHOR_TOKENS:]):
            t = int(t)
            if self.tv.is_control(t) or t == self.tv.bos:
                break
            out.append(self.target.piece(t))
        return b"".join(reversed(out))

    def catch_up(self, context: Sequence[int]) -> None:
        """Decode the draft's tokens for `context` into its cache (a prefilled prompt)."""
        dctx = self.draft_context(context)
        if dctx and len(dctx) < self.model.n_ctx:
            self.model.sync(dctx)
            self.synced = list(context)

    # ------------------------------------------------------------ drafting
    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        if k <= 0 or not context:
            return Proposal()
        dctx = self.draft_context(context)
        steps = min(DRAFT_STEPS_PER_TOKEN * k + 2, self.model.n_ctx - len(dctx) - 1)
        if steps <= 0 or not dctx:
            return Proposal()
        t0 = time.perf_counter()
        row = self.model.sync(dctx, copy=False)  # read before the next decode
        catch_up = time.perf_counter() - t0 if len(dctx) - self.model.reused > 2 else 0.0
        self.synced = list(context)
        if steps > 1:
            mark = getattr(self.model, "save_checkpoint", None)  # a recurrent draft: see DraftModelDrafter
            if mark is not None:
                mark()
        anchor = self._anchor(context)
        new = bytearray()
        toks: list[int] = []
        done = False  # the draft wrote past the k-th target token: the first k are fixed
        for i in range(steps):
            if not confident(row, self.p_min):
                break
            t = int(np.argmax(row))
            if self.dv.is_control(t):
                break
            new += self.model.piece(t)
            mapped = to_target(self.tv, anchor, bytes(new))
            if mapped is None:
                break
            toks = mapped
            if len(toks) > k:
                done = True
                break
            if i < steps - 1:
                row = self.model.decode([t], "last", copy=False)[0]
        out = toks[:k] if done else toks[:-1]
        return Proposal(out, None, catch_up)

    def close(self) -> None:
        self.model.close()
