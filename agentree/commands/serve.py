"""`agentree serve`: an OpenAI-compatible HTTP server over a policy engine.

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (no
streaming). Chat messages are rendered with the tokenizer's chat template; `temperature`
(0 = greedy), `top_p`, `top_k`, `max_tokens` / `max_completion_tokens`, `n`, `stop` (strings;
excluded from the text, as in the OpenAI API), `stop_token_ids`, `seed` and `logprobs` /
`top_logprobs` map onto `SamplingParams`; responses carry token `usage`. Log-probs are those
of the temperature-scaled sampling distribution (the engine contract). Options the engine
cannot honour (streaming, echo, penalties, logit bias) are rejected with a 400, not ignored.
A chat request with `tools` is rendered as a tool rollout is and its answer read back into
`tool_calls` (finish reason `tool_calls`) in the policy's call format (`agentree.tool_messages`).

Concurrent requests are gathered into one engine call when their sampling settings match
(requests with a `seed` run alone so their draws are repeatable), so many small judge calls
share a batched forward pass. The engine is only touched by that one worker thread.

Standard library only (`http.server.ThreadingHTTPServer`). The backend is chosen in
`build_serving_engine`: `auto` (the default) serves with vLLM (`VLLMEngine`, prefix caching,
continuous batching) when vLLM is installed and with the transformers engine (`HFEngine`)
otherwise; `--backend transformers|vllm` forces one.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agentree.chat import ChatFormat
from agentree.config import load_config
from agentree.engines.base import Completion, Engine, SamplingParams
from agentree.policy import build_serving_engine, resolve_policy
from agentree.tool_messages import (
    ToolRequestError,
    completion_message,
    render_request,
    request_tools,
)

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client as OpenAI-style JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass
class _Job:
    prompts: list[list[int]]
    params: SamplingParams
    future: Future


class Batcher:
    """Runs engine calls on one worker thread, merging concurrent requests with equal params."""

    def __init__(self, engine: Engine, max_batch: int = 64) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
        self._thread.start()
        self.calls = 0
        """Engine calls made (fewer than requests when requests were merged)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        fut: Future = Future()
        self._queue.put(_Job(prompts, params, fut))
        return fut.result()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs, stop = [job], False
            while len(jobs) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                jobs.append(nxt)
            groups: dict[Any, list[_Job]] = {}
            for j in jobs:
                key = j.params if j.params.seed is None else id(j)
                groups.setdefault(key, []).append(j)
            for group in groups.values():
                self._call(group)
            if stop:
                return

    def _call(self, group: list[_Job]) -> None:
        prompts = [p for j in group for p in j.prompts]
        try:
            self.calls += 1
            outs = self.engine.generate(prompts, group[0].params)
        except Exception as e:
            for j in group:
                j.future.set_exception(e)
            return
        k = 0
        for j in group:
            j.future.set_result(outs[k : k + len(j.prompts)])
            k += len(j.prompts)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class OpenAIServer:
    """The OpenAI API semantics over an engine and its tokenizer (transport-free)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_name: str,
        *,
        default_max_tokens: int = 256,
        max_batch: int = 64,
        aliases: Sequence[str] = (),
        tool_format: str = "hermes",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        """How the policy writes tool calls (`agentree.tools`), for requests with `tools`."""
        self._chat: ChatFormat | None = None
        self.model_name = model_name
        self.names = {model_name, *aliases}
        self.default_max_tokens = default_max_tokens
        self.batcher = Batcher(engine, max_batch)
        self.created = int(time.time())

    # -- endpoints -------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "agentree",
                    "max_model_len": self.engine.max_model_len,
                }
            ],
        }

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_common(body)
        if body.get("echo"):
            raise APIError(400, "echo is not supported", param="echo")
        prompts = self._prompt_ids(body.get("prompt"))
        logprobs = _int_option(body, "logprobs", 0, 20)
        params = self._sampling(body, prompts, default_max=16, top=logprobs or 0)
        outs = self.batcher.generate(prompts, params)
        choices = []
        for comps in outs:
            for c in comps:
                text, ids, finish, k = self._finish(c, params)
                choice: dict[str, Any] = {
                    "index": len(choices),
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish,
                }
                if logprobs is not None:
                    choice["logprobs"] = self._completion_logprobs(c, k)
                choice["_tokens"] = len(ids)
                choices.append(choice)
        return self._response("text_completion", "cmpl", choices, prompts)

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_common(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", param="messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        try:
            tools = request_tools(body)
            if tools:
                text = render_request(self.chat_format, messages, tools)
            else:
                text = self.tokenizer.apply_chat_template(
                    [_message(m) for m in messages], tokenize=False, add_generation_prompt=True
                )
        except ToolRequestError as e:
            raise APIError(400, str(e), param="tools") from None
        prompts = [list(self.tokenizer.encode(text, add_special_tokens=False))]
        want = bool(body.get("logprobs"))
        top = (_int_option(body, "top_logprobs", 0, 20) or 0) if want else 0
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        room = self.engine.max_model_len - len(prompts[0])
        default_max = max(1, min(self.default_max_tokens, room))
        params = self._sampling({**body, "max_tokens": max_tokens}, prompts, default_max, top)
        comps = self.batcher.generate(prompts, params)[0]
        choices = []
        for c in comps:
            text, ids, finish, k = self._finish(c, params)
            message, finish = completion_message(self.chat_format, text, tools, finish)
            choice: dict[str, Any] = {
                "index": len(choices),
                "message": message,
                "logprobs": {"content": self._chat_logprobs(c, k)} if want else None,
                "finish_reason": finish,
                "_tokens": len(ids),
            }
            choices.append(choice)
        return self._response("chat.completion", "chatcmpl", choices, prompts)

    @property
    def chat_format(self) -> ChatFormat:
        """The policy's chat format (tool rendering and call parsing), built on first use."""
        if self._chat is None:
            self._chat = ChatFormat(self.tokenizer, self.tool_format)
        return self._chat

    # -- request mapping -------------------------------------------------------------------------
    def _check_common(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        if body.get("stream"):
            raise APIError(400, "streaming is not supported; send stream=false", param="stream")
        for name in ("presence_penalty", "frequency_penalty"):
            if body.get(name):
                raise APIError(400, f"{name} is not supported", param=name)
        if body.get("logit_bias"):
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    def _prompt_ids(self, prompt: Any) -> list[list[int]]:
        """`prompt` as the API allows it: a string, strings, token ids, or lists of ids."""

        def encode(text: str) -> list[int]:
            return list(self.tokenizer.encode(text))

        if isinstance(prompt, str):
            out = [encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            out = [encode(p) for p in prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            out = [list(prompt)]
        elif (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt
            )
        ):
            out = [list(p) for p in prompt]
        else:
            raise APIError(
                400,
                "'prompt' must be a string, a list of strings, a list of token "
                "ids, or a list of such lists",
                param="prompt",
            )
        if any(not p for p in out):
            raise APIError(400, "prompt is empty", param="prompt")
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for p in out for t in p):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
        return out

    def _sampling(
        self, body: dict[str, Any], prompts: list[list[int]], default_max: int, top: int
    ) -> SamplingParams:
        def number(name: str, default: float, lo: float, hi: float) -> float:
            v = body.get(name)
            v = default if v is None else v
            if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
                raise APIError(400, f"{name} must be a number in [{lo}, {hi}]", param=name)
            return float(v)

        max_tokens = _int_option(body, "max_tokens", 1, 10**9) or default_max
        longest = max(len(p) for p in prompts)
        limit = self.engine.max_model_len
        if longest + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {longest + max_tokens} tokens ({longest} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the length of the prompt "
                "or the completion.",
                param="max_tokens",
            )
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
            raise APIError(400, "stop_token_ids must be a list of ints", param="stop_token_ids")
        top_k = _int_option(body, "top_k", -1, 10**9) or 0
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise APIError(400, "seed must be an integer", param="seed")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=number("temperature", 1.0, 0.0, 2.0),
            top_p=number("top_p", 1.0, 1e-9, 1.0),
            top_k=max(top_k, 0),
            stop_token_ids=tuple(sorted(set(stop_ids))),
            stop=tuple(_stop_strings(body.get("stop"))),  # the engine stops as soon as one shows
            n=_int_option(body, "n", 1, 128) or 1,
            logprobs=top,
            seed=seed,
        )

    # -- response building -----------------------------------------------------------------------
    def _finish(self, c: Completion, params: SamplingParams) -> tuple[str, list[int], str, int]:
        """(text, token ids kept, finish reason, tokens with log-probs) of one completion.

        A final stop/EOS token is dropped from the text (it is counted in usage); a stop
        string cuts the text before it (the engine stopped on the token that completed it).
        """
        ids = list(c.token_ids)
        finish = c.finish_reason
        stop_ids = set(params.stop_token_ids) | set(self.engine.eos_token_ids)
        body = ids[:-1] if finish == "stop" and ids and ids[-1] in stop_ids else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        cut = [text.find(s) for s in params.stop if s in text]
        if cut:
            pos = min(cut)
            k = next(
                (k for k in range(1, len(body) + 1) if len(self._decode(body[:k])) > pos),
                len(body),
            )
            return text[:pos], ids[:k], "stop", k
        return text, ids, finish, len(ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _completion_logprobs(self, c: Completion, k: int) -> dict[str, Any]:
        tokens = [self._decode([t]) for t in c.token_ids[:k]]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        tops = c.top_logprobs or [{}] * k
        return {
            "tokens": tokens,
            "token_logprobs": list(c.logprobs[:k]),
            "top_logprobs": [{self._decode([i]): lp for i, lp in d.items()} for d in tops[:k]],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, c: Completion, k: int) -> list[dict[str, Any]]:
        tops = c.top_logprobs or [{}] * k
        out = []
        for t, lp, top in zip(c.token_ids[:k], c.logprobs[:k], tops[:k], strict=True):
            s = self._decode([t])
            out.append(
                {
                    "token": s,
                    "logprob": lp,
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {
                            "token": self._decode([i]),
                            "logprob": v,
                            "bytes": list(self._decode([i]).encode()),
                        }
                        for i, v in top.items()
                    ],
                }
            )
        return out

    def _response(
        self, obj: str, prefix: str, choices: list[dict[str, Any]], prompts: list[list[int]]
    ) -> dict[str, Any]:
        completion = sum(c.pop("_tokens") for c in choices)
        prompt = sum(len(p) for p in prompts)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }

    def close(self) -> None:
        self.batcher.close()


