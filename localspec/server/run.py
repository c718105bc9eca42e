"""Running the server: the listening socket, the exposure warning, and uvicorn's server with a clean stop."""

from __future__ import annotations

import socket
from typing import Callable

from localspec.errors import LocalspecError, UsageError
from localspec.server.guard import is_loopback

__all__ = ["bind", "exposure_warning", "is_loopback", "Server"]


def exposure_warning(host: str, port: int, api_key: str | None) -> str | None:
    if is_loopback(host):
        return None
    who = f"anyone who can reach this machine on {host}:{port}"
    if api_key:
        return (f"warning: listening on {host}:{port}: {who} can reach the API (requests need the API key; "
                "plain HTTP, so the key and the text travel unencrypted)")
    return (f"warning: listening on {host}:{port}: {who} can use the API (generate text with the loaded model) "
            "WITHOUT authentication; pass --api-key or set LOCALSPEC_API_KEY")


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise UsageError(f"port must be between 0 and 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise LocalspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


try:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that, on SIGTERM/SIGINT, first tells the app (`on_exit`: end open streams with an
        error event and [DONE]) and then returns instead of raising the signal again."""

        def __init__(self, config, on_exit: Callable[[], None] | None = None) -> None:
            super().__init__(config)
            self.on_exit = on_exit

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first and self.on_exit is not None:
                self.on_exit()
            # Ctrl-C / SIGTERM is how a server is stopped: shut down gracefully and return (uvicorn would raise the
            # signal again afterwards, skipping the worker's stop and the models' close)
            getattr(self, "_captured_signals", []).clear()
except ImportError:  # pragma: no cover - fastapi without uvicorn
    Server = None
