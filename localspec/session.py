"""The session layer that `run`, `chat`, `bench`, `tune` (and the server) share: it resolves settings with the
source of each value, resolves and fetches the models, builds the `GenConfig`, loads the engine and takes a
machine-wide generation slot. It sits on the engine and never imports the CLI or the TUI.

Precedence, highest first: a flag (or a change made in chat with /method, /k ...) > LOCALSPEC_* environment >
config file > the stored `localspec tune` result for the pair > the pair's defaults > built-in defaults.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from filelock import FileLock, Timeout

from localspec import settings as config
from localspec import defaults as D
from localspec.errors import SettingError, UsageError
from localspec.llama import aborts  # hooks only: no llama_cpp import
from localspec.llama.threads import check_threads
from localspec.models import download, registry, remote
from localspec.models import hubname as hfname
from localspec.models.spec import FileSpec, is_file, user_path
from localspec.printable import printable
from localspec import rpcwire as rpc
from localspec.settings import Setting
from localspec.store import history
from localspec.store.cachefile import cache_dir

# function-level imports below load the engine (numpy, and llama.cpp through llama.model) only when a generation
# needs it: `localspec config`, `models` and `history` never pay for them

# keys `localspec tune` stores -> setting names
TUNED_KEYS = {"method": "method", "k": "draft_tokens", "p_min": "p_min"}


def tuned_results() -> dict:
    return config.tuned_results()  # a broken [tuned] table or entry is ignored (settings.py)


def pair_for(model: str | None):
    """The registry pair a model setting names, or None for a path or a hub name."""
    if not model:
        return None
    kind, obj = registry.resolve_name(model)
    return obj if kind == "pair" else None


# methods that use a draft the user named (-d); a stored tune result choosing another never applies beside one
DRAFT_METHODS = frozenset({"auto", "draft", "eagle3", "dflash"})


def tuned_key(model: str, pair) -> str | None:
    """What stored tune results are keyed by: a pair by its name, a hub model by its canonical name, a local file
    by its resolved path, size and modification time (as the exactness probes key a file), so another model of the
    same file name, or this file rewritten, never picks up its result. None: a file that is not there."""
    if pair is not None:
        return pair.name
    try:
        p = user_path(model)
        hub = hfname.is_hub_name(model) and not is_file(p, model)
    except UsageError:  # a `~USER` that names no user, a name too long to look up: no file, no stored result
        return None
    if hub:
        return str(hfname.parse(model))
    try:
        st = p.stat()
        return f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        return None


def tuned_draft(draft: str | None) -> str | None:
    """The draft a tune result was measured with, as stored beside it (None: no draft named; the pair's own)."""
    if not draft:
        return None
    try:
        key = tuned_key(draft, pair_for(draft))
    except UsageError:
        key = None
    return key or f"unresolved {draft}"  # a draft that cannot be identified matches no stored result


def resolve_settings(flags: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                     *, strict: bool = True) -> dict[str, Setting]:
    """Every setting with its value and where it came from. `overrides` are changes made during a session
    (chat's slash commands); they rank with flags. strict=False tolerates an unknown pair name (for display)."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    merged = {**flags, **{k: v for k, v in (overrides or {}).items()}}
    out = config.resolve(merged)
    for k in overrides or {}:
        if k in out:
            out[k] = Setting(overrides[k], "chat")
    model = out["model"].value
    try:
        pair = pair_for(model)
    except UsageError:
        if strict:
            raise
        pair = None
    if pair is not None:
        for key, value in (("draft_tokens", pair.k), ("ctx_size", pair.ctx)):
            if out[key].source == "default":
                out[key] = Setting(value, f"pair {pair.name}")
    tuned = tuned_results().get(tuned_key(model, pair)) or {}
    draft = out["draft"].value
    if tuned.get("draft") != tuned_draft(draft):
        tuned = {}  # measured with another draft, or none: it says nothing about this one
    elif draft and tuned.get("method", "auto") not in DRAFT_METHODS:
        tuned = {}  # a draft the user named is never dropped for a stored prompt lookup or plain decoding
    for tkey, key in TUNED_KEYS.items():
        if tkey in tuned and (out[key].source == "default" or out[key].source.startswith("pair ")):
            try:
                value = config.coerce(key, tuned[tkey], "stored tune result")
            except UsageError:
                continue  # a hand-edited, broken tune entry is ignored rather than fatal
            out[key] = Setting(value, f"tune ({tuned.get('tuned_at', 'stored')})")
    return out


def check_target(path: Path) -> None:
    """A draft head (EAGLE-3, DFlash) or an MTP-only file given as the target (-m) is refused before anything
    loads: llama.cpp would load some of them and generate garbage. A header that cannot be read is left to the
    load, which says why."""
    from localspec.errors import ModelLoadError
    from localspec.models.gguf_header import HEAD_NAMES, not_a_target, read_file_metadata

    try:
        what = not_a_target(read_file_metadata(path, tokens=False))
    except ModelLoadError:
        return
    if what is not None:
        hint = (f": give it with -d beside the model it drafts for (-m MODEL.gguf -d {path.name})"
                if what in HEAD_NAMES.values() else ": it cannot be the target (-m)")
        raise UsageError(f"{path.name} is {what}{hint}")


def validate(v: dict[str, Any]) -> None:
    """The checks every front end applies before anything is loaded (run, chat and its slash commands, bench). The
    generation settings (method, k, sampling, lookup ranges) are checked by the engine's own GenConfig, once."""
    check_threads(v.get("threads"))
    ctx = v.get("ctx_size")
    if ctx is not None and ctx < D.MIN_CTX:
        raise SettingError(f"context size ({{ctx_size}}) must be >= {D.MIN_CTX}, got {ctx}", "ctx_size")
    for key in ("temperature", "top_p", "min_p", "p_min"):
        x = v.get(key)
        if x is not None and not math.isfinite(x):
            raise SettingError(f"{{{key}}} must be a finite number, got {x}", key)
    seed = v.get("seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise SettingError(f"{{seed}} must be between 0 and 2^63-1, got {seed}", "seed")
    gen_config(v)  # method, exactness, k, sampling and lookup ranges


def gen_config(v: dict[str, Any], stop=None):
    """The engine's GenConfig from resolved setting values (validated there); unset values take the defaults."""
    from localspec.core.engine import GenConfig
    from localspec.sample.sampling import SamplingParams

    def val(key, default):
        return default if v.get(key) is None else v[key]

    return GenConfig(
        method=val("method", D.METHOD),
        k=int(val("draft_tokens", D.DRAFT_TOKENS)),
        max_tokens=val("max_tokens", D.MAX_TOKENS),
        stop=tuple(stop or ()),
        sampling=SamplingParams(
            temperature=val("temperature", 0.0), top_k=val("top_k", 0), top_p=val("top_p", 1.0),
            min_p=val("min_p", 0.0), seed=v.get("seed"),
        ),
        p_min=val("p_min", D.P_MIN),
        lookup_min=val("lookup_min", D.LOOKUP_MIN),
        lookup_max=val("lookup_max", D.LOOKUP_MAX),
        exactness=val("exactness", D.EXACTNESS_LEVEL),
    )


class Session:
    """One user's settings and loaded models, shared by a command's whole lifetime (a chat, a bench run)."""

    def __init__(self, flags: dict[str, Any] | None = None, *, quiet: bool = False,
                 announce: Callable[[str], None] | None = None) -> None:
        self._settings: dict[str, Setting] | None = None  # the resolved snapshot, until flags or overrides change
        self.flags = {k: v for k, v in (flags or {}).items() if v is not None}
        self.overrides = {}
        self.quiet = quiet
        self.announce = announce
        self.engine = None
        self.pair = None
        self.target_path: Path | None = None
        self.draft_path: Path | None = None
        self.chat_template: str | None = None  # a Jinja template that replaces the target's own (--chat-template)
        self.dropped_draft: str | None = None  # why resolve_models left out an incompatible draft (--method auto)
        # whether the engine keeps prompt states on disk (core/prompt_cache.py) where the setting prompt_cache is on:
        # the front ends that decode one request at a time (run, chat); bench measures cold prompts
        self.prompt_states = False
        # serve: the bytes of prompt states kept in memory for the process's lifetime in front of the disk store
        # (core/prompt_cache.ServerStates; None: the disk store alone, as run and chat keep them)
        self.prompt_cache_ram: int | None = None

    # ------------------------------------------------------------ settings
    @property
    def flags(self) -> dict[str, Any]:
        return self._flags

    @flags.setter
    def flags(self, value: dict[str, Any]) -> None:
        self._flags, self._settings = dict(value), None

    @property
    def overrides(self) -> dict[str, Any]:
        """Changes made during the session (chat's slash commands); assigning them drops the settings snapshot."""
        return self._overrides

    @overrides.setter
    def overrides(self, value: dict[str, Any]) -> None:
        self._overrides, self._settings = dict(value), None

    def settings(self) -> dict[str, Setting]:
        """Every setting with its value and source: resolved once (config file, environment, pair, tune results),
        then kept until the session's flags or overrides change (`refresh()` re-reads the files)."""
        if self._settings is None:
            self._settings = resolve_settings(self._flags, self._overrides)
        return dict(self._settings)

    def refresh(self) -> None:
        """Forget the snapshot: the next read resolves the settings again (the config file may have changed)."""
        self._settings = None

    def values(self) -> dict[str, Any]:
        return {k: s.value for k, s in self.settings().items()}

    def __getitem__(self, key: str) -> Any:
        return self.values()[key]

    def set(self, key: str, value: Any) -> None:
        """A change made during the session (chat's /method, /k, /temp ...): it wins over stored tune results.
        Validated as a flag would be; on error nothing changes."""
        if key not in config.SETTINGS:
            raise UsageError(f"unknown setting {key}")
        trial = {**self.overrides, key: value}
        validate({k: s.value for k, s in resolve_settings(self.flags, trial).items()})
        self.overrides = trial

    def prepare(self, engine=None) -> None:
        """The one-time work before the first answer, done while the front end shows it is loading: the exactness
        probe for the k in use (cached per model and build, seconds on a CPU). `engine`: another than the
        session's own (a chat's test loader)."""
        engine = engine if engine is not None else self.engine
        v = self.values()
        if engine is not None and v["method"] != "none":
            engine.exact_k(gen_config(v).k)

    def notices(self, engine=None) -> Iterator[str]:
        """What the user should be told once after loading, in plain words (each front end shows them its way)."""
        engine = engine if engine is not None else self.engine
        if engine is None:
            return
        if engine.dropped_draft:
            yield f"{engine.dropped_draft}; using prompt lookup"
        if engine.template_warning:
            yield engine.template_warning

    def check(self) -> None:
        """Fail on bad values (and unreachable RPC workers) before loading gigabytes."""
        v = self.values()
        validate(v)
        rpc.check_settings(v.get("rpc"), v.get("tensor_split"))
        local = Path(v["model"]).expanduser() if v.get("model") else None
        if local is not None and local.is_file():  # a pair or hub name is checked once its file is at hand
            check_target(local)

    def gen_config(self, stop=None, **changes):
        v = {**self.values(), **changes}
        return gen_config(v, stop)

    # ------------------------------------------------------------ models
    def resolve_models(self) -> tuple[Path, Path | None, Any]:
        """(target path, draft path or None, pair or None). -m/-d name a path, a pair or a hub model
        (hf://OWNER/REPO/FILE.gguf, OWNER/REPO[:QUANT]); hub files are fetched on first use. When a file must be
        downloaded, the pair check runs first on the GGUF headers: an incompatible draft is an error before any
        download, or, with --method auto, is dropped without being downloaded (the reason in dropped_draft)."""
        v = self.values()
        model, draft, method = v["model"], v["draft"], v["method"]
        self.dropped_draft = None

        def spec_for(name: str, role: str):
            """(FileSpec, the pair it came from or None)."""
            kind, obj = registry.resolve_name(name)
            if kind == "pair":
                return (obj.draft or obj.target) if role == "draft" else obj.target, obj
            if kind == "path":
                if not obj.is_file():
                    hint = f" (a hub file is written hf://{name})" if name.count("/") >= 2 and name[0] not in "./~" else ""
                    raise UsageError(f"{role} file not found: {name}{hint}")
                return FileSpec(path=str(obj)), None
            spec = hfname.resolve(obj)
            if self.announce:
                self.announce(printable(f"{name}: {spec.repo}/{spec.file}"))
            return spec, None

        tspec, pair = spec_for(model, "model")
        dspec = dpair = None
        if method != "none":
            if draft:
                dspec, dpair = spec_for(draft, "draft")
            elif pair is not None and pair.draft is not None and method in ("auto", "draft"):
                dspec, dpair = pair.draft, pair
        vetted = pair is not None and dpair is pair and pair.source == "shipped"  # shipped pairs are checked
        if dspec is not None and not vetted and (download.local_path(tspec) is None or download.local_path(dspec) is None):
            why = remote.remote_incompatibility(tspec, dspec)
            if why:
                msg = f"draft {Path(dspec.label).name} cannot speculate for {Path(tspec.label).name}: {why}"
                if method != "auto":
                    raise UsageError(f"{msg} (nothing was downloaded)")
                self.dropped_draft, dspec = msg, None
        target = download.ensure(tspec, quiet=self.quiet)
        check_target(target)
        draft_path = download.ensure(dspec, quiet=self.quiet) if dspec is not None else None
        return target, draft_path, pair

    def load(self):
        """Resolve, fetch and load the models; the engine replaces any loaded before."""
        from localspec.core.engine import Engine

        self.check()
        target, draft, pair = self.resolve_models()
        v = self.values()
        if self.announce:
            self.announce(printable(f"loading {target.name}" + (f" + {draft.name}" if draft else "") + " ..."))
        engine = Engine.load(
            target, draft, n_ctx=v["ctx_size"], gpu_layers=v["gpu_layers"], draft_gpu_layers=v["draft_gpu_layers"],
            threads=v["threads"], drop_incompatible_draft=v["method"] == "auto",
            rpc=v.get("rpc"), tensor_split=v.get("tensor_split"), chat_template=self.chat_template,
        )
        aborts.on_abort(history.save_now)  # llama.cpp may kill the process (a dead RPC worker): keep the chat
        if engine.dropped_draft is None and self.dropped_draft:
            engine.dropped_draft = self.dropped_draft  # dropped before its download
        # every front end shows these as they are: they quote file names and strings read from the model files
        for attr in ("dropped_draft", "template_warning"):
            if getattr(engine, attr, None):
                setattr(engine, attr, printable(getattr(engine, attr)))
        if self.prompt_states and v["prompt_cache"] and v["prompt_cache_bytes"] > 0:
            from localspec.core.prompt_cache import PromptCache
            from localspec.store.prompt_states import PromptStates

            store = PromptStates(budget=v["prompt_cache_bytes"])
            if self.prompt_cache_ram is not None:
                from localspec.core.prompt_cache import ServerStates

                store = ServerStates(self.prompt_cache_ram, store)
            engine.prompt_cache = PromptCache(store)
        self.close()
        self.engine, self.pair, self.target_path, self.draft_path = engine, pair, target, draft
        return engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


# ---------------------------------------------------------------- machine-wide generation slots
def parallel_slots() -> int:
    raw = os.environ.get("LOCALSPEC_PARALLEL", "")
    if raw == "":
        return 1
    try:
        n = int(raw)
    except ValueError:
        raise UsageError(f"LOCALSPEC_PARALLEL must be a whole number >= 1, got {raw!r}") from None
    if n < 1:
        raise UsageError(f"LOCALSPEC_PARALLEL must be a whole number >= 1, got {raw!r}")
    return n


@contextlib.contextmanager
def generation_slot(waiting: Callable[[str], None] | None = None, poll_s: float = 0.05) -> Iterator[int]:
    """Take one of LOCALSPEC_PARALLEL (default 1) machine-wide slots for a generation. llama.cpp's threads spin
    while they wait for work, so two generations at once on the same cores each run far below half speed; in
    turn, they finish sooner. Yields the slot number; `waiting` is told once when another process holds them all."""
    n = parallel_slots()
    d = cache_dir() / "locks"
    d.mkdir(parents=True, exist_ok=True)
    locks = [FileLock(str(d / f"generation-slot-{i}.lock")) for i in range(n)]
    told = False
    while True:
        for i, lock in enumerate(locks):
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            try:
                yield i
            finally:
                lock.release()
            return
        if not told and waiting is not None:
            waiting(f"waiting for another localspec generation to finish ({n} at a time; LOCALSPEC_PARALLEL=N allows more)")
            told = True
        time.sleep(poll_s)


def stderr_note(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()
