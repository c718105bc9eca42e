"""The decoder: plain, draft-model and prompt-lookup speculative decoding over one target model.

Invariant between steps: the target's KV cache holds every context token but the last one (the
"pending" token the target chose and we already emitted). A step decodes [pending, d1..dk] in ONE
batch with logits at every row, verifies the drafts, and removes the rejected rows from the cache.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from localspec import defaults as D
from localspec.defaults import AUTO_MIN_BIT_K, EXACTNESS, MAX_K, METHODS  # noqa: F401 - part of the engine API
from localspec.core.policy import AdaptivePolicy, FixedPolicy, Policy
from localspec.core.sampling import Draws, SamplingParams, bias_vector, probs, sample, token_logprobs
from localspec.core.stats import Stats
from localspec.core.text import TextAssembler  # noqa: F401 - part of the engine API
from localspec.core.verify import NO_TOKEN, greedy_verify, keyed_verify, one_hot, speculative_sampling
from localspec.drafters import DraftModelDrafter, Drafter, PromptLookupDrafter, Proposal
from localspec.errors import ContextOverflowError, IncompatibleDraftError, SettingError, UsageError
from localspec.models.pair import check_pair


@dataclass
class GenConfig:
    """One generation's settings, as values (the front ends resolve flags, files and requests into these)."""

    method: str = D.METHOD
    k: int = D.DRAFT_TOKENS  # draft tokens per step (the most the controller may use in auto)
    max_tokens: int = D.MAX_TOKENS
    stop: Sequence[str] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    p_min: float = D.P_MIN
    lookup_min: int = D.LOOKUP_MIN
    lookup_max: int = D.LOOKUP_MAX
    adaptive: bool | None = None  # None: adaptive in auto, fixed k otherwise
    # bit: k capped so verify batches are bit-identical to one-token decoding (output == plain decoding);
    # lossless: no cap, every token is the target's choice in the pass that emitted it (float order may flip
    # near-ties); auto: bit when the cap leaves >= 2 draft tokens, else lossless
    exactness: str = D.EXACTNESS_LEVEL
    # a grammar the output must follow (structured output): an object with allowed() -> bool array over the
    # vocabulary at its current state, consume(tokens) -> bool and rollback(n); None: free text
    constraint: Any = None
    # logprobs: None computes none (no cost); n: each Piece carries its token's logprob and the n likeliest
    # alternatives, from the target row that emitted it (log-softmax of the raw row after bias and grammar)
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token -> added to the target's logits in every row; <= -100 bans

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SettingError(f"logprobs must be between 0 and 20, got {self.logprobs}", "logprobs")
        if self.method not in METHODS:
            raise SettingError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}", "method")
        if self.exactness not in EXACTNESS:
            raise SettingError(f"unknown exactness {self.exactness!r}; choose one of {', '.join(EXACTNESS)}",
                               "exactness")
        if not isinstance(self.k, int) or self.k < 0 or self.k > MAX_K:
            raise SettingError(f"draft tokens ({{draft_tokens}}) must be between 0 and {MAX_K}, got {self.k}",
                               "draft_tokens")
        if self.max_tokens is None or self.max_tokens < 1:
            raise SettingError(f"max tokens ({{max_tokens}}) must be >= 1, got {self.max_tokens}", "max_tokens")
        if not (0.0 <= self.p_min <= 1.0):
            raise SettingError(f"{{p_min}} must be in [0, 1], got {self.p_min}", "p_min")
        if self.lookup_min < 1 or self.lookup_max < self.lookup_min:
            raise SettingError(f"need 1 <= {{lookup_min}} <= {{lookup_max}}, got {self.lookup_min} and "
                               f"{self.lookup_max}", ("lookup_min", "lookup_max"))


@dataclass
class Piece:
    """Streamed text for one emitted token. `text` may be '' while a UTF-8 character is incomplete."""

    text: str
    token: int
    drafted: bool  # True: an accepted draft token; False: the target's own choice
    logprob: float | None = None  # with GenConfig.logprobs: the token's logprob in the row that emitted it
    top: list[tuple[int, float]] | None = None  # ... and the likeliest (token, logprob) there, best first


