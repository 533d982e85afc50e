"""`agentree serve`: the OpenAI API over the tiny policy, checked with the `openai` client and
raw HTTP against what the engine computes directly; request batching; the CLI entry."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from helpers import interruptible

from agentree.commands.serve import Batcher, add_serve_command, start_server
from agentree.config import load_config
from agentree.engines.base import SamplingParams
from agentree.policy import resolve_policy


@pytest.fixture(scope="module")
def server():
    handle = start_server(
        "tiny", backend="transformers", served_model_name="tiny-policy", log_fn=lambda m: None
    )
    yield handle
    handle.close()
    with pytest.raises(urllib.error.URLError):  # the port no longer answers
        urllib.request.urlopen(handle.url + "/models", timeout=5)
    names = {t.name for t in threading.enumerate()}
    assert "serve-http" not in names and "serve-engine" not in names


@pytest.fixture
def client(server):
    c = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def engine_greedy(server, prompt_ids: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return server.api.engine.generate([prompt_ids], params)[0][0].token_ids


def test_models(client, server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-policy"]
    with urllib.request.urlopen(server.url + "/models") as r:
        assert json.loads(r.read())["data"][0]["max_model_len"] == 4096


def test_greedy_completion_is_the_engines_greedy_output(client, server) -> None:
    tok = server.api.tokenizer
    prompt = "P _ _ G\n_ O _ _"
    r = client.completions.create(model="tiny-policy", prompt=prompt, max_tokens=12, temperature=0)
    ids = tok.encode(prompt)
    expected = engine_greedy(server, ids, 12)
    choice = r.choices[0]
    assert choice.finish_reason in ("length", "stop")
    body = expected[:-1] if choice.finish_reason == "stop" else expected
    assert choice.text == tok.decode(body)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(expected)
    assert r.usage.total_tokens == len(ids) + len(expected)
    again = client.completions.create(
        model="tiny-policy", prompt=prompt, max_tokens=12, temperature=0
    )
    assert again.choices[0].text == choice.text


def test_prompt_forms_n_and_logprobs(client, server) -> None:
    tok = server.api.tokenizer
    ids = tok.encode("_ _ P")
    r = client.completions.create(
        model="tiny-policy", prompt=[ids, ids[:2]], max_tokens=5, temperature=0, n=2, logprobs=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(ids) + 2
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert all(len(t) <= 3 for t in lp.top_logprobs)
        # greedy: the chosen token is the most likely one
        assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()), abs=1e-6)
        assert "".join(lp.tokens).startswith(c.text) or c.finish_reason == "stop"
    assert r.choices[0].text == r.choices[1].text  # greedy twice from one prompt


def test_stop_strings_cut_the_text(client) -> None:
    r = client.completions.create(model="tiny-policy", prompt="G _ _", max_tokens=16, temperature=0)
    full = r.choices[0]
    assert len(full.text) > 4 and r.usage.completion_tokens == 16
    stop = full.text[3:5]
    r = client.completions.create(
        model="tiny-policy", prompt="G _ _", max_tokens=16, temperature=0, stop=[stop]
    )
    cut = r.choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert r.usage.completion_tokens < 16  # generation stopped at the stop string


def test_chat_uses_the_chat_template(client, server) -> None:
    tok = server.api.tokenizer
    messages = [{"role": "system", "content": "Move."}, {"role": "user", "content": "P _ G"}]
    r = client.chat.completions.create(
        model="tiny-policy",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(rendered, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    expected = engine_greedy(server, ids, 6)
    msg = r.choices[0].message
    assert msg.role == "assistant"
    stopped = r.choices[0].finish_reason == "stop"
    assert msg.content == tok.decode(expected[:-1] if stopped else expected)
    content = r.choices[0].logprobs.content
    assert len(content) == len(expected)
    assert all(len(c.top_logprobs) == 2 for c in content)


def test_seeded_sampling_repeats(client) -> None:
    def draw() -> str:
        return (
            client.chat.completions.create(
                model="tiny-policy",
                messages=[{"role": "user", "content": "go"}],
                max_tokens=10,
                temperature=1.0,
                seed=7,
            )
            .choices[0]
            .message.content
        )

    assert draw() == draw()


def joined_logprobs(choices) -> openai.types.completion_choice.Logprobs:
    """The log-probs of a streamed completion's chunks, joined list by list."""
    fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    lists = {f: [x for c in choices if c.logprobs for x in getattr(c.logprobs, f)] for f in fields}
    return openai.types.completion_choice.Logprobs(**lists)


