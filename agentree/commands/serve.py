"""`agentree serve`: an OpenAI-compatible HTTP server over a policy engine.

Endpoints: `GET /v1/models`, `GET /health`, `POST /v1/completions`, `POST /v1/chat/completions`
(`stream: true` answers OpenAI's events once the completion is done). Chat messages are
rendered with the tokenizer's chat template; `temperature` (0 = greedy), `top_p`, `top_k`,
`max_tokens` / `max_completion_tokens`, `n`, `stop` (strings; excluded from the text, as in the
OpenAI API), `stop_token_ids`, `seed` and `logprobs` / `top_logprobs` map onto
`SamplingParams`; responses carry token `usage`. Log-probs are those of the temperature-scaled
sampling distribution (the engine contract). Options the engine cannot honour (echo,
penalties, logit bias) are rejected with a 400, not ignored.
A chat request with `tools` is rendered as a tool rollout is and its answer read back into
`tool_calls` (finish reason `tool_calls`) in the policy's call format (`agentree.tool_messages`).

Transport: FastAPI on uvicorn (the `serve` extra; the routes are `serve_http`, the request
models, batcher and response builders the transport-free `serve_api`). Requests are pydantic
models: a body that is not a JSON object is a 400, a field of the wrong type or range (a role
other than system, user, assistant, tool or developer) a 422, a body over `max_body_bytes` a
413, a GET on a POST route a 405; every error is OpenAI-style JSON. Handlers are coroutines
waiting on the batcher, so concurrent requests cost no thread each and all join the engine's
queue.

Concurrent requests are gathered into one engine call when their sampling settings match
(requests with a `seed` run alone so their draws are repeatable), so many small judge calls
share a batched forward pass. The engine is only touched by that one worker thread.

The policy is resolved as `agentree train` and `eval` resolve it (`agentree.policy.
resolve_policy`: `tiny`, `tiny-warm`, `warm`, a checkpoint, a hub id). The engine is built by
`agentree.policy.build_engine` from the config's `engine` section (its prefix cache and batch
size too; `--config` and `--set` as for train), with no trainable copy: `auto` (the default
unless the config names a backend) serves with vLLM (`VLLMEngine`, prefix caching, continuous
batching) when vLLM is installed and with the transformers engine (`HFEngine`) otherwise;
`--backend transformers|vllm` forces one. SIGTERM and Ctrl-C stop the server
gracefully: requests in flight are answered, then the engine is closed (a vLLM engine's child
processes with it).
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentree.commands.serve_api import MAX_BODY_BYTES, APIError, Batcher, OpenAIServer
from agentree.config import ExperimentConfig, load_config
from agentree.policy import build_engine, resolve_policy
from agentree.signals import interrupt_on_sigterm
from agentree.tools import CALL_FORMATS

__all__ = [
    "APIError",
    "Batcher",
    "OpenAIServer",
    "ServerHandle",
    "serve",
    "serve_config",
    "start_server",
]


# -- HTTP server ---------------------------------------------------------------------------------
class ServerHandle:
    """A running server: `url` (ending in /v1), `port`, `close()` (stops and joins all threads)."""

    def __init__(
        self,
        api: OpenAIServer,
        host: str,
        port: int,
        idle_timeout: float = 5.0,
        *,
        close_engine: bool = False,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        """`close_engine`: `close()` also closes the engine (when the handle built it);
        `idle_timeout`: seconds a kept-alive connection may sit idle."""
        # deferred: uvicorn and fastapi are the optional `serve` extra; the CLI imports this
        # module at start, and `agentree --help` must not need them
        import uvicorn

        from agentree.commands.serve_http import build_app

        self.api = api
        self.close_engine = close_engine
        self.max_body_bytes = max_body_bytes
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # bound here so that port 0 is known at once; the OS queue holds bursts of connections
        self._sock = socket.create_server((host, port), family=family, backlog=2048)
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}/v1"
        config = uvicorn.Config(
            build_app(api, max_body_bytes),
            log_config=None,  # leave the process's logging alone
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=max(1, round(idle_timeout)),
            timeout_graceful_shutdown=60,
        )
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self) -> ServerHandle:
        """Serve from a background thread; returns once the server accepts requests."""
        self._thread = threading.Thread(
            target=self.server.run, name="serve-http", kwargs={"sockets": [self._sock]}
        )
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                self.close()
                raise RuntimeError("agentree serve: the HTTP server failed to start")
            time.sleep(0.01)
        return self

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Answer the requests in flight, stop serving, then close the batcher (and engine)."""
        if self._thread is not None:
            self.server.should_exit = True
            self._thread.join()
            self._thread = None
        self._sock.close()
        self.api.close()
        if self.close_engine:
            self.close_engine = False
            self.api.engine.close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def require_serve_extra() -> None:
    """Raise one clear ImportError unless FastAPI and uvicorn (the `serve` extra) import."""
    try:
        # deferred: the optional `serve` extra, needed only once a server starts
        import fastapi  # noqa: F401

        # deferred: the optional `serve` extra too
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"agentree serve needs FastAPI and uvicorn ({e.name} is missing): pip install "
            "'agentree[serve]'"
        ) from None


