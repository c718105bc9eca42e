"""`localspec serve` from start to stop: the settings checked, the socket bound, the pair loaded and probed once, the
app (server/app.py) served by uvicorn until a stop signal, then the running generation given time to end."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from localspec import session as S
from localspec.errors import LocalspecError
from localspec.server.app import create_app
from localspec.server.config import DEFAULT_MAX_BODY, DEFAULT_QUEUE, ServerConfig, default_prompt_cache_ram
from localspec.server.run import Server, bind, exposure_warning


def serve(session, *, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          queue_size: int = DEFAULT_QUEUE, max_body: int = DEFAULT_MAX_BODY,
          log: Callable[[str], None] = S.stderr_note, allowed_hosts: Sequence[str] | str | None = None,
          cors_origins: Sequence[str] | str = (), max_k: int | None = None, strict_model: bool = False,
          no_metrics: bool = False, config: ServerConfig | None = None) -> None:
    """`localspec serve`: bind, load the pair once, announce the URL, serve until Ctrl-C. The keyword arguments are
    ServerConfig's fields (see server/config.py); `config` gives the rest, overridden by them."""
    import uvicorn

    if Server is None:  # pragma: no cover
        raise LocalspecError("uvicorn is not installed: pip install uvicorn")
    changes: dict[str, Any] = dict(host=host, port=port, api_key=api_key, queue_size=queue_size, max_body=max_body)
    for key, value, unset in (("allowed_hosts", allowed_hosts, None), ("cors_origins", cors_origins, ()),
                              ("max_k", max_k, None), ("strict_model", strict_model, False),
                              ("no_metrics", no_metrics, False)):
        if value != unset:
            changes[key] = value
    cfg = (config or ServerConfig()).replace(**changes).check()
    S.parallel_slots()  # a bad LOCALSPEC_PARALLEL is a usage error now, not a 400 on every request
    session.check()
    sock = bind(cfg.host, cfg.port)
    stopped, app = False, None
    try:
        session.announce = session.announce or log
        # prompt states (core/prompt_cache.py), where the setting prompt_cache is on: in memory for the server's
        # lifetime over the disk store, for one request at a time and for the batch's slots
        session.prompt_states = True
        session.prompt_cache_ram = cfg.prompt_cache_ram if cfg.prompt_cache_ram is not None \
            else default_prompt_cache_ram()
        session.load()
        for note in session.notices():
            log(f"warning: {note}")
        session.prepare()  # the one-time exactness probe, before the first request
        app = create_app(session, cfg, log=log)
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=3,
                                lifespan="on")
        server = Server(config, on_exit=app.state.begin_shutdown)
        real_port = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        warning = exposure_warning(host, real_port, cfg.api_key)
        if warning:
            log(warning)
        sock.listen(2048)  # from here on connections wait in the backlog until uvicorn accepts them
        # from the ready line on, a stop signal stops the server as uvicorn's own handler does (it installs that one
        # only once its loop runs; before, the run-time handler's KeyboardInterrupt could land anywhere, and inside
        # importlib's lock callback it was swallowed and the server ran on)
        previous = _stop_signals_exit(server)
        try:
            log(f"localspec serve: http://{shown}:{real_port}/v1 (model {app.state.model})")
            server.run(sockets=[sock])
        finally:
            _restore_signals(previous)
        stopped = app.state.worker.stop(timeout=60)
        log("localspec serve: stopped" if stopped else "localspec serve: a generation did not stop in time")
    finally:
        sock.close()
        if app is None or stopped:
            session.close()  # never under a generation that is still running


def _stop_signals_exit(server) -> dict:
    """SIGINT/SIGTERM/SIGHUP -> server.handle_exit until uvicorn's handlers take over; returns the handlers replaced
    (none off the main thread: embedded use keeps its own)."""
    import signal

    previous = {}
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            previous[sig] = signal.signal(sig, server.handle_exit)
        except (ValueError, OSError):  # not the main thread
            break
    return previous


def _restore_signals(previous: dict) -> None:
    import signal

    for sig, handler in previous.items():
        signal.signal(sig, handler)