def test_a_streamed_answer_joins_to_the_unstreamed_one(client, server) -> None:
    """`stream: true` answers server-sent events that the `openai` client reads: the deltas
    of each choice join to the same text, finish reason and log-probs as the unstreamed
    answer to the same request, each text delta carrying the log-probs of the tokens it
    completes, and `include_usage` ends with the usage."""
    chat = {
        "model": "tiny-policy",
        "messages": [{"role": "user", "content": "P _ G"}],
        "max_tokens": 8,
        "n": 2,
        "seed": 3,
        "logprobs": True,
    }
    whole = client.chat.completions.create(**chat)
    parts = list(
        client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True})
    )
    assert {p.id for p in parts} == {parts[0].id} and parts[0].object == "chat.completion.chunk"
    *chunks, last = parts
    assert last.choices == [] and last.usage == whole.usage
    for c in whole.choices:
        mine = [p.choices[0] for p in chunks if p.choices[0].index == c.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(m.delta.content or "" for m in mine) == c.message.content
        assert [m.finish_reason for m in mine if m.finish_reason] == [c.finish_reason]
        streamed = [t for m in mine if m.logprobs for t in m.logprobs.content]
        assert streamed == c.logprobs.content
        for m in mine:
            if m.delta.content:
                assert "".join(t.token for t in m.logprobs.content) == m.delta.content
    assert all(p.usage is None for p in chunks)

    text = {"model": "tiny-policy", "prompt": "P _ G", "max_tokens": 8, "temperature": 0}
    whole = client.completions.create(**text, logprobs=2)
    chunks = list(client.completions.create(**text, logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert len([c for c in chunks if c.choices[0].text]) == 8  # a chunk per token
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    for c in chunks:  # each token's log-probs come with its text
        if c.choices[0].text:
            assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text
    assert joined_logprobs([c.choices[0] for c in chunks]) == whole.choices[0].logprobs
    # a stop string that shows, and one whose start shows again and again but never ends:
    # its possible start is held back and sent when it is not the stop string after all
    for stop in (["G G G"], ["G G G X"]):
        whole = client.completions.create(**text, stop=stop, logprobs=1).choices[0]
        stream = client.completions.create(**text, stop=stop, logprobs=1, stream=True)
        chunks = [c.choices[0] for c in stream]
        assert "".join(c.text for c in chunks) == whole.text
        assert chunks[-1].finish_reason == whole.finish_reason
        assert joined_logprobs(chunks) == whole.logprobs
    assert whole.text == " G G G G G G G G" and len([c for c in chunks if c.text]) < 8
    raw = json.dumps({**text, "stream": True}).encode()
    # the raw events, as a client without a library reads them
    with urllib.request.urlopen(urllib.request.Request(server.url + "/completions", raw)) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])


class GatedEngine:
    """The server's engine, holding its decoding after `after` tokens until `release` is set:
    a client that has the first tokens by then was sent them while the rest was decoded."""

    def __init__(self, engine, after: int) -> None:
        self.engine, self.after = engine, after
        self.heard, self.done, self.release = 0, False, threading.Event()
        self.out: list = []
        """What the engine returned."""

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, prompts, params, on_token=None, on_done=None, admit=None):
        def heard(i: int, t: int) -> bool | None:
            self.heard += 1
            gone = on_token(i, t)
            if self.heard == self.after:
                self.release.wait(30)
            return gone

        self.out = self.engine.generate(prompts, params, heard if on_token else None, on_done)
        self.done = True
        return self.out


