"""Token-in/token-out chat assembly.

The policy's sampled ids are kept verbatim. What goes between them (closing the assistant turn,
the next user or tool turn holding the observation, the generation prompt) is derived once from
the tokenizer's own chat template and tokenized on its own, so a multi-turn context is always
`prompt + action_1 + glue_1 + action_2 + glue_2 + ...` with the actions exactly as sampled.

The glue is read from the tail of one rendering (after the last assistant turn), never by
comparing a conversation with its own prefix, so templates that re-render history (Qwen3 drops
earlier turns' reasoning) work too: the sampled ids are never re-rendered, whatever the template
would do to them.

Tools (`Env.tools()`): the prompt carries their schemas through the template's own `tools`
argument; a template that ignores it (plain ChatML, e.g. SmolLM2) gets the documented generic
rendering instead: the system prompt followed by the tool list and the call format's
instructions (`agentree/prompts/tools/<format>.txt`). The results of a turn's calls come back
as `tool`-role messages, one per call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentree.prompts import render
from agentree.tools import CallFormat, ToolAction, written_format

_SENTINEL_USER = "\x00AGENTREE_USER\x00"
_SENTINEL_ASSISTANT = "\x00AGENTREE_ASSISTANT\x00"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "agentree_probe",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


class ChatFormat:
    """Builds prompt and observation ids for a chat model from its chat template.

    `tool_format` names how the policy writes tool calls (`agentree.tools`): `hermes`,
    `llama3_json`, `pythonic`, `qwen3_coder`, `mistral`, `mistral_json`, or `text` (free-text
    actions; an env with tools then reads the generic rendering's `hermes` calls).
    """

    def __init__(self, tokenizer: Any, tool_format: str = "text") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the policy tokenizer has no chat template; agentree needs a chat model "
                "(set tokenizer.chat_template or use an instruct checkpoint)"
            )
        self.tokenizer = tokenizer
        self.tool_format: CallFormat = written_format(tool_format)
        """The format tool calls are rendered and parsed in."""
        closed = self._render(self._base(), generation_prompt=False)
        if _SENTINEL_ASSISTANT not in closed:
            raise ValueError("cannot derive turn glue from this chat template")
        tail = closed[closed.rindex(_SENTINEL_ASSISTANT) + len(_SENTINEL_ASSISTANT) :]
        self.end_of_turn = self._leading_special(tail)
        if self.end_of_turn is None:
            raise ValueError(f"chat template ends assistant turns with {tail!r}: no special token")
        self.end_of_turn_id: int = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        self.native_tools = self._renders_tools()
        """The template renders the `tools` argument itself (else: the generic rendering)."""
        self._glue_cache: dict[tuple[str, int], list[str]] = {}
        self._glue("user", 1)  # fail at construction, not mid-rollout

    @staticmethod
    def _base() -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": _SENTINEL_USER},
            {"role": "assistant", "content": _SENTINEL_ASSISTANT},
        ]

    def _render(
        self,
        messages: list[dict[str, Any]],
        generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        kwargs = {"tools": list(tools)} if tools else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def _renders_tools(self) -> bool:
        msgs = [{"role": "user", "content": _SENTINEL_USER}]
        try:
            with_tools = self._render(msgs, True, [_PROBE_TOOL])
        except Exception:  # a template that chokes on `tools` does not support them
            return False
        return "agentree_probe" in with_tools

    def _glue(self, role: str, n: int) -> list[str]:
        """Texts around `n` observation messages of `role` after an assistant turn, from the
        end-of-turn token (excluded) to the next generation prompt: n + 1 pieces."""
        key = (role, n)
        if key not in self._glue_cache:
            marks = [f"\x00AGENTREE_OBS_{i}\x00" for i in range(n)]
            msgs = self._base() + [{"role": role, "content": m} for m in marks]
            text = self._render(msgs, generation_prompt=True)
            tail = text[text.rindex(_SENTINEL_ASSISTANT) + len(_SENTINEL_ASSISTANT) :]
            if not tail.startswith(self.end_of_turn):
                raise ValueError(f"cannot derive the glue of a {role} turn from this chat template")
            rest, pieces = tail[len(self.end_of_turn) :], []
            for m in marks:
                if m not in rest:
                    raise ValueError(f"the chat template drops {role} messages")
                before, rest = rest.split(m, 1)
                pieces.append(before)
            self._glue_cache[key] = [*pieces, rest]
        return self._glue_cache[key]

    def _leading_special(self, text: str) -> str | None:
        specials = sorted(
            set(self.tokenizer.all_special_tokens) | set(self.tokenizer.get_added_vocab()),
            key=len,
            reverse=True,
        )
        return next((s for s in specials if s and text.startswith(s)), None)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn (the template's end-of-turn and the EOS)."""
        ids = {self.end_of_turn_id}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def prompt_ids(
        self,
        observation: str,
        system: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Ids of [system,] user(observation) and the assistant generation prompt; with
        `tools` (OpenAI function schemas) the system turn declares them."""
        if tools and not self.native_tools:
            system, tools = self.generic_tools_system(system, tools), None
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": observation})
        return self.encode(self._render(messages, generation_prompt=True, tools=tools))

    def generic_tools_system(self, system: str | None, tools: Sequence[dict[str, Any]]) -> str:
        """The system prompt declaring `tools` for a template without tools support."""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        assert self.tool_format.generic_prompt is not None
        return render(self.tool_format.generic_prompt, system=system or "", tools=listing).strip()

    def observation_ids(
        self, observation: str, action_ids: list[int], tool_results: Sequence[str] | None = None
    ) -> list[int]:
        """Ids to append after the policy's `action_ids` to deliver the next observation:
        a user turn holding `observation`, or with `tool_results` one tool turn per result."""
        ended = bool(action_ids) and action_ids[-1] in self.stop_token_ids
        close = [] if ended else [self.end_of_turn_id]
        texts = [observation] if not tool_results else list(tool_results)
        pieces = self._tool_glue(len(texts)) if tool_results else self._glue("user", 1)
        text = pieces[0] + "".join(t + p for t, p in zip(texts, pieces[1:], strict=True))
        return close + self.encode(text)

    def _tool_glue(self, n: int) -> list[str]:
        try:
            return self._glue("tool", n)
        except Exception:  # a template without a tool role: results as one user turn
            user = self._glue("user", 1)
            return [user[0], *["\n\n"] * (n - 1), user[1]]

    def decode_action(self, action_ids: list[int]) -> str:
        """The action text: sampled ids decoded, without the end-of-turn token."""
        ids = action_ids
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def parse_action(self, text: str, tools: Sequence[dict[str, Any]] | None) -> str:
        """The action handed to `Env.step`: `text` itself for an env without tools, else a
        `ToolAction` carrying the calls parsed in `tool_format` (or why there are none)."""
        if not tools:
            return text
        return self.tool_format.parse_action(text, tools)

    def render_calls(self, action: ToolAction | str) -> str:
        """Text of an action's calls in this format (demonstrations, serving)."""
        if isinstance(action, ToolAction) and action.calls:
            return self.tool_format.format(action.calls)
        return str(action)
