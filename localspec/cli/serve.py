"""`localspec serve`: the pair behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from localspec.cli.options import (CtxOpt, DraftGpuOpt, DraftOpt, ExactnessOpt, GpuOpt, KOpt, MethodOpt,
                                    ModelOpt, NoPromptCacheOpt, RpcOpt, SplitOpt, TemplateOpt, ThreadsOpt, _opt, flags,
                                    use_template)

EPILOG = (
    "Examples:\n\n"
    "  localspec serve\n\n"
    "  localspec serve -m ./model.gguf -d ./draft.gguf --port 8000\n\n"
    "  localspec serve --parallel 4   # four requests decoded together\n\n"
    "  LOCALSPEC_API_KEY=secret localspec serve --host 0.0.0.0"
)


def serve(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    method: MethodOpt = None,
    draft_tokens: KOpt = None,
    exactness: ExactnessOpt = None,
    p_min: _opt("p_min", "--p-min", help="The draft model stops drafting when its top probability falls below this.") = None,
    max_tokens: _opt("max_tokens", "-n", "--max-tokens", help="Default for requests without max_tokens.") = None,
    temperature: _opt("temperature", "-t", "--temperature", "--temp", help="Default for requests without temperature (0 = greedy).") = None,
    ctx_size: CtxOpt = None,
    gpu_layers: GpuOpt = None,
    draft_gpu_layers: DraftGpuOpt = None,
    threads: ThreadsOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on; anything but loopback exposes the API.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port).")] = 8080,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="LOCALSPEC_API_KEY", help="Require Authorization: Bearer KEY (env LOCALSPEC_API_KEY).", show_default=False)] = None,
    queue: Annotated[int, typer.Option("--queue", help="Requests that may wait while every slot is busy (more: 503 with Retry-After).")] = 8,
    chat_template: TemplateOpt = None,
    allowed_hosts: Annotated[Optional[str], typer.Option("--allowed-hosts", envvar="LOCALSPEC_ALLOWED_HOSTS", help="Host header names accepted besides the bound address and localhost, comma-separated (* = any; env LOCALSPEC_ALLOWED_HOSTS).", show_default=False)] = None,
    cors_origins: Annotated[Optional[str], typer.Option("--cors-origins", help="Browser origins allowed to call the API, comma-separated, e.g. http://localhost:5173 (localhost = pages on this machine, any port; * = any; default: none).", show_default=False)] = None,
    max_k: Annotated[Optional[int], typer.Option("--max-k", help="Largest per-request localspec.k (default: -k).", show_default=False)] = None,
    strict_model: Annotated[bool, typer.Option("--strict-model", help="Refuse requests naming another model (404) instead of serving the loaded one.")] = False,
    no_metrics: Annotated[bool, typer.Option("--no-metrics", help="Do not serve GET /metrics (Prometheus).")] = False,
    kv_layout: Annotated[str, typer.Option("--kv-layout", help="With --parallel N > 1, where the slots keep their KV cache: split (one stream each: a request keeps bit exactness while the passes it shares are bit-identical), unified (one cache: every step is one forward pass, drafted rows included; batched requests run at lossless), auto (unified where a full batch is not bit-identical here anyway and the method drafts, else split).")] = "auto",
    no_prompt_cache: NoPromptCacheOpt = False,
    prompt_cache_ram: Annotated[Optional[int], typer.Option("--prompt-cache-ram", help="Bytes of prompt states the server keeps in memory, in front of the disk store (default: 2 GiB, or an eighth of the machine's memory where less; 0: disk only).", show_default=False)] = None,
    parallel: Annotated[Optional[int], typer.Option("--parallel", help="Requests decoded together in one batch (1-64), each with its own speculation (default: 1 on CPU, 4 with the model on a GPU); more wait in the queue. Not LOCALSPEC_PARALLEL, which limits generations machine-wide.", show_default=False)] = None,
):
    """Serve the pair over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /metrics)."""
    from localspec.server.main import serve as run_server
    from localspec.server.config import ServerConfig
    from localspec.session import Session

    config = ServerConfig(parallel=parallel, kv_layout=kv_layout, prompt_cache_ram=prompt_cache_ram,  # bad values first
                          cors_origins=cors_origins or ()).check()
    sess = Session(flags(
        model=model, draft=draft, method=method, draft_tokens=draft_tokens, p_min=p_min, max_tokens=max_tokens,
        temperature=temperature, ctx_size=ctx_size, gpu_layers=gpu_layers, draft_gpu_layers=draft_gpu_layers, threads=threads,
        exactness=exactness, rpc=rpc, tensor_split=tensor_split, prompt_cache=False if no_prompt_cache else None,
    ))
    use_template(sess, chat_template)
    run_server(sess, host=host, port=port, api_key=api_key, queue_size=queue, allowed_hosts=allowed_hosts,
               cors_origins=cors_origins or (), max_k=max_k, strict_model=strict_model, no_metrics=no_metrics,
               config=config)