def test_a_stream_sends_each_token_while_the_rest_is_decoded(server) -> None:
    """On the transformers engine a streamed completion's first tokens reach the client while
    the engine is still decoding: the engine waits after its third token, and the client
    reads three chunks of text before it goes on; the whole stream still joins to the
    unstreamed answer."""
    from agentree.commands.serve import OpenAIServer, ServerHandle

    gated = GatedEngine(server.api.engine, after=3)
    api = OpenAIServer(gated, server.api.tokenizer, "gated")
    with ServerHandle(api, "127.0.0.1", 0).start() as handle:
        client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=60)
        text = {"model": "gated", "prompt": "P _ G", "max_tokens": 12, "temperature": 0}
        stream = client.completions.create(**text, stream=True)
        first = [next(stream).choices[0].text for _ in range(3)]
        assert not gated.done and gated.heard == 3  # sent while decoding waited
        gated.release.set()
        rest = [c.choices[0].text for c in stream]
        gated.after = 0
        whole = client.completions.create(**text)
        assert "".join(first + rest) == whole.choices[0].text and all(first)
        client.close()


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_stops_its_completion(server, stream: bool) -> None:
    """A client that closes its connection mid-completion, streamed or not, stops it at the
    engine's next token (finish reason `abort`) instead of it decoding on to `max_tokens`; the
    server goes on answering."""
    from agentree.commands.serve import OpenAIServer, ServerHandle

    body = {"prompt": "P _ G", "max_tokens": 64, "temperature": 0}
    prompt = server.api.tokenizer.encode(body["prompt"])
    assert len(engine_greedy(server, prompt, 64)) > 8  # a completion worth stopping
    gated = GatedEngine(server.api.engine, after=3)
    api = OpenAIServer(gated, server.api.tokenizer, "gated")
    with ServerHandle(api, "127.0.0.1", 0).start() as handle:
        raw = json.dumps({**body, "stream": stream}).encode()
        conn = socket.create_connection((handle.host, handle.port), timeout=30)
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}"
        conn.sendall(head.encode() + b"\r\n\r\n" + raw)
        wait_for(lambda: gated.heard == 3)  # the engine holds after its third token
        if stream:  # the client has what was sent so far
            seen = b""
            while seen.count(b"data: ") < 3:
                seen += conn.recv(4096)
        conn.close()
        wait_for(lambda: api.batcher.abandoned == 1)
        gated.release.set()
        wait_for(lambda: gated.done)
        (cut,) = gated.out[0]
        # stopped at the third token (when the hang-up was seen before the engine asked) or
        # the fourth, not at 64
        assert cut.finish_reason == "abort" and len(cut.token_ids) in (3, 4)
        gated.after = 0
        client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=60)
        full = client.completions.create(model="gated", **body)
        assert full.usage.completion_tokens > 8 and api.batcher.abandoned == 1
        client.close()


def test_a_request_abandoned_while_queued_never_reaches_the_engine(server) -> None:
    """`Batcher.abandon`: a queued request is dropped, and one abandoned in a merged call ends
    at its next token while the other of that call runs to its end."""
    engine = server.api.engine
    gates, entered = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
    calls: list[int] = []

    class Gated:  # the real engine, each call held at the door
        max_model_len = engine.max_model_len

        def generate(self, prompts, params, on_token=None, on_done=None, admit=None):
            k = len(calls)
            calls.append(len(prompts))
            entered[k].set()
            gates[k].wait(30)
            return engine.generate(prompts, params, on_token, on_done)

    batcher = Batcher(Gated())  # type: ignore[arg-type]
    tok = server.api.tokenizer
    params = SamplingParams(max_tokens=16, temperature=0.0)
    prompts = [tok.encode(f"_ {i} P") for i in range(3)]
    first = batcher.submit([prompts[0]], params)
    assert entered[0].wait(30)
    queued = batcher.submit([prompts[1]], params)
    merged = [batcher.submit([prompts[2]], params), batcher.submit([prompts[0]], params)]
    wait_for(lambda: batcher._queue.qsize() == 3)
    batcher.abandon(queued)
    gates[0].set()
    assert first.result()[0][0].finish_reason != "abort"
    assert entered[1].wait(30) and all(f.running() for f in merged)
    batcher.abandon(merged[0])  # its call has started, its first token not yet sampled
    gates[1].set()
    stopped, whole = merged[0].result()[0][0], merged[1].result()[0][0]
    batcher.close()
    assert queued.cancelled() and calls == [1, 2] and batcher.abandoned == 2
    assert stopped.finish_reason == "abort" and len(stopped.token_ids) == 1
    assert whole.token_ids == engine_greedy(server, prompts[0], 16)