# -- assembly --------------------------------------------------------------------------------------
def serve_config(
    policy: str | None,
    *,
    env: str | None = None,
    config: str | None = None,
    overrides: Sequence[str] = (),
    backend: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    seed: int | None = None,
    tool_format: str | None = None,
    vllm_kwargs: dict[str, Any] | None = None,
) -> ExperimentConfig:
    """The config a server runs: `config` (or `env`'s default) with `policy` selected and the
    `--set` `overrides` applied as `agentree train` applies them; then each option that is
    given replaces the config's. Without `policy` the policy is `config`'s, or `tiny` when no
    config is named; the backend is `auto` unless the config names one."""
    if policy is None and config is None:
        policy = "tiny"  # quick to build, where the default config's warm start takes minutes
    cfg = load_config(config, select={"policy": policy, "env": env}, overrides=list(overrides))
    if backend is None:
        backend = cfg.engine.backend if "backend" in cfg.engine.model_fields_set else "auto"
    given = {"dtype": dtype, "device": device, "tool_format": tool_format}
    return cfg.model_validate(
        {
            **cfg.model_dump(),
            "seed": cfg.seed if seed is None else seed,
            "policy": {
                **cfg.policy.model_dump(),
                **{k: v for k, v in given.items() if v is not None},
            },
            "engine": {
                **cfg.engine.model_dump(),
                "backend": backend,
                "vllm": {**cfg.engine.vllm, **(vllm_kwargs or {})},
            },
        }
    )


def start_server(
    policy: str | None,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    served_model_name: str | None = None,
    default_max_tokens: int | None = None,
    max_batch: int = 64,
    max_call: int = 1024,
    idle_timeout: float = 5.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    log_fn: Callable[[str], None] = print,
    **settings: Any,
) -> ServerHandle:
    """Load the policy and serve it from a background thread; `close()` the handle when done.

    `settings` (`env`, `config`, `overrides`, `backend`, `dtype`, `device`, `seed`,
    `tool_format`, `vllm_kwargs`) choose the config as `serve_config` says: `policy` is
    resolved as `agentree train` resolves `--policy` (`env` and `config` choose the env a
    `tiny`/`tiny-warm` policy is built for), the engine is built from the config's `engine`
    section, and requests with tools are rendered and read back in the config's
    `policy.tool_format`, the format the policy was trained to write its calls in. A chat
    request that sets no `max_tokens` gets `default_max_tokens`, or the config's
    `engine.max_tokens` (the per-turn budget the policy was trained with). An engine call runs
    at most `max_batch` requests at once and takes in at most `max_call` (`Batcher`)."""
    require_serve_extra()  # before a model is loaded
    cfg = serve_config(policy, **settings)
    path = resolve_policy(cfg, log_fn)
    engine, _model, tokenizer = build_engine(cfg, path, trainable=False)
    api: OpenAIServer | None = None
    try:
        api = OpenAIServer(
            engine,
            tokenizer,
            served_model_name or cfg.policy.path,
            default_max_tokens=(
                cfg.engine.max_tokens if default_max_tokens is None else default_max_tokens
            ),
            max_batch=max_batch,
            max_call=max_call,
            aliases=[cfg.policy.path, path],
            tool_format=cfg.policy.tool_format,
        )
        handle = ServerHandle(
            api, host, port, idle_timeout, close_engine=True, max_body_bytes=max_body_bytes
        )
    except BaseException:
        if api is not None:
            api.close()
        engine.close()  # a vLLM engine holds child processes; never leave them behind
        raise
    return handle.start()