def _int_option(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise APIError(400, f"{name} must be an integer in [{lo}, {hi}]", param=name)
    return v


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise APIError(400, "stop must be a string or a list of strings", param="stop")


def _message(m: Any) -> dict[str, str]:
    """A chat message with plain-text content (text parts of a content list are joined)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(400, "each message needs a 'role' and 'content'", param="messages")
    content = m.get("content")
    if isinstance(content, list):
        parts = [
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        ]
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise APIError(400, "message content must be text", param="messages")
    return {"role": m["role"], "content": content}


# -- HTTP transport ------------------------------------------------------------------------------
def _handler(api: OpenAIServer, idle_timeout: float) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "/v1/completions": api.completions,
        "/v1/chat/completions": api.chat,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the judge's client reuses connections
        timeout = idle_timeout  # an idle kept-alive connection is closed after this long
        server_version = "agentree-serve"

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, api.models())
            elif self.path.rstrip("/") in ("/health", "/v1/health"):
                self._send(200, {"status": "ok"})
            else:
                self._send(404, APIError(404, f"no route {self.path}", "NotFoundError").body())

        def do_POST(self) -> None:
            route = routes.get(self.path.rstrip("/")) or routes.get("/v1" + self.path.rstrip("/"))
            try:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                if route is None:
                    raise APIError(404, f"no route {self.path}", "NotFoundError")
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    raise APIError(400, "request body is not valid JSON") from None
                if not isinstance(body, dict):
                    raise APIError(400, "request body must be a JSON object")
                self._send(200, route(body))
            except APIError as e:
                self._send(e.status, e.body())
            except Exception as e:  # the server stays up; the client learns what happened
                log.exception("request to %s failed", self.path)
                self._send(500, APIError(500, f"{type(e).__name__}: {e}", "server_error").body())

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True  # server_close() joins every connection thread


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
    ) -> None:
        """`close_engine`: `close()` also closes the engine (when the handle built it)."""
        self.api = api
        self.close_engine = close_engine
        self.httpd = _Server((host, port), _handler(api, idle_timeout))
        self.host, self.port = self.httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}/v1"
        self._thread: threading.Thread | None = None

    def start(self) -> ServerHandle:
        self._thread = threading.Thread(
            target=self.httpd.serve_forever,
            name="serve-http",
            kwargs={"poll_interval": 0.1},
            daemon=True,
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()
        self.api.close()
        if self.close_engine:
            self.close_engine = False
            self.api.engine.close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- assembly --------------------------------------------------------------------------------------
def resolve_policy_path(
    policy: str,
    *,
    env: str | None = None,
    config: str | None = None,
    log_fn: Callable[[str], None] = print,
) -> str:
    """`tiny` builds (or reuses) the env's tiny policy as `agentree train` does; else as given."""
    if policy != "tiny":
        return policy
    cfg = load_config(config, select={"policy": "tiny", "env": env})
    return resolve_policy(cfg, log_fn)


def start_server(
    policy: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    backend: str = "auto",
    served_model_name: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    seed: int = 0,
    default_max_tokens: int = 256,
    max_batch: int = 64,
    env: str | None = None,
    config: str | None = None,
    idle_timeout: float = 5.0,
    vllm_kwargs: dict[str, Any] | None = None,
    log_fn: Callable[[str], None] = print,
) -> ServerHandle:
    """Load the policy and serve it from a background thread; `close()` the handle when done."""
    path = resolve_policy_path(policy, env=env, config=config, log_fn=log_fn)
    engine, tokenizer = build_serving_engine(
        path, backend, dtype=dtype, device=device, seed=seed, vllm_kwargs=vllm_kwargs
    )
    name = served_model_name or policy
    api: OpenAIServer | None = None
    try:
        api = OpenAIServer(
            engine,
            tokenizer,
            name,
            default_max_tokens=default_max_tokens,
            max_batch=max_batch,
            aliases=[policy, path],
        )
        handle = ServerHandle(api, host, port, idle_timeout, close_engine=True)
    except BaseException:
        if api is not None:
            api.close()
        engine.close()  # a vLLM engine holds child processes; never leave them behind
        raise
    return handle.start()


def serve(policy: str, host: str = "127.0.0.1", port: int = 8000, **kwargs: Any) -> None:
    """Serve until interrupted (Ctrl-C)."""
    handle = start_server(policy, host, port, **kwargs)
    print(
        f"agentree serve: {handle.api.model_name} on {handle.url} "
        f"({type(handle.api.engine).__name__})",
        flush=True,
    )
    try:
        while handle._thread is not None and handle._thread.is_alive():
            handle._thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        handle.close()


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
    p.add_argument("--policy", default="tiny", help="tiny (built locally), a checkpoint, a hub id")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "transformers", "vllm"],
        help="auto: vLLM when installed, else transformers",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM backend: share of device memory (host memory on CPU) it may use",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM backend: context cap")
    p.add_argument("--served-model-name", default=None, help="model id clients send")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="completion budget of chat requests that give none",
    )
    p.add_argument("--env", default=None, help="env whose tiny policy --policy tiny builds")
    p.add_argument("--config", default=None, help="config whose tiny policy settings to use")


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
        env=args.env,
        config=args.config,
        vllm_kwargs=_vllm_options(args),
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
    except (ValueError, OSError) as e:  # a bad policy path, a port in use: one clear line
        print(f"agentree serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