def test_errors_are_openai_errors(client, server) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny-policy", prompt="P _ G", max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):  # before a stream
        client.completions.create(
            model="tiny-policy", prompt="P _ G", max_tokens=10_000, stream=True
        )
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny-policy", prompt="P _ G", presence_penalty=1.0)
    req = urllib.request.Request(
        server.url + "/chat/completions",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400 and "valid JSON" in json.loads(e.value.read())["error"]["message"]
    options = {"prompt": "P", "stream_options": {"include_usage": True}}
    req = urllib.request.Request(server.url + "/completions", data=json.dumps(options).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "stream_options"
    bad_n = json.dumps({"prompt": "P _ G", "n": 1.5}).encode()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(server.url + "/completions", data=bad_n))
    assert e.value.code == 422 and json.loads(e.value.read())["error"]["param"] == "n"


def raw_status(server, head: bytes, body: bytes = b"") -> int:
    """The status line's code for a hand-written request (headers a client library would fix)."""
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(head + b"\r\n\r\n" + body)
        reply = b""
        while b"\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def test_bad_requests_get_4xx_and_the_server_stays_up(server) -> None:
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
    for length, code in ((b"-1", 400), (b"abc", 400), (b"100000000000", 413)):
        assert raw_status(server, post + b"\r\nContent-Length: " + length, b"{}") == code
    # a chunked body is counted as it arrives
    big = b"x" * (server.max_body_bytes + 1)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
    assert raw_status(server, post + b"\r\nTransfer-Encoding: chunked", chunked) == 413
    wizard = {"messages": [{"role": "wizard", "content": "hi"}]}
    req = urllib.request.Request(server.url + "/chat/completions", data=json.dumps(wizard).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == 422 and error["param"] == "messages" and "role" in error["message"]
    with pytest.raises(urllib.error.HTTPError) as e:  # GET on a POST route
        urllib.request.urlopen(server.url + "/chat/completions")
    assert e.value.code == 405 and e.value.headers["Allow"] == "POST"
    with urllib.request.urlopen(server.url + "/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}


def test_concurrent_requests_share_engine_calls(server) -> None:
    """A request that arrives while the engine is busy joins the next batched call; in a
    merged call each streamed request hears its own tokens and no other's."""
    engine = server.api.engine
    gate = threading.Event()
    entered = threading.Event()
    calls: list[int] = []

    class Gated:  # the real engine, held at the door until the queue has filled up
        max_model_len = engine.max_model_len

        def generate(self, prompts, params, on_token=None, on_done=None, admit=None):
            calls.append(len(prompts))
            entered.set()
            gate.wait(30)
            return engine.generate(prompts, params, on_token, on_done)

    batcher = Batcher(Gated())  # type: ignore[arg-type]
    tok = server.api.tokenizer
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = [tok.encode(f"_ {i} P") for i in range(5)]
    results: dict[int, list] = {}
    heard: dict[int, list[tuple[int, int]]] = {2: [], 4: []}  # the streamed requests

    def ask(i: int) -> None:
        sink = heard[i].append if i in heard else None
        results[i] = batcher.submit([prompts[i]], params, sink and (lambda *a: sink(a))).result()

    threads = [threading.Thread(target=ask, args=(0,))]
    threads[0].start()
    assert entered.wait(30)
    threads += [threading.Thread(target=ask, args=(i,)) for i in range(1, 5)]
    for t in threads[1:]:
        t.start()
    wait_for(lambda: batcher._queue.qsize() == 4)
    gate.set()
    for t in threads:
        t.join()
    batcher.close()
    assert calls == [1, 4]
    for i, p in enumerate(prompts):
        assert results[i][0][0].token_ids == engine_greedy(server, p, 4)
    for i, tokens in heard.items():
        assert [(j, t.id) for j, t in tokens] == [(0, t) for t in results[i][0][0].token_ids]


def test_requests_with_other_params_share_one_engine_call(server) -> None:
    """Waiting requests join one engine call whatever their params (other limits, `n`,
    temperatures, log-prob counts), each answered as a call of its own would answer it and,
    streamed, hearing its own completions; a seeded request runs alone, its draws repeatable."""
    engine = server.api.engine
    gate, entered = threading.Event(), threading.Event()
    calls: list[tuple[int, bool]] = []  # (prompts, params one each)

    class Gated:  # the real engine, held at the door until the queue has filled up
        max_model_len = engine.max_model_len

        def generate(self, prompts, params, on_token=None, on_done=None, admit=None):
            calls.append((len(prompts), not isinstance(params, SamplingParams)))
            entered.set()
            gate.wait(30)
            return engine.generate(prompts, params, on_token, on_done)

    batcher = Batcher(Gated())  # type: ignore[arg-type]
    tok = server.api.tokenizer
    prompts = [tok.encode(f"_ {i} P") for i in range(5)]
    asked = [
        SamplingParams(max_tokens=4, temperature=0.0),
        SamplingParams(max_tokens=3, temperature=0.0),
        SamplingParams(max_tokens=9, temperature=0.0, n=2),
        SamplingParams(max_tokens=5, temperature=0.7, logprobs=2),
        SamplingParams(max_tokens=6, temperature=1.0, seed=5),
    ]
    heard: list[tuple[int, int]] = []
    first = batcher.submit([prompts[0]], asked[0])
    assert entered.wait(30)
    futures = [
        batcher.submit([p], a, (lambda *x: heard.append(x)) if i == 2 else None)
        for i, (p, a) in enumerate(zip(prompts, asked, strict=True))
        if i
    ]
    wait_for(lambda: batcher._queue.qsize() == 4)
    gate.set()
    first.result()
    short, pair, sampled, seeded = (f.result()[0] for f in futures)
    batcher.close()
    assert calls == [(1, False), (3, True), (1, False)]
    assert [c.token_ids for c in short] == [engine_greedy(server, prompts[1], 3)]
    assert [c.token_ids for c in pair] == [engine_greedy(server, prompts[2], 9)] * 2
    assert {i for i, _ in heard} == {0, 1}  # its own completions, no other request's
    for j, c in enumerate(pair):  # the rows are heard step by step, interleaved
        assert [t.id for i, t in heard if i == j] == c.token_ids
    assert len(sampled[0].token_ids) <= 5 and len(sampled[0].top_logprobs[0]) == 2
    alone = engine.generate([prompts[4]], asked[4])[0]
    assert [c.token_ids for c in seeded] == [c.token_ids for c in alone]


def test_a_request_is_answered_when_its_own_completions_end(server) -> None:
    """In a merged call a short request is answered as soon as its completion ends, while the
    long one it shares the call with decodes on."""
    engine = server.api.engine
    gate, entered = threading.Event(), threading.Event()
    seen: list[tuple[int, bool]] = []  # (completion index, short answered yet) at each token

    class Watched:  # the real engine; the first call held at the door
        max_model_len = engine.max_model_len

        def generate(self, prompts, params, on_token=None, on_done=None, admit=None):
            entered.set()
            gate.wait(30)

            def heard(i, t):
                seen.append((i, short.done()))
                return on_token(i, t)

            return engine.generate(prompts, params, heard, on_done)

    batcher = Batcher(Watched())  # type: ignore[arg-type]
    tok = server.api.tokenizer
    first = batcher.submit([tok.encode("_ P")], SamplingParams(max_tokens=1))
    assert entered.wait(30)
    short = batcher.submit([tok.encode("_ 1 P")], SamplingParams(max_tokens=2, temperature=0.0))
    long = batcher.submit([tok.encode("_ 2 P")], SamplingParams(max_tokens=12, temperature=0.0))
    wait_for(lambda: batcher._queue.qsize() == 2)
    gate.set()
    first.result(), long.result()
    batcher.close()
    assert batcher.calls == 2
    later = [answered for i, answered in seen[3:] if i == 1]  # the long one's, after token 2
    if len(long.result()[0][0].token_ids) > 3:
        assert later and all(later)


def test_requests_that_arrive_mid_call_join_it(server) -> None:
    """Continuous batching: a request that arrives while a call decodes joins that call at its
    next step, is answered as a call of its own would answer it, and as soon as its own
    completion ends; one that joined and whose client hangs up ends at its next token; a
    seeded request waits for the call to end and runs alone."""
    engine = server.api.engine
    tok = server.api.tokenizer
    batcher = Batcher(engine)
    prompts = [tok.encode(f"_ {i} P") for i in range(3)]
    params, greedy_short = (SamplingParams(max_tokens=m, temperature=0.0) for m in (24, 3))
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=7)
    later: dict[str, Future] = {}
    answered: list[bool] = []  # at each token of the first request: the short one answered yet

    def hang_up(*_) -> None:
        batcher.abandon(later["hangs up"])

    def first_heard(i: int, token) -> None:
        k = len(answered)  # the others arrive at its third, fourth and fifth tokens
        if k == 2:
            later["short"] = batcher.submit([prompts[1]], greedy_short)
        elif k == 3:
            later["hangs up"] = batcher.submit([prompts[2]], params, hang_up)
        elif k == 4:
            later["seeded"] = batcher.submit([prompts[2]], seeded)
        answered.append("short" in later and later["short"].done())

    (out,) = batcher.submit([prompts[0]], params, first_heard).result()
    ((short,),), ((cut,),), ((drawn,),) = (later[k].result() for k in later)
    batcher.close()
    assert batcher.calls == 2 and batcher.admitted == 2 and batcher.abandoned == 1
    assert out[0].token_ids == engine_greedy(server, prompts[0], 24)
    assert short.token_ids == engine_greedy(server, prompts[1], 3)
    assert cut.finish_reason == "abort" and len(cut.token_ids) == 1
    alone = engine.generate([prompts[2]], seeded)[0][0]
    assert drawn.token_ids == alone.token_ids
    if len(out[0].token_ids) > 8:  # the first request decodes on after the short one ends
        assert answered[-1]


def test_a_call_takes_in_at_most_max_call_requests(server) -> None:
    """Under steady load a call would run, and keep every request's prompt and completions,
    for as long as requests keep coming: past `max_call` requests it admits no more, ends when
    its rows do, and the waiting requests start the next call."""
    engine = server.api.engine
    tok = server.api.tokenizer
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    prompts = [tok.encode(f"_ {i} P") for i in range(8)]

    class Gated:  # the real engine; the first call waits until every request is queued
        def __init__(self) -> None:
            self.entered, self.gate = threading.Event(), threading.Event()

        def generate(self, *args, **kwargs):
            self.entered.set()
            self.gate.wait(30)
            return engine.generate(*args, **kwargs)

    for max_call, calls, admitted in ((3, 3, 3), (100, 1, 7)):
        gated = Gated()
        batcher = Batcher(gated, max_batch=2, max_call=max_call)  # type: ignore[arg-type]
        futures = [batcher.submit([prompts[0]], greedy)]
        assert gated.entered.wait(30)
        futures += [batcher.submit([p], greedy) for p in prompts[1:]]
        gated.gate.set()
        answers = [f.result() for f in futures]
        batcher.close()
        assert (batcher.calls, batcher.admitted) == (calls, admitted)
        for p, ((got,),) in zip(prompts, answers, strict=True):
            assert got.token_ids == engine_greedy(server, p, 4)


def test_add_serve_command_registers_the_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="agentree")
    add_serve_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--policy", "tiny", "--port", "0"])
    assert (args.command, args.policy, args.port, args.host) == ("serve", "tiny", 0, "127.0.0.1")
    assert callable(args.func)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGHUP])