@dataclass
class Finished:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: Stats


class Engine:
    """target (and draft) models plus the decoding loop.

    chat_template: a Jinja chat template that replaces the target's own (None: the one in the GGUF).
    template_warning: set when the target has no chat template and none was given (prompts then use a plain
    "role: content" transcript); the front end shows it once.
    last_text: the answer text released so far by the current/last generate(), also after an interrupt.
    """

    def __init__(self, target, draft=None, *, chat_template: str | None = None) -> None:
        self.target = target
        self.draft = draft
        self._lookup: PromptLookupDrafter | None = None
        self._draft_drafter: DraftModelDrafter | None = None
        self._hooked: list[Drafter] = []  # drafters whose after-decode hook runs (the current policy's)
        self.heads: dict[str, Drafter] = {}  # draft heads on the target's own context (eagle3, mtp), by method
        self.heads_unavailable: dict[str, str] = {}  # head kind -> why it could not be used with this target
        self.controller_state = None  # adaptive controller memory across generations
        self.dropped_draft: str | None = None
        self._probe: tuple[int, int] | None = None  # (upto, exact batch): one exactness probe per target
        self._costs: dict[int, float] = {}  # the verify-cost calibration, once read (not a file read per answer)
        self.last_stats: Stats | None = None
        self._assembler: TextAssembler | None = None
        self._template_source = chat_template
        self._template = None  # parsed on first use (--raw prompts never need it)
        self.template_warning: str | None = None
        if chat_template is None and target.chat_template() is None:
            self.template_warning = (f"{target.name} has no chat template; using a plain 'role: content' transcript "
                                     "(give one with --chat-template FILE)")
        if draft is not None:
            check_pair(target.vocab_info(), draft.vocab_info(), target.name, draft.name)
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
        self.target.sync(prompt)
        decoded = len(prompt) - self.target.reused
        self._after_decode(*getattr(self.target, "last_replay", ((), 0)))
        self._after_decode(prompt[self.target.reused:], self.target.reused)
        if self.draft is not None and len(prompt) < self.draft.n_ctx:
            self.draft.sync(prompt)
        return decoded

    def raw_prompt(self, text: str) -> list[int]:
        return self.target.tokenize(text, add_special=True, parse_special=False)

    # ------------------------------------------------------------- drafters
    def lookup_drafter(self, cfg: GenConfig) -> PromptLookupDrafter:
        d = self._lookup
        if d is None or (d.n_min, d.n_max) != (cfg.lookup_min, cfg.lookup_max):
            d = self._lookup = PromptLookupDrafter(cfg.lookup_min, cfg.lookup_max)
        return d

    def draft_drafter(self, cfg: GenConfig) -> DraftModelDrafter | None:
        if self.draft is None:
            return None
        if self._draft_drafter is None:
            cost = self.draft.size_bytes() / max(self.target.size_bytes(), 1)  # decoding is memory-bound
            self._draft_drafter = DraftModelDrafter(self.draft, self.target.n_vocab, cfg.p_min, cost=cost)
        self._draft_drafter.p_min = cfg.p_min
        return self._draft_drafter

    def drafters_for(self, cfg: GenConfig, method: str) -> dict[str, Drafter]:
        """The drafters `method` may use with what is loaded (auto: all of them)."""
        out: dict[str, Drafter] = {}
        if method in ("auto", "lookup"):
            out["lookup"] = self.lookup_drafter(cfg)
        if method in ("auto", "draft") and self.draft is not None and _can_rollback(self.draft):
            out["draft"] = self.draft_drafter(cfg)
        for kind, head in self.heads.items():
            if method in ("auto", kind):
                head.p_min = cfg.p_min
                out[kind] = head
        return out

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

            raise SettingError(f"{{method}} {cfg.method} needs {HEAD_NAMES[cfg.method]}: give one with {{draft}}",
                               ("method", "draft"))
        return cfg.method

    def _after_decode(self, tokens: Sequence[int], start: int) -> None:
        """Every target decode ends here: each drafter in use sees what was decoded (draft heads read hidden
        states that live only until the next decode)."""
        if tokens:
            positions = range(start, start + len(tokens))
            for d in self._hooked:
                d.after_target_decode(tokens, positions)

    def verify_costs(self, upto: int) -> dict[int, float] | None:
        """T(b)/T(1) of the target on this machine (measured once, cached); None where it cannot be measured."""
        if os.environ.get("LOCALSPEC_NO_COST_CALIBRATION"):
            return None
        if len(self._costs) < upto:
            from localspec.core.exactness import verify_costs

            self._costs = verify_costs(self.target, upto)
        return self._costs

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

    def exactness_for(self, cfg: GenConfig, cancel: threading.Event | None = None) -> tuple[int, str, str]:
        """(k, level, reason): the k to speculate with under cfg.exactness, the level in use (bit | lossless)
        and why, in plain words."""
        k = cfg.k
        if self.resolve_method(cfg) == "none" or k <= 0:
            return 0, "bit", "bit: plain decoding (no verify batches)"
        if self.rollback_notice(cfg):
            return 0, "bit", "bit: plain decoding (the model cannot roll back rejected tokens)"
        level = cfg.exactness
        if level == "auto" and _env_allows_inexact():
            return k, "lossless", ("lossless: LOCALSPEC_ALLOW_INEXACT is set, so k is uncapped; "
                                   "only float reduction order differs from one-token decoding")
        if level == "lossless":
            return k, "lossless", ("lossless: chosen, so k is uncapped; every token is the target's choice in the "
                                   "pass that emitted it, only float reduction order differs from one-token decoding")
        cap = self.exact_k(k, cancel)
        if level == "auto" and cap < min(AUTO_MIN_BIT_K, k):
            return k, "lossless", (f"lossless: bit-exact verify needs k <= {cap} on this backend, so k is uncapped; "
                                   "only float reduction order differs")
        if cap == 0:
            return 0, "bit", ("bit: verify batches of 2 or more rows are not bit-identical to one-token decoding "
                              "here, so bit exactness means plain decoding")
        if cap < k:
            return cap, "bit", (f"bit: k capped at {cap}; verify batches up to {cap + 1} rows are bit-identical to "
                                "one-token decoding here, bigger ones are not")
        return cap, "bit", f"bit: verify batches up to {cap + 1} rows are bit-identical to one-token decoding here"

    def rollback_notice(self, cfg: GenConfig) -> str:
        """Why `cfg` decodes plainly although it asks to speculate ('' when it can): a recurrent/hybrid target (or
        a forced draft model) whose state can be neither rolled back nor restored from a checkpoint here."""
        method = cfg.method
        if method == "none" or cfg.k <= 0:
            return ""
        if not _can_rollback(self.target):
            return (f"plain decoding: {self.target.name} keeps a recurrent state that cannot be rolled back here "
                    "(rollback: none)")
        if method == "draft" and self.draft is not None and not _can_rollback(self.draft):
            return (f"plain decoding: the draft model {self.draft.name} keeps a recurrent state that cannot be rolled "
                    "back here (rollback: none)")
        return ""

    def make_policy(self, cfg: GenConfig, exactness: tuple[int, str, str] | None = None) -> tuple[Policy, str, int]:
        """(policy, method, k): k is cfg.k, capped under bit exactness to what verifies bit-exactly (0 for plain
        decoding). `exactness`: exactness_for(cfg), when the caller has it already."""
        method = self.resolve_method(cfg)
        adaptive = cfg.adaptive if cfg.adaptive is not None else method == "auto"
        k = (exactness or self.exactness_for(cfg))[0] if method != "none" else 0
        if method == "none" or k == 0:
            return FixedPolicy(None, 0), "none", k
        drafters = self.drafters_for(cfg, method)
        if adaptive:
            if self.controller_state is None:
                self.controller_state = {}
            # exactness auto: bit-exact within the cap, until the controller measures that a bigger k pays
            bit_cap = k if (cfg.exactness == "auto" and k < cfg.k and not _env_allows_inexact()) else None
            k_max = cfg.k if bit_cap is not None else k
            policy = AdaptivePolicy(drafters, k_max, self.controller_state, None, self.verify_costs(k_max + 1),
                                    bit_cap=bit_cap)
            return policy, method, k
        if method == "auto":
            method = next(iter(self.heads), None) or ("draft" if "draft" in drafters else "lookup")
        return FixedPolicy(drafters[method], k), method, k

    # ------------------------------------------------------------- decoding
    def generate(
        self,
        prompt_tokens: Sequence[int],
        cfg: GenConfig | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[Piece | Finished]:
        """Stream Pieces, then one Finished. Output equals plain decoding of the target (token for token
        at temperature 0; in distribution above 0)."""
        cfg = cfg or GenConfig()
        target = self.target
        sp = cfg.sampling
        bias = bias_vector(cfg.logit_bias, target.n_vocab)
        if bias is not None and np.isneginf(bias).all():  # nothing left to say: the request's error, before any work
            raise SettingError("{logit_bias} bans every token of the model's vocabulary", "logit_bias")
        rng = np.random.default_rng(sp.seed)
        # a seed: the token at each position is the keyed draw there, whatever drafter and k the policy picks, so the
        # answer is plain decoding's with that seed (sampling.Draws, verify.keyed_verify)
        draws = Draws(sp.seed) if sp.seed is not None and not sp.greedy else None

        def source():  # what the next token (and the drafts after it) are drawn with
            return draws.at(len(context)) if draws is not None else rng

        text = self._assembler = TextAssembler(cfg.stop)
        from localspec.core.exactness import ProbeCancelled

        try:
            exact = self.exactness_for(cfg, cancel)
        except ProbeCancelled:  # the caller gave up while the exactness probe ran: plain, then "cancelled"
            exact = (0, "bit", "bit: the exactness probe was cancelled")
        _, level, why = exact
        policy, method, k_cap = self.make_policy(cfg, exact)
        self._hooked = list(policy.drafters.values())
        stats = self.last_stats = Stats(method=method, k_cap=k_cap, exactness=level, exactness_reason=why)
        stats.rpc_workers = list(getattr(target, "rpc_servers", None) or [])
        if method != "none" and stats.k_cap < cfg.k:
            stats.reason = f"k capped at {stats.k_cap}: bigger verify batches are not bit-exact with this model/build"
        stats.reason = stats.reason or self.rollback_notice(cfg)
        stats.rollback = getattr(target, "rollback_kind", "kv")
        roll0 = _rollback_counters(target)
        draft0 = _rollback_counters(self.draft)
        if self.draft is not None and "draft" in policy.drafters:
            stats.draft_rollback = getattr(self.draft, "rollback_kind", "kv")
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise UsageError("empty prompt")
        stats.prompt_tokens = len(prompt)
        if len(prompt) >= target.n_ctx:
            raise ContextOverflowError(
                f"prompt is {len(prompt)} tokens but the context holds {target.n_ctx}; "
                f"use {{ctx_size}} {_fit_ctx(len(prompt) + cfg.max_tokens)} or a shorter prompt", "ctx_size"
            )
        t0 = stats.started = time.perf_counter()
        stats.running = True
        logits = target.sync(prompt)
        stats.cached_prompt_tokens = target.reused
        for d in self._hooked:
            d.begin(prompt)
        self._after_decode(*getattr(target, "last_replay", ((), 0)))
        self._after_decode(prompt[target.reused:], target.reused)
        stats.prompt_s = time.perf_counter() - t0

        out_tokens: list[int] = []
        context = prompt  # grows; the drafters see it, the last element is pending
        finish = None

        def emit(token: int, drafted: bool, row):
            piece, stopped = text.push(target.piece(token))
            out_tokens.append(token)
            stats.token_emitted()
            ev = Piece(piece, token, drafted)
            if cfg.logprobs is not None:
                ev.logprob, ev.top = token_logprobs(row, token, cfg.logprobs)
            return ev, stopped

        con = cfg.constraint
        banned = {int(t) for t, b in (cfg.logit_bias or {}).items() if b <= -100}
        sp_draft = sp if bias is None else dataclasses.replace(sp, bias=bias)  # the drafters' rows get the bias too

        def constrain(row, allowed):
            return np.where(allowed[:len(row)], row, -np.inf)

        if bias is not None:
            logits = logits + bias[:len(logits)]
        if con is not None:
            logits = constrain(logits, con.allowed())
        # first token from the prompt's last row
        if (bias is not None or con is not None) and np.max(logits) == -np.inf:
            first = NO_TOKEN
        else:
            first = int(np.argmax(logits)) if sp.greedy else sample(probs(logits, sp), source())
        stats.ttft_s = time.perf_counter() - t0
        if first == NO_TOKEN:
            finish = _no_token_left(cfg, 0)
        elif target.is_eog(first):
            finish = "stop"
        else:
            if con is not None:
                con.consume([first])
            ev, stopped = emit(first, False, logits)
            context.append(first)
            yield ev
            if stopped:
                finish = "stop"
        try:
            while finish is None:
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
                remaining = cfg.max_tokens - stats.completion_tokens
                room = target.n_ctx - len(target.tokens) - 1  # tokens the cache can still take after pending
                if remaining <= 0 or room < 0:
                    finish = "length"
                    break
                drafter, k = policy.choose(context)
                k = max(0, min(k, remaining - 1, room))
                td = time.perf_counter()
                proposal = drafter.propose(context, k, sp_draft, source()) if (drafter is not None and k > 0) \
                    else Proposal()
                masks = None
                if banned and any(t in banned for t in proposal.tokens):  # the biased rows would reject them
                    cut = next(i for i, t in enumerate(proposal.tokens) if t in banned)
                    proposal = Proposal(proposal.tokens[:cut], None if proposal.q is None else proposal.q[:cut],
                                        proposal.catch_up_s)
                if con is not None:  # each verify row masked by the grammar state after the drafts before it
                    proposal, masks = _grammar_masks(con, proposal)
                tv = time.perf_counter()
                gamma = len(proposal.tokens)
                base = len(target.tokens)
                batch = [context[-1], *proposal.tokens]
                rows = target.decode(batch, "all", copy=False)  # used before the next decode
                self._after_decode(batch, base)
                if bias is not None:
                    rows = rows + bias[:rows.shape[1]]
                if masks is not None:
                    rows = np.stack([constrain(r, m) for r, m in zip(rows, masks)])
                if sp.greedy:
                    top = rows.argmax(axis=1)
                    if bias is not None or con is not None:  # rows that leave no token
                        top[rows.max(axis=1) == -np.inf] = NO_TOKEN
                    n_acc, nxt = greedy_verify(proposal.tokens, top)
                elif draws is not None:
                    n_acc, nxt = keyed_verify(proposal.tokens, lambda i: probs(rows[i], sp), draws, len(context))
                else:
                    p = np.stack([probs(r, sp) for r in rows])
                    q = proposal.q if proposal.q is not None else one_hot(proposal.tokens, target.n_vocab)
                    n_acc, nxt = speculative_sampling(proposal.tokens, q, p, rng)
                replay = target.truncate(base + 1 + n_acc)  # recurrent/hybrid: may decode accepted tokens again
                if replay:
                    self._after_decode(replay, target.last_replay[1])
                if drafter is not None and gamma:
                    drafter.accept(gamma, n_acc)
                te = time.perf_counter()
                stats.draft_s += tv - td
                stats.verify_s += te - tv
                if not gamma:
                    stats.plain_s += te - tv
                stats.record_step(gamma, n_acc)
                if drafter is not None and gamma:
                    stats.method_used[drafter.name] += 1
                else:
                    stats.method_used["none"] += 1
                stats.k_used[k if drafter is not None else 0] += 1
                policy.observe(drafter, k, gamma, n_acc, None if proposal.catch_up_s > 0.0 else tv - td, te - tv)
                switched = policy.switched
                if switched and stats.exactness == "bit":  # exactness auto left the bit cap: say so, and from where
                    stats.exactness, stats.k_cap = "lossless", cfg.k
                    stats.exactness_reason = f"{switched} (from token {stats.completion_tokens + 1})"
                new = [(t, True) for t in proposal.tokens[:n_acc]] + [(nxt, False)]
                for i, (tok, drafted) in enumerate(new):
                    if tok != NO_TOKEN and target.is_eog(tok):
                        finish = "stop"
                        break
                    if stats.completion_tokens >= cfg.max_tokens:
                        finish = "length"
                        break
                    if tok == NO_TOKEN:
                        finish = _no_token_left(cfg, stats.completion_tokens)
                        break
                    if con is not None:
                        con.consume([tok])
                    ev, stopped = emit(tok, drafted, rows[i])
                    context.append(tok)
                    yield ev
                    if stopped:
                        finish = "stop"
                        break
        finally:
            stats.elapsed_s = time.perf_counter() - t0
            stats.running = False
            stats.add_rollback(roll0, _rollback_counters(target), draft0, _rollback_counters(self.draft))
            stats.reason = "; ".join(x for x in (stats.reason, policy.reason()) if x)
        tail = text.flush()
        if tail:
            yield Piece(tail, -1, False)
        yield Finished(text.text, out_tokens, finish, stats)

    @property
    def last_text(self) -> str:
        """The text the current (or last) generate() has released so far: on Ctrl-C or a cancel, the partial
        answer, exactly what was streamed (text held back as a possible stop string start is not included)."""
        return self._assembler.text if self._assembler is not None else ""

    def complete(self, prompt_tokens: Sequence[int], cfg: GenConfig | None = None) -> Finished:
        result = None
        for ev in self.generate(prompt_tokens, cfg):
            if isinstance(ev, Finished):
                result = ev
        return result


def _grammar_masks(con, proposal: Proposal) -> tuple[Proposal, list]:
    """The grammar's allowed tokens for each verify row: row i after the first i drafts. Drafts after the first
    one the grammar refuses are dropped (that one stays: its masked row rejects it, as speculative sampling
    would); the matcher is rolled back to where it was."""
    masks, n = [], 0
    for t in proposal.tokens:
        m = con.allowed()
        masks.append(m)
        if not m[t] or not con.consume([t]):
            break
        n += 1
    if n == len(proposal.tokens):
        masks.append(con.allowed())
    else:
        keep = n + 1
        proposal = Proposal(proposal.tokens[:keep], None if proposal.q is None else proposal.q[:keep],
                            proposal.catch_up_s)
        masks.append(masks[-1])  # the row after a refused draft is never used
    if n:
        con.rollback(n)
    return proposal, masks


def _no_token_left(cfg: GenConfig, emitted: int) -> str:
    """How an answer ends where logit_bias and the grammar leave no token to emit: the request's error when its bias
    banned what the grammar allows (a banned token is never emitted); "stop" where the grammar alone allows none."""
    if cfg.logit_bias:
        raise SettingError(f"{{logit_bias}} bans every token the structured output allows at token {emitted + 1} of "
                           "the answer", "logit_bias")
    return "stop"


def _can_rollback(model) -> bool:
    return getattr(model, "rollback_kind", "kv") != "none"


def _rollback_counters(model) -> dict | None:
    counters = getattr(model, "rollback_counters", None)
    return counters() if counters is not None else None


def _env_allows_inexact() -> bool:
    """LOCALSPEC_ALLOW_INEXACT=1 (the older switch): `auto` exactness means lossless."""
    return os.environ.get("LOCALSPEC_ALLOW_INEXACT", "") not in ("", "0")


def _fit_ctx(n: int) -> int:
    c = 512
    while c < n:
        c *= 2
    return c
