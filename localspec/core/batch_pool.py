"""A batch slot's drafters (core/batch.py): what core/drafting.py assembles a slot's request from. A slot keeps its
prompt lookup, n-gram cache and suffix drafter from request to request; its draft model and draft heads are the
batch's (core/batch_draft.py, core/batch_xvocab.py, core/batch_heads.py), each with the slot's own sequence."""

from __future__ import annotations

from localspec.core.config import GenConfig
from localspec.drafters import PromptLookupDrafter
from localspec.drafters.ngram_cache import NgramCacheDrafter
class SlotPool:
    """Slot `seq`'s drafters (drafting.DrafterPool), kept in the slot from request to request, for a request whose
    prompt the slot's cache holds the first `common` tokens of."""

    def __init__(self, batch, seq: int, prompt: list[int], common: int) -> None:
        self.batch, self.seq, self.prompt, self.common = batch, seq, prompt, common

    def lookup_drafter(self, cfg: GenConfig) -> PromptLookupDrafter:
        b, seq = self.batch, self.seq
        d = b.lookups[seq]
        if d is None or (d.n_min, d.n_max) != (cfg.lookup_min, cfg.lookup_max):
            d = b.lookups[seq] = PromptLookupDrafter(cfg.lookup_min, cfg.lookup_max)
        return d

    def ngram_drafter(self) -> NgramCacheDrafter:
        b, seq = self.batch, self.seq
        b.ngrams[seq] = b.ngrams[seq] or NgramCacheDrafter()
        return b.ngrams[seq]

    def suffix_drafter(self):
        """The slot's suffix drafter. The requests finished in the other free slots join the shared corpus first, so
        this one drafts from them."""
        from localspec.drafters.suffix_corpus import corpus_for
        from localspec.drafters.suffix import SuffixDrafter

        b, seq = self.batch, self.seq
        corpus = corpus_for(b.target, b.engine.suffix_scope)
        for s, d in enumerate(b.suffixes):
            if s != seq and d is not None and b.runs[s] is None:
                d.finish()
        d = b.suffixes[seq]
        if d is None or d.corpus is not corpus:
            d = b.suffixes[seq] = SuffixDrafter(corpus)
        return d

    def model_drafter(self, cfg: GenConfig):
        seqs = self.batch.draft_seqs
        return seqs.drafter(self.seq, cfg.p_min) if seqs is not None else None

    def head_kinds(self) -> list[str]:
        return list(self.batch.engine.heads)

    def head_drafter(self, kind: str, cfg: GenConfig):
        return self.batch.heads.drafter(self.seq, kind, cfg.p_min, self.prompt, self.common)

    def grammar_pays(self) -> bool:
        """Only where a verify row costs next to nothing (BatchEngine.rows_cheap)."""
        return self.batch.rows_cheap()
