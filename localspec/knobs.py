"""The LOCALSPEC_* switches for diagnosis, benchmarks and tests, read from the environment in this one place into a
typed object. They are not user settings (those are in settings.py, from flags, config.toml and the pair): each
forces or disables one mechanism, so a measurement or a test can pin it. A malformed value is a one-line error.

A leaf: the llama layer, the core and the server all read their switches through `knobs()`, which reads the
environment when called (a test that sets a variable sees it in the next object it makes)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from localspec.errors import UsageError

KV_TYPES = ("f16", "q8_0", "bf16")


@dataclass(frozen=True)
class Knobs:
    rs_seq: int | None  # LOCALSPEC_RS_SEQ: recurrent-state planes asked for (None: the model layer's default)
    no_repack: bool  # LOCALSPEC_NO_REPACK: no repacked CPU weight layouts (a work-around for AMX crashes)
    kv_type: str | None  # LOCALSPEC_KV_TYPE: the KV cache type (None: bf16 on the CPU, f16 on a GPU)
    rollback: str  # LOCALSPEC_ROLLBACK: checkpoint|none forces a recurrent/hybrid model's rollback kind ("": detect)
    kv_unified: bool | None  # LOCALSPEC_KV_UNIFIED=1/0: one KV cache for every batch slot, or one stream each
    batch_pad: bool | None  # LOCALSPEC_BATCH_PAD=1/0: pad a batch step to one pass always/never (None: by cost)
    no_cost_calibration: bool  # LOCALSPEC_NO_COST_CALIBRATION: no verify-cost measurement (priors only)
    allow_inexact: bool  # LOCALSPEC_ALLOW_INEXACT: exactness auto means lossless
    llama_log: bool  # LOCALSPEC_LLAMA_LOG: let llama.cpp's own log through to stderr
    debug: bool  # LOCALSPEC_DEBUG: tracebacks, and llama.cpp's backtrace on an abort

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> "Knobs":
        env = os.environ if env is None else env

        def flag(name: str) -> bool:
            return env.get(name, "") not in ("", "0")

        def tristate(name: str) -> bool | None:
            v = env.get(name, "")
            return None if v == "" else v != "0"

        rs = env.get("LOCALSPEC_RS_SEQ", "")
        try:
            rs_seq = None if rs == "" else max(0, int(rs))
        except ValueError:
            raise UsageError(f"LOCALSPEC_RS_SEQ must be a whole number, got {rs!r}") from None
        kv = env.get("LOCALSPEC_KV_TYPE", "") or None
        if kv is not None and kv not in KV_TYPES:
            raise UsageError(f"LOCALSPEC_KV_TYPE must be one of {', '.join(KV_TYPES)}, got {kv!r}")
        rollback = env.get("LOCALSPEC_ROLLBACK", "")
        if rollback not in ("", "kv", "rs", "checkpoint", "none"):
            raise UsageError(f"LOCALSPEC_ROLLBACK must be checkpoint or none, got {rollback!r}")
        return cls(rs_seq=rs_seq, no_repack=bool(env.get("LOCALSPEC_NO_REPACK")), kv_type=kv, rollback=rollback,
                   kv_unified=tristate("LOCALSPEC_KV_UNIFIED"), batch_pad=tristate("LOCALSPEC_BATCH_PAD"),
                   no_cost_calibration=bool(env.get("LOCALSPEC_NO_COST_CALIBRATION")),
                   allow_inexact=flag("LOCALSPEC_ALLOW_INEXACT"), llama_log=bool(env.get("LOCALSPEC_LLAMA_LOG")),
                   debug=flag("LOCALSPEC_DEBUG"))


def knobs() -> Knobs:
    return Knobs.read()