def test_serve_cli_process(stop: signal.Signals) -> None:
    """`python -m agentree.commands.serve` serves until interrupted (Ctrl-C, or its terminal
    closed), then exits cleanly."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentree.commands.serve",
            "--policy",
            "tiny",
            "--port",
            "0",
            "--served-model-name",
            "cli-tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
        preexec_fn=interruptible,
    )
    try:
        url = None
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("agentree serve: cli-tiny on "):
                url = line.split(" on ")[1].split()[0]
                break
        assert url is not None, "server did not report its address"
        with urllib.request.urlopen(url + "/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "cli-tiny"
        proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


def test_missing_checkpoint_is_one_clear_error(tmp_path, capsys) -> None:
    from agentree.commands.serve import main
    from agentree.config import load_config
    from agentree.policy import build_engine

    with pytest.raises(ValueError, match="does not exist"):
        build_engine(load_config(None), str(tmp_path / "nope"), trainable=False)
    assert main(["--policy", str(tmp_path / "nope"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"engine\.backend"):
        load_config(None, overrides=["engine.backend=tgi"])


def test_live_server_holds_64_concurrent_requests_and_stops_on_sigterm() -> None:
    """`agentree serve` as a user starts it: 64 clients at once are all answered, the server is
    healthy after, and SIGTERM stops it gracefully (the engine closed, exit status 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentree", "serve", "--policy", "tiny", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    try:
        url = None
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("agentree serve: tiny on "):
                url = line.split(" on ")[1].split()[0]
                break
        assert url is not None, "server did not report its address"

        def ask(i: int) -> int:
            body = {"messages": [{"role": "user", "content": f"move {i}"}], "max_tokens": 4}
            req = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode())
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())["usage"]["completion_tokens"]

        with ThreadPoolExecutor(64) as pool:
            answered = list(pool.map(ask, range(64)))
        assert len(answered) == 64 and all(1 <= n <= 4 for n in answered)
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert json.loads(r.read()) == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        rest = proc.stdout.read()  # type: ignore[union-attr]
        assert "stopped; engine closed" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


