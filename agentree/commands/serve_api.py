"""The OpenAI API over a policy engine, free of any transport: pydantic request models, the
`Batcher` that merges concurrent requests into engine calls, and `OpenAIServer`, which maps a
request onto `SamplingParams` and builds the OpenAI response. `agentree serve` puts it on HTTP
(`agentree.commands.serve_http`, run by `agentree.commands.serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentree.chat import ChatFormat
from agentree.engines.base import Completion, Engine, SampledToken, SamplingParams, TokenSink
from agentree.tool_messages import (
    ToolRequestError,
    completion_message,
    render_request,
    request_tools,
)
from agentree.tools import held_back

log = logging.getLogger("agentree.commands.serve")

Respond = Callable[[list[list[Completion]]], dict[str, Any]]
"""How a request's completions become its response."""

LogProbs = Callable[[Completion, int, int], Any]
"""The log-probs of tokens `[a, b)` of a completion, in the form its choice carries them."""

MAX_BODY_BYTES = 8 << 20
"""Largest request body accepted (8 MiB holds a 100k-token prompt sent as token ids)."""


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


# -- requests ------------------------------------------------------------------------------------
# Strict: a bool is not an int, "1" is not a number (an int is still a float). Unknown fields
# are ignored, as OpenAI clients send some (user, metadata) that change nothing here.
_STRICT = ConfigDict(strict=True, extra="ignore")
_TopLogprobs = Annotated[int, Field(ge=0, le=20)]


class ContentPart(BaseModel):
    """One part of a message's content list; only text parts carry content here."""

    model_config = _STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A chat message; its content is text, text parts (joined), or absent (empty)."""

    model_config = _STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant turn's calls (OpenAI `tool_calls`), written back in the policy's format."""
    tool_call_id: str | None = None
    """Which call a `tool` message answers."""

    def as_dict(self) -> dict[str, Any]:
        """The message as `agentree.tool_messages` reads it (content joined to text)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    """`stream_options` of a streamed request."""

    model_config = _STRICT
    include_usage: bool | None = None
    """End the stream with a chunk holding the usage and no choices."""


class SamplingRequest(BaseModel):
    """The fields both endpoints share: model, sampling settings, unsupported options."""

    model_config = _STRICT
    model: str | None = None
    stream: bool | None = None
    """Answer as server-sent events (`OpenAIServer.stream`): the text as it is generated,
    token by token."""
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    """-1 or 0 disables top-k (vLLM's and the engine's conventions)."""
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`: `prompt` is a string, strings, token ids, or lists of ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: _TopLogprobs | None = None


class ChatRequest(SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Any] | None = None
    """OpenAI function tools: the policy's answer is read back into `tool_calls`."""
    tool_choice: str | dict[str, Any] | None = None
    """`none` declares no tools; other values are accepted and change nothing."""
    logprobs: bool | None = None
    top_logprobs: _TopLogprobs | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


@dataclass
class _Plan:
    """A request's engine call and how its completions become the response."""

    prompts: list[list[int]]
    params: SamplingParams
    respond: Respond
    chat: bool
    settled: Callable[[str], str] | None = None
    """With tools, how much of a reply's text is settled content (`CallFormat.settled`)."""
    logprobs: LogProbs | None = None
    """When the request asks for log-probs."""


@dataclass
class _Job:
    prompts: list[list[int]]
    params: SamplingParams
    future: Future
    on_token: TokenSink | None = None

    @property
    def completions(self) -> int:
        return len(self.prompts) * self.params.n


