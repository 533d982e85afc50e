"""LLM judge against real OpenAI-compatible HTTP servers on 127.0.0.1: small servers written
here (a valid score wrapped in chatter, garbage, too slow, failing then recovering) plus
`agentree serve` with the tiny policy, and a port where nothing listens. Checks blending,
phases, caching, retries, fallbacks, concurrency, that the API key is sent but never recorded,
and PATR on FrozenLake end to end through the Runtime."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agentree.commands.serve import start_server
from agentree.config import load_config
from agentree.prompts import load as load_prompt
from agentree.run.runtime import Runtime
from agentree.scorers import make_scorer
from agentree.scorers.heuristic import TrajectoryHeuristicScorer
from agentree.scorers.judge import JudgeConfig, JudgeReplyError, detect_phase, parse_score
from agentree.scorers.trajectory import step_views
from agentree.tree import Tree

ISSUE = "<issue>\nParser.parse crashes on empty input\n</issue>"
SECRET = "sk-test-0123456789abcdef"
KEY_ENV = "AGENTREE_TEST_JUDGE_KEY"


# -- test servers ----------------------------------------------------------------------------
class JudgeServer:
    """A real HTTP server speaking /v1/chat/completions; `reply(n, body)` decides each answer:
    (status, content) or None to answer nothing (the client times out)."""

    def __init__(self, reply: Callable[[int, dict], tuple[int, str]], delay: float = 0.0):
        self.reply, self.delay = reply, delay
        self.requests: list[dict[str, Any]] = []
        self.inflight = self.max_inflight = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer._lock:
                    n = len(outer.requests)
                    outer.requests.append(
                        {"auth": self.headers.get("Authorization"), "path": self.path, "body": body}
                    )
                    outer.inflight += 1
                    outer.max_inflight = max(outer.max_inflight, outer.inflight)
                try:
                    time.sleep(outer.delay)
                    status, content = outer.reply(n, body)
                finally:
                    with outer._lock:
                        outer.inflight -= 1
                if status == 200:
                    payload = {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": content},
                            }
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                else:
                    payload = {"error": {"message": content, "type": "error", "code": status}}
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout test)
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = False
        self.httpd.block_on_close = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}
        )

    def __enter__(self) -> JudgeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self._thread.join()
        self.httpd.server_close()  # joins the connection threads


def chatter(score: float = 0.8) -> Callable[[int, dict], tuple[int, str]]:
    return lambda n, body: (
        200,
        f'Sure. Looking at the steps,\n{{"score": {score}}}\nHope it helps.',
    )


def judge(url: str, **cfg: Any):
    defaults = {
        "base_url": url,
        "model": "judge-model",
        "api_key_env": KEY_ENV,
        "timeout": 5.0,
        "retries": 0,
        "backoff": 0.0,
    }
    return make_scorer("judge", **{**defaults, **cfg})


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)


# -- trees -----------------------------------------------------------------------------------
def act(cmd: str) -> str:
    return f"THOUGHT: next.\n\n```bash\n{cmd}\n```"


def swe_tree(*commands: tuple[str, int, str]) -> tuple[Tree, int]:
    tree = Tree("swe")
    node = tree.add_root(ISSUE, []).id
    for cmd, rc, out in commands:
        node = tree.add_child(
            node,
            action=act(cmd),
            observation=f"<returncode>{rc}</returncode>\n<output>\n{out}</output>",
            info={"env": {"returncode": rc, "action_key": cmd}},
        ).id
    return tree, node


GREP = ("grep -rn 'def parse' src/", 0, "src/parser.py:42:    def parse(self, text):\n")
EDIT = ("sed -i 's/text\\[0\\]/text[:1]/' src/parser.py", 0, "")
TEST = ("python -m pytest tests/test_parser.py -q", 0, "===== 3 passed in 0.1s =====\n")


def branch(*commands) -> list:
    tree, node = swe_tree(*commands)
    return tree.path(node)


def heuristic_of(b) -> float:
    return TrajectoryHeuristicScorer(JudgeConfig().heuristic).score(None, [b])[0].value


# -- parsing and phases ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ('{"score": 0.8}', 0.8),
        ('I looked at it.\n```json\n{"score": 0.25}\n```\nDone.', 0.25),
        ('{"score": 1}', 1.0),
        ('Format: {"score": <0.0 to 1.0>}. My answer: {"score": 0.4}', 0.4),
        ('first {"score": 0.1} then revised {"score": 0.6}', 0.6),
        ('{"reason": "ok", "score": 0.0}', 0.0),
    ],
)
def test_parse_score_tolerates_chatter(reply: str, score: float) -> None:
    assert parse_score(reply) == score


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        ("", "empty"),
        ("It looks promising, maybe 0.8.", "no JSON"),
        ('{"score": 1.5}', "outside"),
        ('{"score": -0.1}', "outside"),
        ('{"score": NaN}', "outside"),
        ('{"score": "0.8"}', "numeric"),
        ('{"score": true}', "numeric"),
        ('{"value": 0.8}', "numeric"),
        ("{score: 0.8}", "malformed"),
    ],
)
def test_parse_score_rejects_garbage(reply: str, why: str) -> None:
    with pytest.raises(JudgeReplyError, match=why):
        parse_score(reply)


@pytest.mark.parametrize(
    ("commands", "phase"),
    [
        ([GREP], "diagnosis"),
        ([GREP, ("cat src/parser.py", 0, "x = 1\n")], "diagnosis"),
        ([GREP, EDIT], "editing"),
        ([GREP, EDIT, TEST], "verification"),
        ([TEST, GREP, GREP, GREP], "diagnosis"),  # the test run left the window
        ([("echo hello", 0, "hello\n")], "default"),
    ],
)
def test_phase_rules(commands, phase: str) -> None:
    assert detect_phase(step_views(branch(*commands)), window=3) == phase


# -- scoring against servers -----------------------------------------------------------------
def test_blended_score_phase_prompt_and_auth(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    b = branch(GREP, EDIT)
    with JudgeServer(chatter(0.8)) as srv:
        j = judge(srv.url)
        s = j.score(None, [b])[0]
        j.close()
    h = heuristic_of(b)
    assert s.value == pytest.approx(0.7 * 0.8 + 0.3 * h)
    assert s.info["judge"] == 0.8 and s.info["heuristic"] == pytest.approx(h, abs=1e-4)
    assert s.info["phase"] == "editing" and "fallback" not in s.info
    (req,) = srv.requests
    assert req["path"] == "/v1/chat/completions"
    assert req["auth"] == f"Bearer {SECRET}"
    body = req["body"]
    assert body["model"] == "judge-model" and body["temperature"] == 0.0
    system, user = body["messages"]
    assert system == {"role": "system", "content": load_prompt("judge/system.txt").strip()}
    assert user["content"].startswith("Score this partial trajectory during EDITING.")
    assert "Parser.parse crashes on empty input" in user["content"]
    assert "Step 2 [edit]: sed -i" in user["content"]
    assert "edits after evidence: 1" in user["content"]
    assert user["content"].endswith('Output ONLY: {"score": <0.0 to 1.0>}\n')
    assert s.info["prompt"] == user["content"]
    # the key is sent, never kept
    assert SECRET not in json.dumps(s.info) and SECRET not in caplog.text
    assert SECRET not in json.dumps(j.config.model_dump())


def test_lambda_and_default_prompt_when_phases_off() -> None:
    b = branch(GREP)
    with JudgeServer(chatter(0.2)) as srv:
        j = judge(srv.url, lam=0.9, phases=False)
        s = j.score(None, [b])[0]
        j.close()
    assert s.value == pytest.approx(0.9 * 0.2 + 0.1 * heuristic_of(b))
    assert s.info["phase"] == "default"
    content = srv.requests[0]["body"]["messages"][1]["content"]
    assert content.startswith("Score this partial SWE-agent trajectory for tree-search branching.")


def test_cache_serves_repeated_prompts_without_http() -> None:
    a, b = branch(GREP), branch(GREP, EDIT)
    with JudgeServer(chatter(0.8)) as srv:
        j = judge(srv.url)
        first = j.score(None, [a, a, b])  # identical prompts in one batch are asked once
        assert len(srv.requests) == 2
        second = j.score(None, [a, b])
        assert len(srv.requests) == 2  # no new request
        j.close()
    assert [s.info["cached"] for s in second] == [True, True]
    assert [s.value for s in second] == [first[0].value, first[2].value]
    assert j.stats["cache_hits"] == 2 and j.stats["requests"] == 2


def test_garbage_reply_falls_back_to_the_heuristic(caplog) -> None:
    b = branch(GREP, EDIT, TEST)
    with JudgeServer(lambda n, body: (200, "This branch looks great to me!")) as srv:
        j = judge(srv.url)
        s = j.score(None, [b])[0]
        again = j.score(None, [b])[0]  # failures are not cached: asked again
        j.close()
    assert s.value == pytest.approx(heuristic_of(b))
    assert s.info["fallback"] == "heuristic"
    assert s.info["judge_error"].startswith("JudgeReplyError: no JSON object")
    assert s.info["reply"] == "This branch looks great to me!"
    assert len(srv.requests) == 2 and not again.info["cached"]
    assert j.stats["fallbacks"] == 2
    assert "failed (JudgeReplyError" in caplog.text


def test_fallback_none_leaves_the_branch_unscored() -> None:
    with JudgeServer(lambda n, body: (200, '{"score": 7}')) as srv:
        j = judge(srv.url, fallback="none")
        s = j.score(None, [branch(GREP)])[0]
        j.close()
    assert s.value is None and "fallback" not in s.info
    assert "outside [0, 1]" in s.info["judge_error"]


def test_timeouts_are_retried_then_fall_back() -> None:
    with JudgeServer(chatter(), delay=1.0) as srv:
        j = judge(srv.url, timeout=0.2, retries=1, backoff=0.05)
        t0 = time.perf_counter()
        s = j.score(None, [branch(GREP)])[0]
        elapsed = time.perf_counter() - t0
        j.close()
    assert s.info["fallback"] == "heuristic" and s.info["attempts"] == 2
    assert s.info["judge_error"].startswith("APITimeoutError")
    assert len(srv.requests) == 2
    assert elapsed < 1.5  # two 0.2 s timeouts and a short backoff, not the server's 1 s


def test_server_errors_are_retried_with_backoff_client_errors_are_not() -> None:
    def flaky(n: int, body: dict) -> tuple[int, str]:
        return (500, "overloaded") if n < 2 else (200, '{"score": 0.9}')

    with JudgeServer(flaky) as srv:
        j = judge(srv.url, retries=2, backoff=0.05)
        t0 = time.perf_counter()
        s = j.score(None, [branch(GREP)])[0]
        elapsed = time.perf_counter() - t0
        j.close()
    assert s.info["judge"] == 0.9 and s.info["attempts"] == 3 and len(srv.requests) == 3
    assert elapsed >= 0.05 + 0.1  # exponential backoff: 0.05 s, then 0.1 s
    assert j.stats["retries"] == 2
    with JudgeServer(lambda n, body: (400, "bad request")) as srv:
        j = judge(srv.url, retries=3)
        s = j.score(None, [branch(GREP)])[0]
        j.close()
    assert s.info["attempts"] == 1 and s.info["judge_error"].startswith("BadRequestError")


def test_nothing_listening_falls_back() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    j = judge(f"http://127.0.0.1:{port}/v1", retries=1, backoff=0.01)
    s = j.score(None, [branch(GREP), branch(EDIT)])
    j.close()
    assert [x.info["fallback"] for x in s] == ["heuristic", "heuristic"]
    assert all(x.info["judge_error"].startswith("APIConnectionError") for x in s)
    assert all(x.info["attempts"] == 2 for x in s)


def test_error_text_never_carries_the_key() -> None:
    """A server that echoes the Authorization header in its error body."""
    with JudgeServer(lambda n, body: (401, f"bad key {body['model']}")) as srv:
        srv.reply = lambda n, body: (401, f"invalid key {srv.requests[n]['auth']}")
        j = judge(srv.url)
        s = j.score(None, [branch(GREP)])[0]
        j.close()
    assert s.info["judge_error"].startswith("AuthenticationError")
    assert "***" in s.info["judge_error"] and SECRET not in json.dumps(s.info)


def test_concurrency_is_bounded() -> None:
    branches = [branch((f"grep -rn f{i} src/", 0, f"src/m{i}.py:1:\n")) for i in range(9)]
    with JudgeServer(chatter(0.5), delay=0.2) as srv:
        j = judge(srv.url, concurrency=3)
        t0 = time.perf_counter()
        scores = j.score(None, branches)
        elapsed = time.perf_counter() - t0
        j.close()
    assert all(s.info["judge"] == 0.5 for s in scores)
    assert srv.max_inflight == 3
    assert 0.6 <= elapsed < 1.8  # three rounds of 0.2 s, not nine


def test_agentree_serve_tiny_policy_garbage_falls_back() -> None:
    """The tiny policy answers with random tokens: a real server, an unusable reply."""
    handle = start_server(
        "tiny", backend="transformers", served_model_name="tiny-judge", log_fn=lambda m: None
    )
    try:
        j = judge(handle.url, model="tiny-judge", max_tokens=16, retries=0)
        scores = j.score(None, [branch(GREP), branch(GREP, EDIT)])
        j.close()
    finally:
        handle.close()
    for s, b in zip(scores, [branch(GREP), branch(GREP, EDIT)], strict=True):
        assert s.info["fallback"] == "heuristic"
        assert s.info["judge_error"].startswith("JudgeReplyError")
        assert s.info["reply"] is not None  # the server did answer
        assert s.value == pytest.approx(heuristic_of(b))


# -- end to end ------------------------------------------------------------------------------
def patr_frozenlake(scorer: str, *overrides: str) -> tuple[list[Tree], Any]:
    cfg = load_config(
        select={"scorer": scorer, "rollout": "patr", "env": "frozenlake"},
        overrides=[
            "rollout.B0=2",
            "rollout.K=2",
            "rollout.M=2",
            "rollout.top_k=1",
            "env.max_turns=4",
            "engine.max_tokens=6",
            *overrides,
        ],
    )
    rt = Runtime(cfg, log=lambda m: None)
    try:
        trees, stats = rt.rollouts.rollout(rt.load_tasks(2))
    finally:
        rt.close()
    return trees, stats


def test_patr_frozenlake_with_the_judge() -> None:
    with JudgeServer(chatter(0.8)) as srv:
        trees, stats = patr_frozenlake(
            "judge",
            f"scorer.base_url={srv.url}",
            "scorer.model=judge-model",
            f"scorer.api_key_env={KEY_ENV}",
            "scorer.retries=0",
        )
    scored = [n for t in trees for n in t.nodes if n.score is not None]
    assert scored and stats.scorer_calls >= len(scored) and stats.scorer_fallbacks == 0
    for n in scored:
        info = n.info["scorer"]
        assert info["phase"] == "default" and info["judge"] == 0.8  # not a bash agent
        assert n.score == pytest.approx(0.7 * 0.8 + 0.3 * info["heuristic"])
        assert "Step 1 [other]: " in info["prompt"] and "P" in info["prompt"]
    assert all(r["auth"] == f"Bearer {SECRET}" for r in srv.requests)
    assert SECRET not in json.dumps([t.to_dict() for t in trees])


def test_patr_frozenlake_judge_fallbacks_are_counted() -> None:
    with JudgeServer(lambda n, body: (200, "no idea")) as srv:
        trees, stats = patr_frozenlake(
            "judge",
            f"scorer.base_url={srv.url}",
            f"scorer.api_key_env={KEY_ENV}",
            "scorer.retries=0",
        )
    scored = [n for t in trees for n in t.nodes if n.score is not None]
    # every branch still got a score, the heuristic's, and each one counts as a fallback
    assert scored and stats.scorer_fallbacks == stats.scorer_calls
    assert stats.extra["scorer_fallback_heuristic"] == stats.scorer_calls
    assert all(n.info["scorer"]["fallback"] == "heuristic" for n in scored)
    assert stats.to_dict()["scorer_fallback_heuristic"] == stats.scorer_calls


def test_patr_frozenlake_with_the_tiny_prm(tmp_path) -> None:
    from agentree.hub.tiny_prm import build_tiny_prm

    prm = build_tiny_prm(tmp_path / "prm")
    trees, stats = patr_frozenlake("prm", f"scorer.model={prm}", "scorer.device=cpu")
    scored = [n for t in trees for n in t.nodes if n.score is not None]
    assert scored and stats.scorer_fallbacks == 0
    for n in scored:
        info = n.info["scorer"]
        assert 0.0 <= n.score <= 1.0 and n.score == pytest.approx(info["step_scores"][-1], abs=1e-6)
        assert info["steps_seen"] == n.turn  # every turn so far is one PRM step
        assert info["input"].startswith("<|im_start|>") and "| Observation: " in info["input"]