def test_serve_resolves_tiny_warm_as_train_does() -> None:
    """`--policy tiny-warm` is the warm-started policy `agentree train` uses, not a hub id."""
    cfg = load_config(None, select={"policy": "tiny-warm"})
    warm = resolve_policy(cfg, lambda m: None)
    assert Path(warm).parent.name == "tiny-warm"
    handle = start_server("tiny-warm", backend="transformers", log_fn=lambda m: None)
    try:
        assert warm in handle.api.names
        assert handle.api.engine.model.name_or_path == warm
        c = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(
            model="tiny-warm", messages=[{"role": "user", "content": "P _ G"}], max_tokens=4
        )
        c.close()
        assert r.usage.completion_tokens >= 1
    finally:
        handle.close()


def test_serve_runs_the_configs_settings_with_set_overrides_and_given_flags(
    tmp_path, capsys
) -> None:
    """`--config` and `--set` reach the server as they reach `agentree train` (the policy's
    dtype, the engine's batch size, prefix cache and seed), a flag that is given replaces the
    config's setting and one that is not leaves it (`--policy` too: a config's own policy is
    served); `--max-batch`/`--max-call` bound the batcher's calls."""
    from agentree.commands.serve import main, serve_config

    run = tmp_path / "run.yaml"
    run.write_text(
        "seed: 7\npolicy:\n  dtype: bfloat16\nengine:\n  max_batch_size: 8\n  max_tokens: 5\n"
    )
    handle = start_server(
        "tiny",
        config=str(run),
        overrides=["engine.prefix_cache_mb=0", "engine.backend=transformers"],
        max_batch=5,
        max_call=9,
        log_fn=lambda m: None,
    )
    try:
        engine = handle.api.engine
        assert engine.model.dtype == torch.bfloat16
        assert (engine.max_batch_size, engine.prefix_cache.budget) == (8, 0)
        assert engine.generator.initial_seed() == 7
        assert (handle.api.batcher.max_batch, handle.api.batcher.max_call) == (5, 9)
        c = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=60)
        r = c.completions.create(model="tiny", prompt="P _ G", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
        # a chat request without max_tokens gets the config's per-turn budget
        r = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "P _ G"}], temperature=0
        )
        c.close()
        assert handle.api.default_max_tokens == 5 and 1 <= r.usage.completion_tokens <= 5
    finally:
        handle.close()
    cfg = serve_config("tiny", config=str(run), dtype="float32", seed=1)
    assert (cfg.policy.dtype, cfg.seed, cfg.engine.max_batch_size) == ("float32", 1, 8)
    assert serve_config("tiny").engine.backend == "auto"  # the default config names none
    assert serve_config(None).policy.path == "tiny"
    assert serve_config(None, config="frozenlake_patr_smollm2").policy.path == "warm"  # its own
    assert serve_config("tiny", overrides=["engine.backend=vllm"]).engine.backend == "vllm"
    assert main(["--port", "0", "--set", "engine.max_batch_size=0"]) == 2
    assert "engine.max_batch_size" in capsys.readouterr().err
    assert main(["--port", "0", "--max-call", "0", "--backend", "transformers"]) == 2
    assert "max_call=0" in capsys.readouterr().err


