"""`localspec worker`: lend this machine's CPU/GPUs to another machine's `--rpc`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from localspec.cli.options import state

EPILOG = ("Example: on the worker machine `localspec worker --host 0.0.0.0`, then on yours "
          "`localspec run --rpc WORKER_IP:50052 \"prompt\"`.")


def worker(
    host: Annotated[str, typer.Option("--host", help="IPv4 address to listen on; anything but loopback exposes it to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 50052,
    threads: Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: all cores).", show_default=False)] = None,
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", help="Keep received tensors here (large ones are then sent once).", show_default=False)] = None,
):
    """Serve this machine's CPU/GPUs to other machines' `--rpc` (llama.cpp's RPC server). Ctrl-C stops it."""
    from localspec.rpc.worker import serve

    try:
        serve(host, port, threads, cache_dir)
    except KeyboardInterrupt:
        state.interrupt_reported = True
        sys.stderr.write("\nworker stopped\n")
        sys.stderr.flush()
        os._exit(130)  # llama.cpp's server thread is blocked in accept(): no interpreter teardown under it

