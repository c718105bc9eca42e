"""`localspec worker`: llama.cpp's RPC server from the same llama.cpp build, so a worker machine needs only
`pip install localspec`. Another machine's `localspec run --rpc HOST:PORT` then places target layers here.

llama.cpp's server (ggml_backend_rpc_start_server) blocks in C forever and serves one client at a time. It runs
in a daemon thread; the main thread waits in Python, where Ctrl-C arrives, and the process exits with 130.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
import time
from pathlib import Path

from localspec import rpcwire as rpc
from localspec.errors import UsageError

READY_TIMEOUT_S = 60.0


def _check_bindable(host: str, port: int) -> None:
    """Bind the address once ourselves (llama.cpp's server says only "Failed to create server socket")."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as llama.cpp does
        s.bind((host, port))
    except OSError as exc:
        why = {errno.EADDRINUSE: "the port is in use (another worker?)",
               errno.EADDRNOTAVAIL: "no network interface of this machine has that address",
               errno.EACCES: "permission denied (ports below 1024 need privileges)"}.get(exc.errno, exc.strerror)
        raise rpc.RPCError(f"cannot listen on {host}:{port}: {why}") from None
    finally:
        s.close()


def serve(host: str = "127.0.0.1", port: int = rpc.DEFAULT_PORT, threads: int | None = None,
          cache_dir: str | os.PathLike | None = None, *, say=None) -> None:
    """Run the worker until Ctrl-C (KeyboardInterrupt propagates) or until llama.cpp's server gives up."""
    from localspec.llama import ggml
    from localspec.llama import sysinfo
    say = say or (lambda msg: (sys.stderr.write(msg + "\n"), sys.stderr.flush()))
    host = rpc.listen_address(host, port)
    if threads is not None and threads < 1:
        raise UsageError(f"threads must be >= 1, got {threads}")
    n_threads = threads or sysinfo.default_threads()
    cache = None
    if cache_dir is not None:
        p = Path(cache_dir).expanduser()
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create cache dir {p}: {exc.strerror}") from None
        cache = str(p)
    endpoint = f"{host}:{port}"
    if not rpc.is_loopback(host):
        say(rpc.SECURITY_WARNING.format(endpoint=endpoint))
    _check_bindable(host, port)
    if not ggml.rpc_available():
        raise rpc.RPCError("this llama-cpp-python build has no RPC backend; reinstall it with -DGGML_RPC=ON "
                           "(bash .ci/install-llama-cpp does)")
    _relay_stdout_to_stderr(say)
    failed: list[BaseException] = []

    def _run():
        try:
            ggml.rpc_start_server(endpoint, cache, n_threads)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failed.append(exc)

    t = threading.Thread(target=_run, name="rpc-server", daemon=True)
    t.start()
    _wait_ready(t, host, port, failed)
    say(f"worker listening on {endpoint} ({n_threads} threads{', cache ' + cache if cache else ''}); Ctrl-C stops it")
    while t.is_alive():
        t.join(0.25)  # short waits: Ctrl-C is delivered to the main thread between them
    if failed:
        raise failed[0]
    raise rpc.RPCError(f"llama.cpp's RPC server on {endpoint} stopped (see its messages above)")


def _relay_stdout_to_stderr(say) -> None:
    """llama.cpp's server prints its device list and connections with printf. stdout is for answers, so they go
    to stderr with everything else this command says, whole lines at a time (a pipe relayed by a thread)."""
    sys.stdout.flush()
    r, w = os.pipe()
    os.dup2(w, sys.stdout.fileno())
    os.close(w)

    def relay():
        with os.fdopen(r, "r", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                say(line.rstrip("\n"))

    threading.Thread(target=relay, name="stdout-relay", daemon=True).start()


def _wait_ready(t: threading.Thread, host: str, port: int, failed: list) -> None:
    """Until the server answers a HELLO (it binds after setting up its devices; there is no ready signal)."""
    probe_host = "127.0.0.1" if host == "0.0.0.0" else host
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if not t.is_alive():
            if failed:
                raise failed[0]
            raise rpc.RPCError(f"llama.cpp's RPC server could not start on {host}:{port} (see its messages above)")
        try:
            version = rpc.hello(f"{probe_host}:{port}", timeout=2.0)
        except rpc.RPCError:
            if time.monotonic() > deadline:
                raise rpc.RPCError(f"llama.cpp's RPC server did not answer on {host}:{port} within "
                                   f"{READY_TIMEOUT_S:g} s") from None
            time.sleep(0.1)
            continue
        rpc.check_version(f"{host}:{port}", version)  # this build against rpc.py's constants
        return