def test_serve_renders_requests_with_tools_in_the_policys_call_format(server, capsys) -> None:
    """`agentree serve --tool-format F` (or the config's `policy.tool_format`) renders a
    client's earlier calls in F, as the policy was trained to write them: the prompt the
    server counts is the one F renders, not the Hermes one the default server renders."""
    from agentree.chat import ChatFormat
    from agentree.commands.serve import main
    from agentree.tool_messages import render_request, request_tools

    edit = {"type": "function", "function": {"name": "edit", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "edit", "arguments": '{"n": 1}'}}
    messages = [
        {"role": "user", "content": "P _ G"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    tools = request_tools({"tools": [edit]})

    def prompt_tokens(handle) -> int:
        c = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(
            model=handle.api.model_name, messages=messages, tools=[edit], max_tokens=1
        )
        c.close()
        return r.usage.prompt_tokens

    def rendered(fmt: str) -> int:
        chat = ChatFormat(server.api.tokenizer, fmt)
        return len(chat.encode(render_request(chat, messages, tools)))

    xml = start_server(
        "tiny", backend="transformers", tool_format="qwen3_coder", log_fn=lambda m: None
    )
    try:
        assert prompt_tokens(xml) == rendered("qwen3_coder") != rendered("hermes")
    finally:
        xml.close()
    assert prompt_tokens(server) == rendered("hermes")  # the default config: text, read as Hermes
    with pytest.raises(SystemExit):
        main(["--tool-format", "xml"])
    assert "invalid choice: 'xml'" in capsys.readouterr().err


def test_without_the_serve_extra_is_one_clear_error(monkeypatch, capsys) -> None:
    from agentree.commands.serve import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # what an install without the extra has
    assert main(["--policy", "tiny", "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "agentree serve: error: agentree serve needs FastAPI and uvicorn (uvicorn is missing): "
        "pip install 'agentree[serve]'"
    )


def test_chat_with_tools_answers_the_openai_client_with_tool_calls(smollm2) -> None:
    """A request carrying `tools`: the policy (scripted here) writes a Hermes call, and the
    `openai` client gets it back as `tool_calls`; the tool's result goes in as a `tool` turn."""
    from helpers import ScriptedEngine
    from transformers import AutoTokenizer

    from agentree.commands.serve import OpenAIServer, ServerHandle

    tok = AutoTokenizer.from_pretrained(smollm2)  # a real BPE tokenizer: any text round-trips
    seen: list[str] = []

    def policy(context: str, i: int) -> str:
        seen.append(context)
        if "<|im_start|>tool" in context:
            return "I reached the goal."
        return 'Going up.<tool_call>{"name": "move", "arguments": {"direction": "up"}}</tool_call>'

    api = OpenAIServer(ScriptedEngine(tok, policy), tok, "tool-policy", default_max_tokens=32)
    move = {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move one cell.",
            "parameters": {
                "type": "object",
                "properties": {"direction": {"type": "string", "enum": ["up", "down"]}},
                "required": ["direction"],
            },
        },
    }
    with ServerHandle(api, "127.0.0.1", 0).start() as handle:
        client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "P _ G"}]
        r = client.chat.completions.create(model="tool-policy", messages=messages, tools=[move])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Going up."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "move"
        assert json.loads(call.function.arguments) == {"direction": "up"}
        assert '"name": "move"' in seen[0] and "<tool_call>" in seen[0]  # the tools declared
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "_ P G"},
        ]
        r = client.chat.completions.create(model="tool-policy", messages=messages, tools=[move])
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content == "I reached the goal."
        assert "<|im_start|>tool\n_ P G<|im_end|>" in seen[1]
        with pytest.raises(openai.BadRequestError, match="function schema"):
            client.chat.completions.create(
                model="tool-policy", messages=messages, tools=[{"type": "function"}]
            )
        # streamed, the client's own stream reader assembles the same calls from the chunks
        first = [{"role": "user", "content": "P _ G"}]
        with client.chat.completions.stream(
            model="tool-policy", messages=first, tools=[move]
        ) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Going up."
        (again,) = streamed.message.tool_calls
        assert (again.function.name, again.function.arguments) == ("move", call.function.arguments)
        client.close()