class Batcher:
    """Runs engine calls on one worker thread, merging the requests that wait into one call:
    each keeps its own params (`Engine.generate` takes one per prompt), and a request with a
    `seed` runs alone, since a call draws from one seed. Requests that arrive while a call
    runs join it between its steps (`Engine.generate`'s `admit`, continuous batching) on an
    engine that decodes step by step, in order, until one cannot (it has a seed or does not
    fit): that one, and every later one, waits for the call to end. A call takes in at most
    `max_call` requests, its own and those that join: it keeps each one's prompt and
    completions until it returns, so under steady load it then admits no more and ends when
    its rows do, and the waiting requests start the next."""

    def __init__(self, engine: Engine, max_batch: int = 64, max_call: int = 1024) -> None:
        if max_batch < 1 or max_call < 1:
            raise ValueError(
                f"a call takes at least one request: max_batch={max_batch}, max_call={max_call}"
            )
        self.engine = engine
        self.max_batch = max_batch
        self.max_call = max_call
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._held: deque[_Job | None] = deque()  # taken but not admitted: served before the queue
        self._gone: set[Future] = set()  # running requests abandoned, until answered
        self._lock = threading.RLock()  # a request is answered, or abandoned, not both
        self._thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
        self._thread.start()
        self.calls = 0
        """Engine calls made (fewer than requests when requests were merged)."""
        self.admitted = 0
        """Requests that joined a running call."""
        self.abandoned = 0
        """Requests given up by their clients before they were answered (`abandon`)."""

    def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_token: TokenSink | None = None,
    ) -> Future:
        """Queue a request; the future holds one list of completions per prompt, and
        `on_token` (called on the engine's thread) hears this request's tokens as
        `Engine.generate` tells them."""
        fut: Future = Future()
        self._queue.put(_Job(prompts, params, fut, on_token))
        return fut

    def abandon(self, future: Future) -> None:
        """Nobody waits for the request of `future` any more (its client hung up): a queued
        request never reaches the engine, and a running one ends at its next token on an
        engine that samples step by step (`TokenSink`) while the rest of its call goes on."""
        with self._lock:
            if future.done() and not future.cancelled():
                return  # answered
            self.abandoned += 1
            if future.cancel():
                log.info("a client hung up: its request leaves the queue")
            else:  # running: the engine hears it through the token hook
                self._gone.add(future)
                log.info("a client hung up: its request stops at its next token")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        return self.submit(prompts, params).result()

    def _next(self, wait: bool) -> _Job | None:
        """The next request, the held ones first; `queue.Empty` when none waits (`wait`
        false). None: the batcher is closing."""
        if self._held:
            return self._held.popleft()
        return self._queue.get() if wait else self._queue.get_nowait()

    def _run(self) -> None:
        while True:
            job = self._next(wait=True)
            if job is None:
                return
            jobs, stop = [job], False
            while len(jobs) < self.max_batch:
                try:
                    nxt = self._next(wait=False)
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                jobs.append(nxt)
            groups: dict[Any, list[_Job]] = {}
            for j in jobs:
                if not j.future.set_running_or_notify_cancel():
                    continue  # abandoned while queued
                groups.setdefault(None if j.params.seed is None else id(j), []).append(j)
            for group in groups.values():
                self._call(group)
            if stop:
                return

    def _admit(self, free: int, room: int) -> list[_Job]:
        """The waiting requests that join the running call: in order, while they have no seed,
        their completions fit in `free` and at most `room` requests join. The first that
        cannot join is held for the next call, and no later one overtakes it."""
        jobs: list[_Job] = []
        while not self._held and len(jobs) < room:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None or job.params.seed is not None or job.completions > free:
                self._held.append(job)
                break
            if job.future.set_running_or_notify_cancel():  # else abandoned while queued
                jobs.append(job)
                free -= job.completions
        return jobs

    def _call(self, group: list[_Job]) -> None:
        """One engine call for `group`; each request is answered as soon as its own
        completions have ended, the rest of the call decoding on."""
        prompts = [p for j in group for p in j.prompts]
        each = [j.params for j in group for _ in j.prompts]
        params = each[0] if len(set(each)) == 1 else each
        # completion index of the merged call -> (its job, its index in that job)
        owners: list[tuple[_Job, int]] = []
        ended: dict[int, dict[int, Completion]] = {}
        answered = 0  # requests of the call answered as their last completion ended

        def add(jobs: list[_Job]) -> None:
            for j in jobs:
                owners.extend((j, i) for i in range(j.completions))
                ended[id(j)] = {}

        add(group)

        def heard(index: int, token: SampledToken) -> bool:
            job, i = owners[index]
            if job.on_token is not None:
                job.on_token(i, token)
            return job.future in self._gone

        def done(index: int, completion: Completion) -> None:
            nonlocal answered
            job, i = owners[index]
            got = ended[id(job)]
            got[i] = completion
            n = job.params.n
            if len(got) == job.completions:  # the request's last completion
                answer = [[got[p * n + k] for k in range(n)] for p in range(len(job.prompts))]
                self._answer(job, answer)
                answered += 1

        def admit(free: int) -> tuple[list[list[int]], list[SamplingParams]] | None:
            running = len(group) - answered
            jobs = self._admit(free, min(self.max_batch - running, self.max_call - len(group)))
            if not jobs:
                return None
            group.extend(jobs)  # their completions are numbered, and returned, after these
            add(jobs)
            self.admitted += len(jobs)
            return [p for j in jobs for p in j.prompts], [j.params for j in jobs for _ in j.prompts]

        seeded = group[0].params.seed is not None  # its draws are its own: nothing joins it
        answer: list[list[Completion]] | Exception
        try:
            self.calls += 1
            answer = self.engine.generate(
                prompts, params, on_token=heard, on_done=done, admit=None if seeded else admit
            )
        except Exception as e:
            answer = e
        k = 0
        for j in group:  # the requests not answered yet: an error, or an engine that did not
            # tell each completion's end
            mine = answer if isinstance(answer, Exception) else answer[k : k + len(j.prompts)]
            self._answer(j, mine)
            k += len(j.prompts)

    def _answer(self, job: _Job, answer: list[list[Completion]] | Exception) -> None:
        with self._lock:
            self._gone.discard(job.future)
            if job.future.done():
                return  # answered already
            if isinstance(answer, Exception):
                job.future.set_exception(answer)
            else:
                job.future.set_result(answer)

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
        max_call: int = 1024,
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
        self.batcher = Batcher(engine, max_batch, max_call)
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

    async def completions(self, req: CompletionRequest) -> dict[str, Any]:
        plan = self._completion_plan(req)
        return plan.respond(await self._generate(plan.prompts, plan.params))

    async def chat(self, req: ChatRequest) -> dict[str, Any]:
        plan = self._chat_plan(req)
        return plan.respond(await self._generate(plan.prompts, plan.params))

    async def _generate(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """The request's completions; cancelled (its client hung up), the request is
        abandoned and stops taking the engine's time (`Batcher.abandon`)."""
        future = self.batcher.submit(prompts, params)
        try:
            return await asyncio.wrap_future(future)
        finally:
            self.batcher.abandon(future)  # a no-op once answered

    def stream(self, req: CompletionRequest | ChatRequest) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a `stream: true` request, as OpenAI sends them: for chat the
        assistant role of every choice first, then each choice's text as it is generated (what
        no later token can change: a stop string or a tool call that may be starting, and an
        unfinished character, wait for the next token) with the log-probs of the tokens that
        text completes, and when the completion is done the rest of each choice
        (`stream_chunks`: the remaining text and log-probs, its tool calls, its finish reason),
        and the usage if asked. The deltas join to the response `completions` or `chat` gives.
        The request is checked before the first chunk: an invalid one raises `APIError` here;
        an engine failure later ends the stream with an error chunk. Closing the iterator
        before its end (the client hung up) abandons the request (`Batcher.abandon`)."""
        plan = self._chat_plan(req) if isinstance(req, ChatRequest) else self._completion_plan(req)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return self._stream(plan, include_usage)

    # -- request plans: the engine call and how its completions become the response -------------
    def _completion_plan(self, req: CompletionRequest) -> _Plan:
        self._check_common(req)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompts = self._prompt_ids(req.prompt)
        params = self._sampling(req, prompts, req.max_tokens or 16, top=req.logprobs or 0)
        logprobs = self._completion_logprobs if req.logprobs is not None else None

        def respond(outs: list[list[Completion]]) -> dict[str, Any]:
            choices = []
            for comps in outs:
                for c in comps:
                    text, ids, finish, k = self._finish(c, params)
                    choice: dict[str, Any] = {
                        "index": len(choices),
                        "text": text,
                        "logprobs": logprobs(c, 0, k) if logprobs else None,
                        "finish_reason": finish,
                        "_tokens": len(ids),
                    }
                    choices.append(choice)
            return self._response("text_completion", "cmpl", choices, prompts)

        return _Plan(prompts, params, respond, chat=False, logprobs=logprobs)

    def _chat_plan(self, req: ChatRequest) -> _Plan:
        self._check_common(req)
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        messages = [m.as_dict() for m in req.messages]
        try:
            tools = request_tools({"tools": req.tools, "tool_choice": req.tool_choice})
            if tools:
                text = render_request(self.chat_format, messages, tools)
            else:
                plain = [{"role": m["role"], "content": m["content"]} for m in messages]
                text = self.tokenizer.apply_chat_template(
                    plain, tokenize=False, add_generation_prompt=True
                )
        except ToolRequestError as e:
            raise APIError(400, str(e), param="tools") from None
        prompts = [list(self.tokenizer.encode(text, add_special_tokens=False))]
        top = (req.top_logprobs or 0) if req.logprobs else 0
        room = self.engine.max_model_len - len(prompts[0])
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = self._sampling(
            req, prompts, max_tokens or max(1, min(self.default_max_tokens, room)), top
        )
        logprobs = self._chat_logprobs if req.logprobs else None

        def respond(outs: list[list[Completion]]) -> dict[str, Any]:
            choices = []
            for c in outs[0]:
                text, ids, finish, k = self._finish(c, params)
                message, finish = completion_message(self.chat_format, text, tools, finish)
                choice: dict[str, Any] = {
                    "index": len(choices),
                    "message": message,
                    "logprobs": logprobs(c, 0, k) if logprobs else None,
                    "finish_reason": finish,
                    "_tokens": len(ids),
                }
                choices.append(choice)
            return self._response("chat.completion", "chatcmpl", choices, prompts)

        settled = self.chat_format.tool_format.settled if tools else None
        return _Plan(prompts, params, respond, chat=True, settled=settled, logprobs=logprobs)

    async def _stream(self, plan: _Plan, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        heard: asyncio.Queue[tuple[int, SampledToken] | None] = asyncio.Queue()

        def tell(item: tuple[int, SampledToken] | None) -> None:  # on the engine's thread
            # a closed loop (the server stopping) has nobody listening
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(heard.put_nowait, item)

        chat, params = plan.chat, plan.params
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = _chunk_head(ident, chat, int(time.time()), self.model_name)
        usage = {"usage": None} if include_usage else {}
        count = len(plan.prompts) * params.n
        # each choice's tokens so far, its text sent, and how many tokens that text completes
        tops = params.logprobs > 0
        so_far = [Completion([], [], "length", [] if tops else None) for _ in range(count)]
        sent, given = [""] * count, [0] * count
        future = self.batcher.submit(plan.prompts, params, lambda i, t: tell((i, t)))
        # the end comes after every token: the engine's thread queues them in order
        future.add_done_callback(lambda _f: tell(None))
        try:  # until the last chunk, or until the client hangs up and the chunks are closed
            if chat:
                for i in range(count):
                    yield _chunk(head, usage, i, delta={"role": "assistant", "content": ""})
            while (item := await heard.get()) is not None:
                i, token = item
                c = so_far[i]
                c.token_ids.append(token.id)
                c.logprobs.append(token.logprob)
                if c.top_logprobs is not None:
                    c.top_logprobs.append(token.top or {})
                text = self._streamable(c.token_ids, params)
                if plan.settled is not None:
                    text = plan.settled(text)
                if len(text) > len(sent[i]) and text.startswith(sent[i]):
                    new, sent[i] = text[len(sent[i]) :], text
                    done = self._completed(c.token_ids, given[i], len(text))
                    lps = plan.logprobs(c, given[i], done) if plan.logprobs else None
                    given[i] = done
                    part = {"delta": {"content": new}} if chat else {"text": new}
                    yield _chunk(head, usage, i, logprobs=lps, **part)
            try:
                response = plan.respond(future.result())
            except Exception as e:
                log.error("streamed request failed", exc_info=e)
                yield APIError(500, f"{type(e).__name__}: {e}", "server_error").body()
                return
            response.update(id=head["id"], created=head["created"])
            for chunk in stream_chunks(response, sent, given, include_usage):
                yield chunk
        finally:
            self.batcher.abandon(future)  # a no-op once answered

    @property
    def chat_format(self) -> ChatFormat:
        """The policy's chat format (tool rendering and call parsing), built on first use."""
        if self._chat is None:
            self._chat = ChatFormat(self.tokenizer, self.tool_format)
        return self._chat

    # -- request mapping -------------------------------------------------------------------------
    def _check_common(self, req: SamplingRequest) -> None:
        """What a well-typed request may still ask that this server cannot do."""
        if req.model is not None and req.model not in self.names:
            raise APIError(
                404, f"The model `{req.model}` does not exist.", "NotFoundError", "model"
            )
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream=true", param="stream_options")
        for name in ("presence_penalty", "frequency_penalty", "logit_bias"):
            if getattr(req, name):
                raise APIError(400, f"{name} is not supported", param=name)

    def _prompt_ids(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            out = [list(self.tokenizer.encode(prompt))]
        elif prompt and all(isinstance(p, str) for p in prompt):
            out = [list(self.tokenizer.encode(p)) for p in prompt]  # type: ignore[arg-type]
        elif prompt and all(isinstance(p, int) for p in prompt):
            out = [list(prompt)]  # type: ignore[arg-type]
        else:
            out = [list(p) for p in prompt]  # type: ignore[arg-type]
        if not out or any(not p for p in out):
            raise APIError(400, "prompt is empty", param="prompt")
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for p in out for t in p):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
        return out

    def _sampling(
        self, req: SamplingRequest, prompts: list[list[int]], max_tokens: int, top: int
    ) -> SamplingParams:
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
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(req.top_k or 0, 0),
            stop_token_ids=tuple(sorted(set(req.stop_token_ids or []))),
            stop=tuple(stop),  # the engine stops as soon as one shows
            n=req.n or 1,
            logprobs=top,
            seed=req.seed,
        )

    # -- response building -----------------------------------------------------------------------
    def _finish(self, c: Completion, params: SamplingParams) -> tuple[str, list[int], str, int]:
        """(text, token ids kept, finish reason, tokens with log-probs) of one completion
        (`_text`: without its stop token, cut before a stop string)."""
        ids = list(c.token_ids)
        body, text, pos = self._text(ids, params)
        if pos is not None:
            # the tokens whose text ends before the stop string, and the one it starts in
            k = min(self._completed(body, 0, pos) + 1, len(body))
            return text[:pos], ids[:k], "stop", k
        return text, ids, c.finish_reason, len(ids)

    def _streamable(self, ids: list[int], params: SamplingParams) -> str:
        """The text of the tokens so far that `_finish` keeps whatever comes next: its text,
        without an end that may be the start of a stop string or an unfinished character
        (decoded as U+FFFD until its last byte comes)."""
        _body, text, pos = self._text(ids, params)
        if pos is not None:
            return text[:pos]
        text = text.rstrip("\ufffd")
        return text[: len(text) - held_back(text, params.stop)]

    def _completed(self, ids: list[int], start: int, chars: int) -> int:
        """How many of `ids`' first tokens (at least `start`) decode within `chars`
        characters: the tokens whose text a stream has sent."""
        k = start
        while k < len(ids) and len(self._decode(ids[: k + 1])) <= chars:
            k += 1
        return k

    def _text(self, ids: list[int], params: SamplingParams) -> tuple[list[int], str, int | None]:
        """(the tokens that are text, their text, where the first stop string starts in it):
        a final stop/EOS token is not text (it ended the completion and counts in usage); the
        engine stops on the token that completes a stop string, and the text ends before it."""
        stop_ids = set(params.stop_token_ids) | set(self.engine.eos_token_ids)
        body = ids[:-1] if ids and ids[-1] in stop_ids else ids
        text = self._decode(body)
        cut = [text.find(s) for s in params.stop if s in text]
        return body, text, min(cut) if cut else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _completion_logprobs(self, c: Completion, a: int, b: int) -> dict[str, Any]:
        """`/v1/completions` log-probs of tokens `[a, b)`, offsets counted from the text's
        start."""
        pos = sum(len(self._decode([t])) for t in c.token_ids[:a])
        tokens, offsets = [], []
        for t in c.token_ids[a:b]:
            tokens.append(self._decode([t]))
            offsets.append(pos)
            pos += len(tokens[-1])
        tops = c.top_logprobs or [{}] * len(c.token_ids)
        return {
            "tokens": tokens,
            "token_logprobs": list(c.logprobs[a:b]),
            "top_logprobs": [{self._decode([i]): lp for i, lp in d.items()} for d in tops[a:b]],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, c: Completion, a: int, b: int) -> dict[str, Any]:
        """Chat log-probs of tokens `[a, b)`."""
        tops = c.top_logprobs or [{}] * len(c.token_ids)
        content = []
        for t, lp, top in zip(c.token_ids[a:b], c.logprobs[a:b], tops[a:b], strict=True):
            s = self._decode([t])
            content.append(
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
        return {"content": content}

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


def stream_chunks(
    response: dict[str, Any],
    sent: Sequence[str],
    given: Sequence[int] | None = None,
    include_usage: bool = False,
) -> list[dict[str, Any]]:
    """The chunks that end a stream once its `chat.completion` or `text_completion` response
    is done, `sent[i]` being the text of choice `i` already streamed (after its role, for
    chat) and `given[i]` how many of its tokens' log-probs went with it (none if omitted):
    per choice the rest of its text, then (chat) its tool calls, each with its `index`, then
    the finish reason; the rest of the choice's log-probs rides on the first of these. With
    `include_usage` every chunk carries `usage: null` and a last chunk with no choices carries
    the usage. A client that joins the deltas (and the log-probs' lists) gets the response
    back."""
    chat = response["object"] == "chat.completion"
    head = _chunk_head(response["id"], chat, response["created"], response["model"])
    usage = {"usage": None} if include_usage else {}
    out = []
    for c in response["choices"]:
        i = c["index"]
        logprobs = _logprobs_from(c["logprobs"], given[i] if given else 0)
        text = (c["message"].get("content") or "") if chat else c["text"]
        if not text.startswith(sent[i]):
            # the settling rules make this impossible; say so rather than join wrongly unseen
            log.error("choice %d streamed %r, which its final text %r does not start with",
                      i, sent[i], text)  # fmt: skip
        rest = text[len(sent[i]) :]
        parts: list[dict[str, Any]] = []
        if not chat:
            parts.append({"text": rest})
        elif rest:
            parts.append({"delta": {"content": rest}})
        calls = (c["message"].get("tool_calls") or []) if chat else []
        if calls:
            parts.append(
                {"delta": {"tool_calls": [{"index": k, **t} for k, t in enumerate(calls)]}}
            )
        for k, part in enumerate(parts):
            out.append(_chunk(head, usage, i, logprobs=logprobs if k == 0 else None, **part))
        end = {"text": ""} if not chat else {"delta": {}}
        out.append(
            _chunk(head, usage, i, c["finish_reason"], logprobs if not parts else None, **end)
        )
    if include_usage:
        out.append({**head, "choices": [], "usage": response["usage"]})
    return out


def _logprobs_from(logprobs: dict[str, Any] | None, start: int) -> dict[str, Any] | None:
    """A choice's log-probs (chat's `content`, or the completions' four lists) from token
    `start` on."""
    if logprobs is None:
        return None
    return {key: entries[start:] for key, entries in logprobs.items()}


def _chunk_head(ident: str, chat: bool, created: int, model: str) -> dict[str, Any]:
    """The fields every chunk of one streamed response repeats."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": ident, "object": obj, "created": created, "model": model}


def _chunk(
    head: dict[str, Any],
    usage: dict[str, Any],
    index: int,
    finish: str | None = None,
    logprobs: Any = None,
    **part: Any,
) -> dict[str, Any]:
    """One streamed chunk: choice `index` with its `delta` (chat) or `text`."""
    choice = {"index": index, **part, "logprobs": logprobs, "finish_reason": finish}
    return {**head, "choices": [choice], **usage}
