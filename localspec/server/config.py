"""The server's own settings, typed (uvicorn's style: the CLI's flags -> a `ServerConfig` -> the server). The
generation settings (method, k, sampling ...) stay in the session; these say who may talk to the server and how
much it takes."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Optional

from localspec.defaults import KV_LAYOUTS
from localspec.errors import UsageError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE = 8  # requests that may wait while one generates
# --parallel: requests decoded together in one batch (core/batch.py). The one place to change the default: on a
# CPU-only machine (compute-bound: a batch of 4 costs nearly 4 single decodes) 1 until a measurement shows a gain,
# with layers on a GPU (a batch of 4 costs about one) 4.
PARALLEL_CPU = 1
PARALLEL_GPU = 4
MAX_PARALLEL = 64
# --prompt-cache-ram: bytes of prompt states kept in memory for the server's lifetime (core/prompt_cache.py), in
# front of the disk store: 2 GiB, or an eighth of the machine's memory where that is less
PROMPT_CACHE_RAM = 2 << 30
DEFAULT_MAX_BODY = 4 * 1024 * 1024  # bytes
MAX_STOPS = 16
POLL_S = 0.1  # how often a waiting non-streamed request checks that its client is still there
ALIASES = ("localspec",)  # model names accepted besides the served model's id and its target file name
ALLOWED_HOSTS_ENV = "LOCALSPEC_ALLOWED_HOSTS"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")  # Host header names always accepted
# --cors-origins entries besides origins: "*" (any page) and "localhost" (llama-server's keyword: pages served from
# this machine, any port, http or https)
CORS_ANY, CORS_LOCAL = "*", "localhost"
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+/?", re.I)


def split_list(raw: str | None) -> tuple[str, ...]:
    """A comma-separated list (an environment variable) as a tuple of its non-empty, stripped items."""
    return tuple(x.strip() for x in (raw or "").split(",") if x.strip())


@dataclass(frozen=True)
class ServerConfig:
    """What `localspec serve` needs besides the session.

    allowed_hosts: Host header names accepted besides the bound host and loopback names ("*": any); None reads
    LOCALSPEC_ALLOWED_HOSTS. cors_origins: browser origins allowed to call the API ("*": any; "localhost": pages on
    this machine, any port; default none: a request with an Origin header is refused). max_k: the largest
    per-request `localspec.k` (None: the session's draft_tokens, at least 1). strict_model: refuse a request naming a model this server does not serve.
    no_metrics: no GET /metrics (Prometheus)."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: Optional[str] = None
    queue_size: int = DEFAULT_QUEUE
    max_body: int = DEFAULT_MAX_BODY
    allowed_hosts: Optional[tuple[str, ...]] = None
    cors_origins: tuple[str, ...] = ()
    max_k: Optional[int] = None
    strict_model: bool = False
    no_metrics: bool = False
    parallel: Optional[int] = None  # slots decoded together (None: default_parallel)
    kv_layout: str = "auto"  # the slots' KV cache: auto | split (one stream each) | unified (one cache)
    prompt_cache_ram: Optional[int] = None  # bytes of prompt states in memory (None: default_prompt_cache_ram)

    def __post_init__(self) -> None:
        for name in ("allowed_hosts", "cors_origins"):  # a list or a comma-separated string is fine too
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, split_list(value))
            elif value is not None:
                object.__setattr__(self, name, tuple(value))

    def check(self) -> "ServerConfig":
        """Raise UsageError for a value the server cannot run with; returns self."""
        if self.api_key is not None and self.api_key.strip() == "":
            raise UsageError("the API key must not be empty")
        if self.queue_size < 1:
            raise UsageError(f"--queue must be >= 1, got {self.queue_size}")
        if self.max_body < 1:
            raise UsageError(f"body limit must be >= 1 byte, got {self.max_body}")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"port must be between 0 and 65535, got {self.port}")
        if self.parallel is not None and not 1 <= self.parallel <= MAX_PARALLEL:
            raise UsageError(f"--parallel must be between 1 and {MAX_PARALLEL}, got {self.parallel}")
        if self.kv_layout not in KV_LAYOUTS:
            raise UsageError(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.prompt_cache_ram is not None and self.prompt_cache_ram < 0:
            raise UsageError(f"--prompt-cache-ram must be >= 0 bytes, got {self.prompt_cache_ram}")
        if self.max_k is not None and self.max_k < 1:
            raise UsageError(f"max k must be >= 1, got {self.max_k}")
        for o in self.cors_origins:  # an entry that is no origin would match no page, silently
            if o not in (CORS_ANY, CORS_LOCAL) and o.lower() != CORS_LOCAL and not _ORIGIN.fullmatch(o):
                raise UsageError(f"--cors-origins: {o!r} is not an origin; give scheme://host[:port] (e.g. "
                                 "http://localhost:5173), localhost (pages on this machine, any port) or *")
        return self

    def resolved(self, default_k: int, on_gpu: bool = False) -> "ServerConfig":
        """With the defaults that depend on the environment and the session filled in (on_gpu: the target's layers
        are on a GPU)."""
        hosts = self.allowed_hosts
        if hosts is None:
            hosts = split_list(os.environ.get(ALLOWED_HOSTS_ENV))
        max_k = self.max_k if self.max_k is not None else max(1, int(default_k))
        parallel = self.parallel if self.parallel is not None else default_parallel(on_gpu)
        ram = self.prompt_cache_ram if self.prompt_cache_ram is not None else default_prompt_cache_ram()
        return dataclasses.replace(self, allowed_hosts=hosts, max_k=max_k, parallel=parallel, prompt_cache_ram=ram)

    def replace(self, **changes) -> "ServerConfig":
        return dataclasses.replace(self, **changes)


def default_parallel(on_gpu: bool) -> int:
    """serve's --parallel when none is given: PARALLEL_GPU with the target on a GPU, else PARALLEL_CPU."""
    return PARALLEL_GPU if on_gpu else PARALLEL_CPU


def default_prompt_cache_ram() -> int:
    """serve's --prompt-cache-ram when none is given: PROMPT_CACHE_RAM, or an eighth of the machine's memory where
    that is less."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return PROMPT_CACHE_RAM
    return min(PROMPT_CACHE_RAM, total // 8) if total > 0 else PROMPT_CACHE_RAM
