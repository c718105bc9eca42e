"""The probes' memo: the one cache file in which the exactness probe (core/exactness.py), the verify-cost calibration
(core/verify_cost.py) and the batch probe (core/batch_probe.py) keep what they measured, and the keys they keep it
under: the model file as it is now, the llama.cpp build and CPU, and the settings that decide the measurement. An
entry whose file or build has changed is never looked up again (`is_current` says which are still used)."""

from __future__ import annotations

from pathlib import Path

from localspec.knobs import knobs

CACHE_FILE = "exact_batch.json"
LONG_CONTEXT = 600  # past 512 KV cells, where llama.cpp's CPU attention changes strategy
# each kind of entry's key prefix (a single-sequence probe's key has none: it starts with the model file)
COST_KEY = "cost2|"  # the verify-cost calibration
OLD_COST_KEY = "cost|"  # cost|: timed one size after the other (time_batches' docstring), measured again
BATCH_KEY = "batch|"  # the probe of several requests in one pass (core/batch.py), beside the single-sequence probes


def long_ok(model, upto: int) -> bool:
    """Whether the context has room for the probe's long prefix (LONG_CONTEXT) and `upto` rows after it."""
    return model.n_ctx >= LONG_CONTEXT + upto + 8


def this_build() -> str:
    """The llama.cpp build and the CPU it runs on (llama/sysinfo.build_id): a key part of every probe."""
    from localspec.llama.sysinfo import build_id

    return build_id()


def file_version(path) -> str:
    """A model file as it is now: its resolved path, size and modification time (the start of every cache key, so a
    file replaced at the same path is measured anew)."""
    st = Path(path).stat()
    return f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}"


def model_key(model, upto: int) -> str:
    """A single-sequence probe's key, and the start of the other entries' keys after their prefix: the model file,
    threads, GPU layers, build, weight repacking, KV type, whether the long prefix fits, and `upto`."""
    parts = [file_version(model.path), model.n_threads, model.n_gpu_layers,
             this_build(), "1" if knobs().no_repack else "", model.kv_type,
             long_ok(model, upto), upto]
    if getattr(model, "rpc_servers", None):  # the workers compute the layers: their kernels decide
        parts += ["rpc=" + ",".join(model.rpc_servers), "split=" + str(getattr(model, "tensor_split", None))]
    return "|".join(str(x) for x in parts)


def is_current(key: str, entry: dict, build: str) -> bool:
    """Whether a cached entry is the one the model file as it is now, on this llama.cpp build, would be looked up by
    (for some threads, GPU layers and KV type): a file replaced at the same path, or a cache dir shared with another
    machine or build, leaves entries that are never used here again."""
    try:
        version = file_version(entry.get("model"))
    except (OSError, TypeError, ValueError):
        return False
    return f"{version}|" in key and f"|{build}|" in key
