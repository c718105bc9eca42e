"""The model pair and what outlives a request on it: drafters, heads, the controller's memory, the exactness probe.
A request decodes through the scheduler's step (core/batch.py) as a batch of one over the target's own context.

Invariant between steps: the target's KV cache holds every context token but the last one (the
"pending" token the target chose and we already emitted). A step decodes [pending, d1..dk] in ONE
batch with logits at every row, verifies the drafts, and removes the rejected rows from the cache.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator, Sequence

from localspec.defaults import AUTO_MIN_BIT_K, EXACTNESS, MAX_K, METHODS  # noqa: F401 - part of the engine API
from localspec.core.config import GenConfig  # noqa: F401 - part of the engine API
from localspec.core.generation import Finished, Piece, speculates  # noqa: F401 - part of the engine API
from localspec.core.batch import BatchEngine
from localspec.core.drafting import drafters_for
from localspec.core.policy import Policy, build_policy, env_allows_inexact
from localspec.core.prompt_cache import shared_mark, usable
from localspec.core.response import Response
from localspec.core.stats import Stats
from localspec.core.text import TextAssembler  # noqa: F401 - part of the engine API
from localspec.drafters import DraftModelDrafter, Drafter, PromptLookupDrafter
from localspec.drafters.ngram_cache import NgramCacheDrafter
from localspec.errors import IncompatibleDraftError, SettingError, UsageError
from localspec.knobs import knobs
from localspec.models.pair import check_pair
from localspec.seq import common_prefix


class Engine:
    """target (and draft) models, their drafters and their exactness; generate() runs a request as a batch of one.

    chat_template: a Jinja chat template that replaces the target's own (None: the one in the GGUF).
    template_warning: set when the target has no chat template and none was given (prompts then use a plain
    "role: content" transcript); the front end shows it once.
    last_text: the answer text released so far by the current/last generate(), also after an interrupt.
    """

    def __init__(self, target, draft=None, *, chat_template: str | None = None) -> None:
        self.target = target
        self.draft = draft
        self._lookup: PromptLookupDrafter | None = None
        self._ngram: NgramCacheDrafter | None = None
        self._draft_drafter: Drafter | None = None
        self._suffix: Drafter | None = None
        # whose earlier text the suffix drafter may draft from: "" the user's own (run, chat, serve without a key);
        # a server with an API key sets its key's scope (store/suffixcache.scope_of)
        self.suffix_scope = ""
        self._hooked: list[Drafter] = []  # drafters whose after-decode hook runs (the current policy's)
        self.heads: dict[str, Drafter] = {}  # draft heads on the target's own context (eagle3, mtp), by method
        self.heads_unavailable: dict[str, str] = {}  # head kind -> why it could not be used with this target
        self.controller_state = None  # adaptive controller memory across generations
        self.dropped_draft: str | None = None
        self._probe: tuple[int, int] | None = None  # (upto, exact batch): one exactness probe per target
        self._costs: dict[int, float] = {}  # the verify-cost calibration, once read (not a file read per answer)
        self._cost_scale = 1.0  # ... and the scale its live judgements had put on it then (verify_cost.cost_scale)
        self.last_stats: Stats | None = None
        # prompt states kept across processes (core/prompt_cache.PromptCache; None: none), set by the front ends
        # that decode one request at a time (run, chat)
        self.prompt_cache = None
        self._assembler: TextAssembler | None = None
        self._template_source = chat_template
        self._template = None  # parsed on first use (--raw prompts never need it)
        self.template_warning: str | None = None
        if chat_template is None and target.chat_template() is None:
            self.template_warning = (f"{target.name} has no chat template; using a plain 'role: content' transcript "
                                     "(give one with --chat-template FILE)")
        # how the draft model drafts: "same-vocab" (its tokens are the target's), "cross-vocab" (through text), or
        # "head" (a draft head given with -d, set by load); None: no draft
        self.draft_kind: str | None = None
        if draft is not None:
            self.draft_kind = check_pair(target.vocab_info(), draft.vocab_info(), target.name, draft.name)
            if draft.n_ctx < target.n_ctx:
                raise UsageError(f"draft context ({draft.n_ctx}) is smaller than the target's ({target.n_ctx})")

    @classmethod
    def load(
        cls,
        target_path,
        draft_path=None,
        *,
        n_ctx: int = 4096,
        gpu_layers: int | None = None,
        draft_gpu_layers: int | None = None,
        threads: int | None = None,
        drop_incompatible_draft: bool = False,
        rpc: str | Sequence[str] | None = None,
        tensor_split: str | Sequence[float] | None = None,
        chat_template: str | None = None,
    ) -> "Engine":
        """Load target (and draft). gpu_layers None: all layers on the GPU when llama.cpp has a GPU device, else
        none. drop_incompatible_draft: keep going without a draft that fails the
        pair check (the reason is in .dropped_draft) instead of raising. rpc: llama.cpp RPC workers
        ("HOST:PORT[,...]") that take the target's layers, in tensor_split proportions; the draft stays local."""
        from localspec import rpcwire as rpc_mod
        from localspec.llama.model import Model
        from localspec.llama.sysinfo import resolve_gpu_layers
        from localspec.llama.threads import check_threads
        check_threads(threads)  # before loading anything

        workers = rpc_mod.parse_servers(rpc)  # Model checks each worker before llama.cpp connects
        split = rpc_mod.parse_tensor_split(tensor_split)
        from localspec.drafters.registry import HEADS
        from localspec.llama.heads import HEAD_ARCHS, file_arch, file_nextn

        want_mtp = file_nextn(target_path) > 0  # the target has MTP layers: load them for the mtp drafter
        target = Model(target_path, n_ctx=n_ctx, n_gpu_layers=resolve_gpu_layers(gpu_layers), n_threads=threads,
                       rpc_servers=workers or None, tensor_split=split, load_mtp=want_mtp)
        draft = None
        heads: dict[str, Drafter] = {}
        unavailable: dict[str, str] = {}
        try:
            if want_mtp:
                try:
                    heads["mtp"] = HEADS["mtp"].load(target)
                except IncompatibleDraftError as exc:
                    unavailable["mtp"] = str(exc)
            kind = HEAD_ARCHS.get(file_arch(draft_path) or "") if draft_path is not None else None
            dropped = None
            if kind in HEADS:  # a draft head (EAGLE-3, DFlash): it runs on the target's context, not as a model
                try:
                    heads[kind] = HEADS[kind].load(target, draft_path,
                                                   n_gpu_layers=resolve_gpu_layers(draft_gpu_layers))
                except IncompatibleDraftError as exc:
                    if not drop_incompatible_draft:
                        raise
                    dropped = unavailable[kind] = str(exc)
            elif kind is not None:  # a head arch localspec cannot drive
                raise IncompatibleDraftError(f"{Path(draft_path).name} is a {kind} draft head, which localspec "
                                             f"cannot use ({', '.join(HEADS)} heads are supported)")
            elif draft_path is not None:
                draft = Model(draft_path, n_ctx=target.n_ctx, n_gpu_layers=resolve_gpu_layers(draft_gpu_layers),
                              n_threads=threads)
            try:
                engine = cls(target, draft, chat_template=chat_template)
            except IncompatibleDraftError as exc:
                if not drop_incompatible_draft:
                    raise
                draft.close()
                draft = None
                engine = cls(target, None, chat_template=chat_template)
                dropped = str(exc)
            engine.dropped_draft = dropped
            if kind in HEADS and kind in heads:
                engine.draft_kind = "head"
            engine.heads.update(heads)
            engine.heads_unavailable.update(unavailable)
            return engine
        except BaseException:
            if draft is not None:
                draft.close()
            for h in heads.values():
                h.close()
            target.close()
            raise

    def close(self) -> None:
        for h in self.heads.values():
            h.close()
        self.heads.clear()
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    # --------------------------------------------------------------- prompts
    def chat_prompt(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Messages (and function `tools`) rendered with the chat template, ready for generate(). Text from the
        request is plain text: control tokens written in a message, a tool's definition, a tool call's arguments
        or a name ('<|im_end|>') are not parsed, only the template's own markup is."""
        from localspec.core.chat_template import plain_segments

        tmpl = self.chat_template()
        segments = (tmpl.segments(messages, tools=tools, plain=self.target.has_control_text) if tmpl is not None
                    else plain_segments(messages, tools=tools))
        return self.target.tokenize_segments([(s.text, s.content) for s in segments])

    def chat_template(self):
        """The parsed ChatTemplate (None: the target has none and none was given). Raises ChatTemplateError."""
        from localspec.core.chat_template import ChatTemplate

        if self._template is None:
            src = self._template_source
            origin = f"the chat template given for {self.target.name}"
            if src is None:
                src = self.target.chat_template()
                origin = f"the chat template of {self.target.name}"
            if src is None:
                return None
            self._template = ChatTemplate(src, origin=origin, bos_token=self.target.special_text("bos"),
                                          eos_token=self.target.special_text("eos"))
        return self._template

    def prefill(self, prompt_tokens: Sequence[int]) -> int:
        """Decode a prompt into the KV caches ahead of its turn (a reopened chat): the next generation whose prompt
        starts with it decodes only the rest. Returns the tokens decoded now."""
        prompt = [int(t) for t in prompt_tokens]
        if not prompt or len(prompt) >= self.target.n_ctx:
            return 0
        _, cached, _ = self.sync_prompt(prompt)
        decoded = len(prompt) - cached
        self.after_target_decode(*self.target.last_replay)
        self.after_target_decode(prompt[cached:], cached)
        if self.draft is not None and len(prompt) < self.draft.n_ctx:
            if self.draft_kind == "cross-vocab":  # its cache holds its own tokens for the prompt's text
                self.draft_drafter(GenConfig()).catch_up(prompt)
            else:
                self.restore_draft_state(prompt)
                self.save_draft_state(prompt, fill=True)
                self.draft.sync(prompt)
        return decoded

    def sync_prompt(self, prompt: Sequence[int], copy: bool = True, shared_upto: int = 0):
        """The prompt into the target's cache; (the last row's logits, the prompt tokens not decoded now, where they
        came from: "disk" for a prefix state restored from the prompt cache, "memory" for the cache this process
        held, "" for none). With a prompt cache (core/prompt_cache.py) the longest stored prefix state is restored
        first, and the prefill stops at the prompt's save point to keep that prefix's state. `shared_upto`: where the
        part of the prompt later prompts share ends (GenConfig.shared_upto): the prefill splits there, cache or not."""
        target, pc = self.target, self.prompt_cache
        mark = shared_mark(shared_upto, len(prompt)) if usable(target) else 0
        if pc is not None:
            pc.keep_leaving(target, prompt)
        restored = pc.restore(target, prompt, mark) if pc is not None else 0
        have = min(common_prefix(target.tokens, prompt), len(prompt) - 1)
        split = pc.save_prefix(target, prompt, mark) if pc is not None else 0
        if mark and not split and have < mark:
            target.fill(prompt[:mark])  # the split a cold prefill of this prompt makes, with or without a store
            split = mark
        logits = target.sync(prompt, copy=copy)
        cached = have if split else target.reused
        if restored and cached:  # from the disk, or from a server's store's memory (ServerStates.last_source)
            source = getattr(pc.store, "last_source", "") or "disk"
        else:
            source = "memory" if cached else ""
        return logits, cached, source

    def restore_draft_state(self, prompt: Sequence[int]) -> None:
        """A draft model of the target's vocabulary: its longest stored prefix state of the prompt, where its cache
        shares less with it (the prompt cache)."""
        if self.prompt_cache is not None and self.draft is not None and self.draft_kind == "same-vocab":
            self.prompt_cache.restore_draft(self.draft, prompt)

    def save_draft_state(self, prompt: Sequence[int], fill: bool = False, shared_upto: int = 0) -> None:
        """After a request: the draft model's state at the prompt's save point, where the store has none and the
        draft's cache has caught up with that prefix (its cache is cut back to it: a chat's next turn decodes the rest
        again, once per new prefix); `fill`: filled to there first (a reopened chat's prefill, PromptCache.save_draft)."""
        if self.prompt_cache is not None and self.draft is not None and self.draft_kind == "same-vocab":
            self.prompt_cache.save_draft(self.draft, prompt, fill=fill, mark=shared_mark(shared_upto, len(prompt)))

    def raw_prompt(self, text: str) -> list[int]:
        return self.target.tokenize(text, add_special=True, parse_special=False)

    # ------------------------------------------------------------- drafters
    def lookup_drafter(self, cfg: GenConfig) -> PromptLookupDrafter:
        d = self._lookup
        if d is None or (d.n_min, d.n_max) != (cfg.lookup_min, cfg.lookup_max):
            d = self._lookup = PromptLookupDrafter(cfg.lookup_min, cfg.lookup_max)
        return d

    def draft_drafter(self, cfg: GenConfig) -> Drafter | None:
        """The draft model's drafter: its tokens as the target's, or through text when its vocabulary differs."""
        if self.draft is None:
            return None
        if self._draft_drafter is None:
            cost = self.draft.size_bytes() / max(self.target.size_bytes(), 1)  # decoding is memory-bound
            if self.draft_kind == "cross-vocab":
                from localspec.drafters.cross_vocab import CrossVocabDrafter

                self._draft_drafter = CrossVocabDrafter(self.draft, self.target, cfg.p_min, cost=cost)
            else:
                self._draft_drafter = DraftModelDrafter(self.draft, self.target.n_vocab, cfg.p_min, cost=cost)
        self._draft_drafter.p_min = cfg.p_min
        return self._draft_drafter

    def suffix_drafter(self) -> Drafter:
        """The suffix drafter over this process's corpus of the engine's scope (drafters/suffix.py)."""
        from localspec.drafters.suffix_corpus import corpus_for
        from localspec.drafters.suffix import SuffixDrafter

        corpus = corpus_for(self.target, self.suffix_scope)
        if self._suffix is None or self._suffix.corpus is not corpus:
            if self._suffix is not None:  # another scope's: its last request joins its own corpus
                self._suffix.finish()
            self._suffix = SuffixDrafter(corpus)
        return self._suffix

    def ngram_drafter(self) -> Drafter:
        self._ngram = self._ngram or NgramCacheDrafter()
        return self._ngram

    def model_drafter(self, cfg: GenConfig) -> Drafter | None:
        """The draft model's drafter, where its state rolls back (drafting.DrafterPool)."""
        return self.draft_drafter(cfg) if self.draft is not None and can_roll_back(self.draft) else None

    def head_kinds(self) -> list[str]:
        return list(self.heads)

    def head_drafter(self, kind: str, cfg: GenConfig) -> Drafter:
        head = self.heads[kind]
        head.p_min = cfg.p_min
        return head

    def grammar_pays(self) -> bool:
        """Alone on the target's context, the tokens structured output forces are always drafted."""
        return True

    def drafters_for(self, cfg: GenConfig, method: str) -> dict[str, Drafter]:
        """The drafters `method` may use with what is loaded (auto: all of them)."""
        return drafters_for(cfg, method, self)

    def resolve_method(self, cfg: GenConfig) -> str:
        if cfg.method == "draft" and self.draft is None:
            raise SettingError("{method} draft needs a draft model ({draft})", ("method", "draft"))
        from localspec.drafters.registry import HEADS

        if cfg.method in HEADS and cfg.method not in self.heads:
            if cfg.method in self.heads_unavailable:
                raise IncompatibleDraftError(self.heads_unavailable[cfg.method])
            if cfg.method == "mtp":
                raise SettingError(f"{{method}} mtp needs a target with MTP layers; {self.target.name} has none",
                                   "method")
            from localspec.models.gguf_header import HEAD_NAMES

            # {draft} is worded by each front end ("-d PATH ..." on the command line, "none is loaded on this
            # server" by the API): it stands in parentheses, where an instruction and a statement both read
            raise SettingError(f"{{method}} {cfg.method} needs {HEAD_NAMES[cfg.method]} ({{draft}})",
                               ("method", "draft"))
        return cfg.method

    def attach(self, drafters, text: TextAssembler, stats: Stats) -> None:
        """A request starts on the target's own context: `drafters` (its policy's) see every target decode from now
        on (after_target_decode), and last_text, last_stats and respond() read its `text` and `stats`."""
        self._hooked = list(drafters)
        self._assembler = text
        self.last_stats = stats

    def after_target_decode(self, tokens: Sequence[int], start: int) -> None:
        """Every target decode ends here: each drafter in use sees what was decoded (draft heads read hidden
        states that live only until the next decode)."""
        if tokens:
            positions = range(start, start + len(tokens))
            for d in self._hooked:
                d.after_target_decode(tokens, positions)

    def verify_costs(self, upto: int) -> dict[int, float] | None:
        """T(b)/T(1) of the target on this machine (measured once, cached); None where it cannot be measured."""
        if knobs().no_cost_calibration:
            return None
        if len(self._costs) < upto:
            from localspec.core.verify_cost import cost_scale, verify_costs

            self._costs = verify_costs(self.target, upto)
            self._cost_scale = cost_scale(self.target)
        return self._costs

    def note_verify_steps(self, policy) -> None:
        """After a generation: its verify steps' judgements of the calibrated curve (pricing.VerifyCurve.live) are kept
        with the calibration, whose scale follows them (verify_cost.note_verify_steps); the curve, which a chat's
        next answer reuses, is priced by the calibration as now scaled."""
        curve = getattr(policy, "curve", None)
        if curve is None or not curve.live or not self._costs or knobs().no_cost_calibration:
            return
        from localspec.core.verify_cost import note_verify_steps, verify_costs

        scale = note_verify_steps(self.target, list(curve.live), self._cost_scale)
        curve.live.clear()
        curve.scale = 1.0
        if scale is not None:
            self._costs = verify_costs(self.target, len(self._costs))
            self._cost_scale = scale
        curve.prior = dict(self._costs)

    def exact_k(self, k: int, cancel: threading.Event | None = None) -> int:
        """The largest k <= requested whose verify batch (k + 1 rows) is bit-identical to one-token decoding.
        One probe per target (batches up to max(k + 1, PROBE_MIN_UPTO)); a smaller k is derived from it (batches
        1..B exact among those measured up to N: min(B, u) for any u <= N), a larger one re-probes. `cancel` stops
        a probe between decodes (exactness.ProbeCancelled; nothing is cached)."""
        if k <= 0:
            return 0
        if self._probe is None or k + 1 > self._probe[0]:
            from localspec.core import exactness as X

            upto = max(k + 1, X.PROBE_MIN_UPTO)
            kw = {"cancel": cancel} if cancel is not None else {}
            self._probe = (upto, int(X.max_exact_batch(self.target, upto, **kw)))
        return min(k, self._probe[1] - 1)

    def exactness_for(self, cfg: GenConfig, cancel: threading.Event | None = None,
                      rows: int | None = None) -> tuple[int, str, str]:
        """(k, level, reason): the k to speculate with under cfg.exactness, the level in use (bit | lossless)
        and why, in plain words. `rows`: the most verify rows per request that the probe of the context it decodes
        in checked (a batch's pass shapes: BatchEngine.bit_rows); None: the target's own probe, which checks k + 1."""
        k = cfg.k
        if not speculates(cfg, self.resolve_method(cfg)):
            return 0, "bit", "bit: plain decoding (no verify batches)"
        if self.rollback_notice(cfg):
            return 0, "bit", "bit: plain decoding (the model cannot roll back rejected tokens)"
        level = cfg.exactness
        if level == "auto" and env_allows_inexact():
            return k, "lossless", ("lossless: LOCALSPEC_ALLOW_INEXACT is set, so k is uncapped; "
                                   "only float reduction order differs from one-token decoding")
        if level == "lossless":
            return k, "lossless", ("lossless: chosen, so k is uncapped; every token is the target's choice in the "
                                   "pass that emitted it, only float reduction order differs from one-token decoding")
        cap = self.exact_k(k, cancel)
        # bit is claimed only for verify shapes a probe decoded: in a batch, passes of up to `rows` rows a request,
        # whatever the target alone would allow; the k in use (and reported) is that cap, for any method
        unprobed = rows is not None and cap > rows - 1
        if unprobed:
            cap = rows - 1
        if level == "auto" and cap < min(AUTO_MIN_BIT_K, k):
            return k, "lossless", (f"lossless: bit-exact verify needs k <= {cap} on this backend, so k is uncapped; "
                                   "only float reduction order differs")
        if cap == 0:
            return 0, "bit", ("bit: verify batches of 2 or more rows are not bit-identical to one-token decoding "
                              "here, so bit exactness means plain decoding")
        if unprobed:
            return cap, "bit", (f"bit: k capped at {cap}; in a batch, passes of up to {rows} rows a request were "
                                "found bit-identical to one-token decoding here, bigger ones were not checked")
        if cap < k:
            return cap, "bit", (f"bit: k capped at {cap}; verify batches up to {cap + 1} rows are bit-identical to "
                                "one-token decoding here, bigger ones are not")
        return cap, "bit", f"bit: verify batches up to {cap + 1} rows are bit-identical to one-token decoding here"

    def rollback_notice(self, cfg: GenConfig) -> str:
        """Why `cfg` decodes plainly although it asks to speculate ('' when it can): a recurrent/hybrid target (or
        a forced draft model) whose state can be neither rolled back nor restored from a checkpoint here."""
        method = cfg.method
        if not speculates(cfg, method):
            return ""
        if not can_roll_back(self.target):
            return (f"plain decoding: {self.target.name} keeps a recurrent state that cannot be rolled back here "
                    "(rollback: none)")
        if method == "draft" and self.draft is not None and not can_roll_back(self.draft):
            return (f"plain decoding: the draft model {self.draft.name} keeps a recurrent state that cannot be rolled "
                    "back here (rollback: none)")
        return ""

    def make_policy(self, cfg: GenConfig, exactness: tuple[int, str, str] | None = None) -> tuple[Policy, str, int]:
        """(policy, method, k): k is cfg.k, capped under bit exactness to what verifies bit-exactly (0 for plain
        decoding). `exactness`: exactness_for(cfg), when the caller has it already."""
        method = self.resolve_method(cfg)
        k = (exactness or self.exactness_for(cfg))[0]  # 0 where the request does not speculate
        if k == 0:
            policy, label = build_policy(cfg, "none", 0, {}, None)
            return policy, label, k
        adaptive = cfg.adaptive if cfg.adaptive is not None else method == "auto"
        if adaptive and self.controller_state is None:
            self.controller_state = {}
        policy, label = build_policy(cfg, method, k, self.drafters_for(cfg, method), self.controller_state,
                                     self.verify_costs)
        return policy, label, k

    # ------------------------------------------------------------- decoding
    def generate(
        self,
        prompt_tokens: Sequence[int],
        cfg: GenConfig | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[Piece | Finished]:
        """Stream Pieces, then one Finished. Output equals plain decoding of the target (token for token
        at temperature 0; in distribution above 0). The request alone on the target's own context, stepped by the
        scheduler as a batch of one (core/batch.py, core/backend.OwnContext): each step decodes its pending token and drafts in one
        batch (core/generation.py does the rest)."""
        return BatchEngine(self, 1, own_context=True).events(prompt_tokens, cfg, cancel)

    @property
    def last_text(self) -> str:
        """The text the current (or last) generate() has released so far: on Ctrl-C or a cancel, the partial
        answer, exactly what was streamed (text held back as a possible stop string start is not included)."""
        return self._assembler.text if self._assembler is not None else ""

    def respond(self, prompt_tokens: Sequence[int], cfg: GenConfig | None = None,
                cancel: threading.Event | None = None) -> Response:
        """The generation as a Response handle: iterate it for the Pieces (that runs the decode), then .finished."""
        return Response(self.generate(prompt_tokens, cfg, cancel), stats=lambda: self.last_stats,
                        held=lambda: self._assembler.held() if self._assembler is not None else "")

    def complete(self, prompt_tokens: Sequence[int], cfg: GenConfig | None = None) -> Finished:
        return self.respond(prompt_tokens, cfg).result()


def can_roll_back(model) -> bool:
    """Whether `model`'s state can be cut back after rejected drafts (a KV cache, a plane or a checkpoint)."""
    return model.rollback_kind != "none"
