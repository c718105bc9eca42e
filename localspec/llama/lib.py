"""The one importer of llama_cpp: the library handle, backend start-up with llama.cpp's log silenced, and signal
deferral while llama.cpp runs code that must not be interrupted by a Python exception."""

from __future__ import annotations

import ctypes
import os
import signal
import threading

from localspec.errors import ModelLoadError
from localspec.knobs import knobs

DEBUG = knobs().debug  # as the CLI reads it (--debug)
if not DEBUG:
    # ggml forks gdb for a backtrace on GGML_ABORT and on uncaught C++ exceptions (the latter decided when the
    # library loads, so this must come before the import); users get one `error:` line instead (see on_abort)
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")

try:  # imported lazily-safe: a broken install becomes a clear error at load time
    import llama_cpp as ll
except Exception as exc:  # pragma: no cover - exercised only on broken installs
    ll = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None

_backend_lock = threading.Lock()
_backend_ready = False
_log_cb = None


def require():
    if ll is None:
        raise ModelLoadError(f"llama-cpp-python is not importable: {_IMPORT_ERROR}")
    return ll


def _c_noop_log_callback(ll):
    """llama.cpp's log callback as a C function that ignores its arguments, or None where none is found.

    A Python callback would run Python inside llama.cpp: Ctrl-C arriving then raises KeyboardInterrupt inside the
    ctypes callback, which ctypes prints ("Exception ignored on calling ctypes callback") and drops, so the
    interrupt is lost. libc's `abs(int)` reads only the first argument (the level), has no side effect, and its
    result is discarded by the caller, so it serves as a no-op with the callback's register calling convention.
    """
    try:
        libc = ctypes.CDLL(None) if os.name != "nt" else ctypes.cdll.msvcrt
        addr = ctypes.cast(libc.abs, ctypes.c_void_p).value
    except (OSError, AttributeError):  # pragma: no cover - exotic platforms
        return None
    return ll.llama_log_callback(addr) if addr else None


def init_backend() -> None:
    global _backend_ready, _log_cb
    ll = require()
    with _backend_lock:
        if _backend_ready:
            return
        if not knobs().llama_log:
            # silence llama.cpp's chatter on stderr (stderr belongs to our status line)
            _log_cb = _c_noop_log_callback(ll)
            if _log_cb is None:  # pragma: no cover - no libc: a Python no-op (Ctrl-C may then be lost while loading)
                @ll.llama_log_callback
                def _quiet(level, text, user_data):  # noqa: ARG001
                    return None

                _log_cb = _quiet
            ll.llama_log_set(_log_cb, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _backend_ready = True


class DeferSignals:
    """While llama.cpp loads a model (main thread only): SIGINT/SIGTERM/SIGHUP only set a flag, so no Python
    exception is raised inside a ctypes callback (where it would be dropped); the load's progress callback sees the
    flag and aborts loading; on exit the first signal is delivered to the handler that was installed before."""

    SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))

    def __init__(self) -> None:
        self.received: int | None = None
        self._saved: dict[int, object] = {}

    def _flag(self, signum, frame) -> None:  # noqa: ARG002
        if self.received is None:
            self.received = signum

    def progress(self, fraction, user_data) -> bool:  # noqa: ARG002 - llama_progress_callback: False aborts
        return self.received is None

    def __enter__(self) -> "DeferSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                h = signal.getsignal(s)
                if callable(h):  # a Python handler (default_int_handler for SIGINT): defer it
                    self._saved[s] = signal.signal(s, self._flag)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._saved.items():
            signal.signal(s, h)
        if self.received is not None and exc[0] is None:
            self._saved[self.received](self.received, None)


def set_log_callback(cb) -> None:
    """Route llama.cpp's log through `cb` (a llama_log_callback; kept alive here)."""
    global _log_cb
    _log_cb = cb
    require().llama_log_set(cb, ctypes.c_void_p(0))