def test_a_streamed_reply_with_tools_joins_to_the_unstreamed_one_in_every_call_format(
    smollm2,
) -> None:
    """Streamed with tools, in each call format: plain content comes in several chunks as it
    is written, a call's text comes once the reply is read (the calls as `tool_calls`), a
    malformed call as the content it is; the deltas join to the unstreamed message."""
    from helpers import ScriptedEngine
    from transformers import AutoTokenizer

    from agentree.commands.serve import OpenAIServer, ServerHandle
    from agentree.tools import ToolCall, call_format

    tok = AutoTokenizer.from_pretrained(smollm2)
    move = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"direction": {"type": "string"}},
                "required": ["direction"],
            },
        },
    }
    for name in ("hermes", "qwen3_coder", "llama3_json", "pythonic", "mistral", "mistral_json"):
        call = call_format(name).format([ToolCall("move", {"direction": "up"})])
        replies = [
            "The goal is up and to the left.",
            call,
            "[oops(" if name == "pythonic" else call[:-3],
        ]
        if name in ("hermes", "qwen3_coder", "mistral", "mistral_json"):
            replies.append("Going up.\n" + call)
        reply = iter([r for r in replies for _ in (0, 1)])  # unstreamed, then streamed
        api = OpenAIServer(
            ScriptedEngine(tok, lambda _c, _i, reply=reply: next(reply)), tok, "p", tool_format=name
        )
        with ServerHandle(api, "127.0.0.1", 0).start() as handle:
            client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0)
            req = {"model": "p", "messages": [{"role": "user", "content": "P _ G"}]}
            for text in replies:
                whole = client.chat.completions.create(**req, tools=[move]).choices[0]
                chunks = [
                    c.choices[0]
                    for c in client.chat.completions.create(**req, tools=[move], stream=True)
                ]
                content = [c.delta.content for c in chunks if c.delta.content]
                assert "".join(content) == (whole.message.content or ""), (name, text)
                calls = [t for c in chunks for t in c.delta.tool_calls or []]
                assert [(t.function.name, t.function.arguments) for t in calls] == [
                    (t.function.name, t.function.arguments) for t in whole.message.tool_calls or []
                ]
                assert chunks[-1].finish_reason == whole.finish_reason
                if text.startswith("The goal"):  # plain: a chunk per token as it is written
                    assert whole.finish_reason == "stop" and len(content) > 3
                elif text == call:
                    assert whole.finish_reason == "tool_calls" and not content
            client.close()