def serve(policy: str | None, host: str = "127.0.0.1", port: int = 8000, **kwargs: Any) -> None:
    """Serve until Ctrl-C or SIGTERM, then answer what is in flight and close the engine."""
    with interrupt_on_sigterm():  # `kill` (and schedulers) stop it as Ctrl-C does
        handle = start_server(policy, host, port, **kwargs)
        print(
            f"agentree serve: {handle.api.model_name} on {handle.url} "
            f"({type(handle.api.engine).__name__})",
            flush=True,
        )
        try:
            while handle.running():
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            handle.close()
    print("agentree serve: stopped; engine closed", flush=True)


# -- command line --------------------------------------------------------------------------------
def add_serve_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on an argparse subparsers object; it sets `func` to run the command."""
    p = subparsers.add_parser(
        "serve",
        help="serve a policy over an OpenAI-compatible HTTP API",
        description=__doc__.split("\n\n")[0],
    )
    _add_arguments(p)
    p.set_defaults(func=run_serve_command)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy",
        default=None,
        help="tiny, tiny-warm, smollm2-135m, a checkpoint directory, a .gguf file or a hub id "
        "(default: the --config's policy, else tiny)",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument(
        "--backend",
        default=None,
        choices=["auto", "transformers", "vllm"],
        help="auto (the default, unless the config names one): vLLM when installed, else "
        "transformers",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM backend: share of device memory (host memory on CPU) it may use",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM backend: context cap")
    p.add_argument("--served-model-name", default=None, help="model id clients send")
    p.add_argument("--dtype", default=None, help="model dtype (default: the config's, auto)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: the config's, auto)")
    p.add_argument("--seed", type=int, default=None, help="engine seed (default: the config's)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="completion budget of chat requests that give none (default: the config's "
        "engine.max_tokens, 256)",
    )
    p.add_argument("--env", default=None, help="env whose tiny policy --policy tiny builds")
    p.add_argument("--config", default=None, help="config whose policy and engine settings to use")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, as for train (e.g. engine.max_batch_size=32)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=64,
        help="most requests one engine call runs at once (default 64)",
    )
    p.add_argument(
        "--max-call",
        type=int,
        default=1024,
        help="most requests one engine call takes in over its life, joiners included; the "
        "next call starts with those that wait (default 1024)",
    )
    p.add_argument(
        "--tool-format",
        default=None,
        choices=CALL_FORMATS.names(),
        help="how the policy writes tool calls, for requests with tools (default: the "
        "config's policy.tool_format; text and hermes both read Hermes calls)",
    )


def run_serve_command(args: argparse.Namespace) -> int:
    """Serve until interrupted; errors propagate to the caller (the `agentree` CLI reports them)."""
    serve(
        args.policy,
        args.host,
        args.port,
        backend=args.backend,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        default_max_tokens=args.max_tokens,
        max_batch=args.max_batch,
        max_call=args.max_call,
        env=args.env,
        config=args.config,
        overrides=args.set,
        vllm_kwargs=_vllm_options(args),
        tool_format=args.tool_format,
    )
    return 0


def _vllm_options(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM-only flags that were given, as `vllm.LLM` keyword arguments."""
    out: dict[str, Any] = {}
    if getattr(args, "gpu_memory_utilization", None) is not None:
        out["gpu_memory_utilization"] = args.gpu_memory_utilization
    if getattr(args, "max_model_len", None) is not None:
        out["max_model_len"] = args.max_model_len
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m agentree.commands.serve`: the same command without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="agentree serve", description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    try:
        return run_serve_command(parser.parse_args(argv))
    except (ValueError, OSError, ImportError) as e:  # a bad policy, a port in use: one line
        print(f"agentree serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
