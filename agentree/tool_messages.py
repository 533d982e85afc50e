"""OpenAI chat messages with tools, in and out of a policy's own call format.

What an OpenAI-compatible server needs to let a client's agent call tools on a policy: the
request's `messages` and `tools` rendered into the prompt the policy was trained on (the chat
template's own `tools` argument, or the generic rendering `ChatFormat` uses in rollouts), and
the completion read back into an assistant message with `tool_calls` (finish reason
`tool_calls`), following the OpenAI chat completions API. Pure functions: no I/O, no model.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from agentree.chat import ChatFormat
from agentree.tools import ToolCall, tool_schemas


class ToolRequestError(ValueError):
    """The request's tools or messages are malformed (an HTTP 400 for a server)."""


def request_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's tools as checked schemas; none when absent or `tool_choice` is "none"."""
    tools = body.get("tools")
    if not tools or body.get("tool_choice") == "none":
        return []
    if not isinstance(tools, list):
        raise ToolRequestError("'tools' must be a list of function tools")
    try:
        return tool_schemas(tools)
    except ValueError as e:
        raise ToolRequestError(str(e)) from None


def render_request(
    chat: ChatFormat, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> str:
    """The prompt text of a chat request, ending with the assistant generation prompt.

    Assistant messages' `tool_calls` are written in the policy's call format (after their
    content), `tool` messages stay tool turns, and the tools are declared as in rollouts.
    """
    msgs = [_plain(m, chat) for m in messages]
    native = bool(tools) and chat.native_tools
    if tools and not native:
        system = msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else None
        if system is not None:
            msgs = msgs[1:]
        msgs = [{"role": "system", "content": chat.generic_tools_system(system, tools)}, *msgs]
    kwargs = {"tools": list(tools)} if native else {}
    return chat.tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, **kwargs
    )


def _plain(m: dict[str, Any], chat: ChatFormat) -> dict[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ToolRequestError("each message needs a 'role' and 'content'")
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    content = "" if content is None else content
    if not isinstance(content, str):
        raise ToolRequestError("message content must be text")
    calls = [_call(c) for c in m.get("tool_calls") or []]
    if calls and m["role"] == "assistant":
        written = chat.tool_format.format(calls)
        content = f"{content.rstrip()}\n{written}" if content.strip() else written
    return {"role": m["role"], "content": content}


def _call(c: Any) -> ToolCall:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolRequestError("each tool call needs a function with a name")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise ToolRequestError(f"the arguments of {fn['name']} are not JSON") from None
    return ToolCall(fn["name"], args, str(c.get("id") or ""))


def completion_message(
    chat: ChatFormat,
    text: str,
    tools: Sequence[dict[str, Any]],
    finish_reason: str,
    new_id: Callable[[], str] = lambda: f"call_{uuid.uuid4().hex[:24]}",
) -> tuple[dict[str, Any], str]:
    """(assistant message, finish reason) of a completion `text` for a request with `tools`.

    Well-formed calls become `tool_calls` (arguments as JSON strings) with finish reason
    `tool_calls`, and `content` is the text around them (None when there is none); a
    completion without calls, or with a malformed one, is plain content as the model wrote it.
    """
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if not tools:
        return message, finish_reason
    action = chat.tool_format.parse_action(text, tools)
    if action.error or not action.calls:
        return message, finish_reason
    rest = chat.tool_format.content(text)
    calls = [ToolCall(c.name, c.arguments, new_id()).to_openai() for c in action.calls]
    return {"role": "assistant", "content": rest or None, "tool_calls": calls}, "tool_calls"
