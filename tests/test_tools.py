"""Native tool calling: schemas, argument validation, the five call formats on hand-written
model outputs (malformed ones included), the rendering of tools through a chat template, and
token-exact multi-turn tool rollouts on the real SmolLM2 tokenizer and on a template that
re-renders history (Qwen3-style reasoning stripping)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers import ScriptedEngine

from agentree import tools as T
from agentree.algorithms.packing import make_batch
from agentree.chat import ChatFormat
from agentree.engines.base import SamplingParams
from agentree.envs import check_env, make_env
from agentree.rollout.base import RolloutContext, make_controller
from agentree.scorers import make_scorer
from agentree.tools import ToolAction, ToolCall, call_format, check_call, tool_schemas


def edit(path: str, old_str: str, new_str: str = "", count: int = 1) -> str:
    """Replace text in a file.

    Args:
        path: The file to edit.
        old_str: The text to replace.
        new_str: The replacement.
        count: How many occurrences to replace.
    """
    return path


MOVE = {
    "type": "function",
    "function": {
        "name": "move",
        "description": "Move one cell.",
        "parameters": {
            "type": "object",
            "properties": {"direction": {"type": "string", "enum": ["up", "down"]}},
            "required": ["direction"],
            "additionalProperties": False,
        },
    },
}


# -- schemas and validation ---------------------------------------------------------------------
def test_a_typed_documented_function_becomes_an_openai_schema():
    (schema,) = tool_schemas([edit])
    fn = schema["function"]
    assert schema["type"] == "function" and fn["name"] == "edit"
    assert fn["description"] == "Replace text in a file."
    assert fn["parameters"]["required"] == ["path", "old_str"]
    assert fn["parameters"]["properties"]["count"] == {
        "type": "integer",
        "description": "How many occurrences to replace.",
    }


def test_bad_tool_specs_fail_with_one_sentence():
    with pytest.raises(ValueError, match="function schema"):
        tool_schemas([{"type": "function", "function": {"description": "no name"}}])
    with pytest.raises(ValueError, match="unique"):
        tool_schemas([MOVE, MOVE])

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="undocumented"):
        tool_schemas([undocumented])
    # a bare function object without "type" is accepted and completed
    (s,) = tool_schemas([{"name": "submit"}])
    assert s["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("validator", ["jsonschema", "builtin"])
def test_arguments_are_checked_against_the_schema(validator, monkeypatch):
    if validator == "builtin":  # the subset used when jsonschema is not installed
        monkeypatch.setattr(T, "_schema_problem", lambda a, s: T._subset_problem(a, s, ""))
    schemas = tool_schemas([MOVE, edit])
    assert check_call(ToolCall("move", {"direction": "up"}), schemas) is None
    assert check_call(ToolCall("edit", {"path": "a", "old_str": "b", "count": 2}), schemas) is None
    assert (
        check_call(ToolCall("jump", {}), schemas)
        == "unknown tool 'jump'; the tools are: edit, move."
    )
    bad_enum = check_call(ToolCall("move", {"direction": "north"}), schemas)
    assert bad_enum.startswith("bad arguments for move: direction: 'north' is not one of")
    missing = check_call(ToolCall("edit", {"path": "a"}), schemas)
    assert missing == "bad arguments for edit: 'old_str' is a required property."
    wrong_type = check_call(ToolCall("edit", {"path": "a", "old_str": "b", "count": "2"}), schemas)
    assert wrong_type.startswith("bad arguments for edit: count: ") and "integer" in wrong_type
    extra = check_call(ToolCall("move", {"direction": "up", "speed": 2}), schemas)
    assert extra.startswith("bad arguments for move:") and "speed" in extra
    boolean = check_call(ToolCall("edit", {"path": "a", "old_str": "b", "count": True}), schemas)
    assert boolean is not None  # JSON Schema: a boolean is not an integer


# -- the call formats on hand-written outputs ---------------------------------------------------
def _parse(fmt: str, text: str) -> ToolAction:
    return call_format(fmt).parse_action(text, tool_schemas([MOVE, edit]))


def test_hermes_reads_one_or_several_tool_call_blocks():
    one = _parse(
        "hermes",
        'I will go up.\n<tool_call>\n{"name": "move", "arguments": {"direction": "up"}}\n'
        "</tool_call>",
    )
    assert one.error is None and one.calls == (ToolCall("move", {"direction": "up"}, "call_0"),)
    assert str(one).startswith("I will go up.")  # the raw text stays the action
    two = _parse(
        "hermes",
        '<tool_call>{"name": "move", "arguments": {"direction": "up"}}</tool_call>\n'
        '<tool_call>{"name": "edit", "arguments": "{\\"path\\": \\"a\\", \\"old_str\\": \\"b\\"}"}'
        "</tool_call>",
    )
    assert [c.name for c in two.calls] == ["move", "edit"] and two.error is None
    assert two.calls[1].arguments == {"path": "a", "old_str": "b"} and two.calls[1].id == "call_1"
    # cut off by max_tokens after the JSON: the unterminated block still counts
    cut = _parse("hermes", '<tool_call>\n{"name": "move", "arguments": {"direction": "down"}}')
    assert cut.calls[0].arguments == {"direction": "down"}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("I think I should move up.", "no tool call found; call one of: move, edit."),
        ('<tool_call>{"name": "move", "arguments": {"direction": "up"</tool_call>', "not JSON"),
        (
            '<tool_call>["move", "up"]</tool_call>',
            'a call must be a JSON object with a string "name"',
        ),
        ('<tool_call>{"name": "move", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "fly", "arguments": {}}</tool_call>', "unknown tool 'fly'"),
        ('<tool_call>{"name": "move", "arguments": {}}</tool_call>', "'direction' is a required"),
    ],
)
def test_hermes_malformed_calls_become_one_sentence_errors(text, error):
    action = _parse("hermes", text)
    assert action.error is not None and error in action.error and action.error.endswith(".")


def test_llama3_json_reads_objects_with_parameters():
    one = _parse("llama3_json", '<|python_tag|>{"name": "move", "parameters": {"direction": "up"}}')
    assert one.error is None and one.calls[0].arguments == {"direction": "up"}
    two = _parse(
        "llama3_json",
        '{"name": "move", "parameters": {"direction": "up"}}; '
        '{"name": "move", "arguments": {"direction": "down"}}',
    )
    assert [c.arguments["direction"] for c in two.calls] == ["up", "down"]
    assert "no tool call found" in _parse("llama3_json", "Let me think.").error
    bad = _parse("llama3_json", '{"name": "move", "parameters": {"direction": up}}')
    assert bad.error.startswith("malformed tool call: the call is not JSON")


def test_pythonic_reads_a_list_of_keyword_calls():
    two = _parse("pythonic", '[move(direction="up"), edit(path="a.py", old_str="x", count=2)]')
    assert two.error is None
    assert two.calls[1] == ToolCall("edit", {"path": "a.py", "old_str": "x", "count": 2}, "call_1")
    assert _parse("pythonic", "[]").error.startswith("no tool call found")
    for text, error in [
        ('[move("up")]', "keyword arguments only"),
        ("[move(direction=up)]", "must be a literal"),
        ('[move(direction="up")', "not valid Python"),
        ("[3]", "is not a call"),
        ("[move(**kw)]", "**kwargs"),
    ]:
        assert error in _parse("pythonic", text).error


# Parameters of every JSON type, to read Qwen3-Coder's untyped values back by.
TYPED = {
    "type": "function",
    "function": {
        "name": "typed",
        "parameters": {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "flag": {"type": "boolean"},
                "range": {"type": "array", "items": {"type": "integer"}},
                "opts": {"type": "object"},
                "maybe": {"type": ["integer", "null"]},
                "either": {"anyOf": [{"type": "integer"}, {"type": "null"}]},  # pydantic's
                "free": {},
            },
        },
    },
}


def test_qwen3_coder_reads_xml_calls_in_the_types_the_schema_declares():
    """Written as Qwen3-Coder's chat template writes a call: values raw between newlines, so
    `007` is a string or the integer 7 only by the schema."""
    text = (
        "I will look first.\n<tool_call>\n<function=typed>\n"
        "<parameter=text>\n007\n</parameter>\n<parameter=count>\n7\n</parameter>\n"
        "<parameter=ratio>\n0.5\n</parameter>\n<parameter=flag>\nTrue\n</parameter>\n"
        "<parameter=range>\n[1, 20]\n</parameter>\n"
        "<parameter=opts>\n{'a': 1}\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n"
        "<parameter=either>\n3\n</parameter>\n<parameter=free>\n[1]\n</parameter>\n"
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=edit>\n<parameter=path>\na.py\n</parameter>\n"
        "<parameter=old_str>\n    x = 1\n\n    y = 2\n</parameter>\n</function>\n</tool_call>"
    )
    action = call_format("qwen3_coder").parse_action(text, tool_schemas([TYPED, edit]))
    assert action.error is None
    typed, edited = action.calls
    assert typed.arguments == {
        "text": "007",
        "count": 7,
        "ratio": 0.5,
        "flag": True,
        "range": [1, 20],
        "opts": {"a": 1},
        "maybe": None,
        "either": 3,
        "free": "[1]",  # no declared type: the text as written
    }
    # a multi-line value keeps its inner newlines and indentation, less the markup's two
    assert edited.arguments == {"path": "a.py", "old_str": "    x = 1\n\n    y = 2"}
    assert call_format("qwen3_coder").content(text) == "I will look first."
    # cut off after a value (max_tokens, or a stop at </parameter>): what was written counts
    cut = _parse("qwen3_coder", "<tool_call>\n<function=move>\n<parameter=direction>\nup\n")
    assert cut.error is None and cut.calls[0].arguments == {"direction": "up"}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("Going up.", "no tool call found; call one of: move, edit."),
        ("<tool_call>\nmove up\n</tool_call>", "must hold <function=NAME>"),
        ("<tool_call><function=>\n</function></tool_call>", "names no function"),
        (
            "<tool_call><function=move><parameter=direction>up</parameter>"
            "<parameter=direction>down</parameter></function></tool_call>",
            "parameter 'direction' is given twice",
        ),
        ("<tool_call><function=move>\n</function></tool_call>", "'direction' is a required"),
        (
            "<tool_call><function=move><parameter=direction>\nnorth\n</parameter></function>"
            "</tool_call>",
            "'north' is not one of",
        ),
        (
            "<tool_call><function=edit><parameter=path>a</parameter><parameter=old_str>b"
            "</parameter><parameter=count>\ntwice\n</parameter></function></tool_call>",
            "'twice' is not of type 'integer'",
        ),
    ],
)
def test_qwen3_coder_malformed_calls_become_one_sentence_errors(text, error):
    action = _parse("qwen3_coder", text)
    assert action.error is not None and error in action.error and action.error.endswith(".")


def test_mistral_reads_calls_as_its_tokenizers_write_them():
    """The turns below are what `mistral_common` 1.13.1 encodes for an assistant message with two
    calls (ids abcdefghi and bcdefghij), decoded with special tokens: the v3 and v7 tokenizers
    (SentencePiece: a space after the marker), tekken (none), and v13's one marker a call. Both
    formats read every one; each writes what its tokenizers write, less the ids."""
    v3 = (
        '[TOOL_CALLS] [{"name": "move", "arguments": {"direction": "up"}, "id": "abcdefghi"}, '
        '{"name": "move", "arguments": {"direction": "down"}, "id": "bcdefghij"}]'
    )
    tekken = v3.replace("[TOOL_CALLS] ", "[TOOL_CALLS]")
    v13 = '[TOOL_CALLS]move[ARGS]{"direction": "up"}[TOOL_CALLS]move[ARGS]{"direction": "down"}'
    v11 = v13.replace("move[ARGS]", "move[CALL_ID]abcdefghi[ARGS]", 1)
    up, down = {"direction": "up"}, {"direction": "down"}
    for fmt in ("mistral", "mistral_json"):
        for text in (v3, tekken):
            assert _parse(fmt, text).calls == (
                ToolCall("move", up, "abcdefghi"),
                ToolCall("move", down, "bcdefghij"),
            )
        assert _parse(fmt, v13).calls == (
            ToolCall("move", up, "call_0"),
            ToolCall("move", down, "call_1"),
        )
        assert _parse(fmt, v11).calls[0].id == "abcdefghi"
        # a name followed straight by its arguments; text after the object is not read
        assert _parse(fmt, '[TOOL_CALLS]move{"direction": "up"} ok').calls[0].arguments == up
        reply = "Going up." + call_format(fmt).format([ToolCall("move", up)])
        assert call_format(fmt).content(reply) == "Going up."
    calls = [ToolCall("move", up), ToolCall("move", down)]
    assert call_format("mistral").format(calls) == v13
    assert call_format("mistral_json").format(calls) == (
        '[TOOL_CALLS][{"name": "move", "arguments": {"direction": "up"}}, '
        '{"name": "move", "arguments": {"direction": "down"}}]'
    )
    # mistral_common writes arguments with json.dumps(..., ensure_ascii=False)
    assert (
        call_format("mistral")
        .format([ToolCall("edit", {"path": "café.py"})])
        .endswith('{"path": "café.py"}')
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("I think I should move up.", "no tool call found; call one of: move, edit."),
        ("[TOOL_CALLS]move", "move has no arguments: write [TOOL_CALLS]NAME[ARGS]{...}"),
        ('[TOOL_CALLS]move[ARGS]{"direction": up}', "the arguments of move are not JSON"),
        ("[TOOL_CALLS]move[ARGS][1]", "the arguments of move must be a JSON object"),
        ("[TOOL_CALLS][]", "the list after [TOOL_CALLS] holds no call"),
        (
            '[TOOL_CALLS][{"name": "move", "arguments": {',
            "the calls after [TOOL_CALLS] are not JSON",
        ),
        ('[TOOL_CALLS][["move"]]', 'a call must be a JSON object with a string "name"'),
        ("[TOOL_CALLS]fly[ARGS]{}", "unknown tool 'fly'"),
    ],
)
def test_mistral_malformed_calls_become_one_sentence_errors(text, error):
    for fmt in ("mistral", "mistral_json"):
        action = _parse(fmt, text)
        assert action.error is not None and error in action.error and action.error.endswith(".")


def test_text_format_reads_no_calls_and_each_format_round_trips():
    assert call_format("text").parse("<tool_call>{}</tool_call>") == []
    calls = [
        ToolCall("move", {"direction": "up"}),
        ToolCall("edit", {"path": "a", "old_str": "b\n  c", "new_str": "007", "count": 2}),
    ]
    for fmt in ("hermes", "llama3_json", "pythonic", "qwen3_coder", "mistral", "mistral_json"):
        back = _parse(fmt, call_format(fmt).format(calls))
        assert back.error is None, fmt
        assert [(c.name, c.arguments) for c in back.calls] == [(c.name, c.arguments) for c in calls]
    typed = {"text": "x", "count": 3, "ratio": 2.5, "flag": False, "range": [1], "opts": {"k": []}}
    fmt = call_format("qwen3_coder")
    back = fmt.parse_action(fmt.format([ToolCall("typed", typed)]), tool_schemas([TYPED]))
    assert back.calls[0].arguments == typed
    # the text around the calls, as an API reply's content: none where calls are the whole turn
    assert call_format("hermes").content("Up.\n" + call_format("hermes").format(calls)) == "Up."
    assert call_format("pythonic").content(call_format("pythonic").format(calls)) == ""
    with pytest.raises(ValueError, match="unknown tool call format 'xml'"):
        call_format("xml")
    assert ToolCall("move", {"direction": "up"}).readable() == 'move(direction="up")'
    assert json.loads(calls[0].to_openai()["function"]["arguments"]) == {"direction": "up"}


# -- grid envs in tool mode -----------------------------------------------------------------------
@pytest.mark.parametrize("env", ["frozenlake", "sokoban"])
def test_grid_envs_in_tool_mode_pass_check_env_and_penalise_bad_calls(env):
    e = make_env(env, action_format="tools", invalid_penalty=0.1)
    assert check_env(e)["forkable"]
    assert e.tools()[0]["function"]["name"] == "move"
    task = type(e).load_tasks(1)[0]
    e.reset(seed=task.seed, options=task.options)
    state = e.snapshot()
    obs, reward, *_, info = e.step(
        '<tool_call>{"name": "move", "arguments": {"direction": "west"}}'
    )
    assert reward == -0.1 and info["format_error"] is True
    assert obs.startswith("Invalid action: bad arguments for move: direction: 'west' is not one of")
    e.restore(state)
    two = '<tool_call>{"name": "move", "arguments": {"direction": "up"}}</tool_call>' * 2
    obs, *_ = e.step(two)
    assert obs.startswith("Invalid action: call move exactly once per turn, not 2 times.")
    e.close()


# -- rendering and token-exact rollouts ----------------------------------------------------------
@pytest.fixture(scope="module")
def smol_tokenizer(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_chatml_without_tools_support_gets_the_generic_rendering(smol_tokenizer):
    chat = ChatFormat(smol_tokenizer, "hermes")
    assert not chat.native_tools  # SmolLM2's ChatML ignores `tools`
    text = smol_tokenizer.decode(chat.prompt_ids("P _ G", "Walk.", [MOVE]))
    assert text.startswith("<|im_start|>system\nWalk.\n\n# Tools\n")
    assert json.dumps(MOVE) in text and "<tool_call></tool_call> XML tags" in text
    action = [*smol_tokenizer.encode("<tool_call>{}</tool_call>", add_special_tokens=False), 2]
    glue = smol_tokenizer.decode(chat.observation_ids("_ P G", action, ["r1", "r2"]))
    assert glue == (
        "\n<|im_start|>tool\nr1<|im_end|>\n<|im_start|>tool\nr2<|im_end|>\n<|im_start|>assistant\n"
    )
    pythonic = ChatFormat(smol_tokenizer, "pythonic")
    assert "[func_name1(" in smol_tokenizer.decode(pythonic.prompt_ids("x", None, [MOVE]))
    qwen = smol_tokenizer.decode(
        ChatFormat(smol_tokenizer, "qwen3_coder").prompt_ids("x", None, [MOVE])
    )
    assert json.dumps(MOVE) in qwen and "<function=function_name>\n<parameter=" in qwen


# A Qwen3-style template: tools in the system turn, tool results in user turns, and the
# reasoning of assistant turns before the last real user turn stripped on re-rendering.
QWEN3_LIKE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}# Tools\n<tools>\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{% endif %}"
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}{%- set c = m.content %}"
    "{%- if loop.index0 < ns.last and '</think>' in c %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "<|im_start|>assistant\n{{ c }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

DESC = ["SFF", "FHF", "FFG"]  # right, right, down, down reaches G


def _moves(reasoning: bool):
    """Turn by turn: a call without JSON, then two calls in one turn, then the path to G."""
    call = call_format("hermes").format
    script = [
        "<tool_call>{move: up}</tool_call>",
        call([ToolCall("move", {"direction": "up"})] * 2),
        *[call([ToolCall("move", {"direction": d})]) for d in ("right", "right", "down", "down")],
    ]

    def choose(text: str, i: int) -> str:
        turn = text.count("<|im_start|>assistant") - 1
        out = script[min(turn, len(script) - 1)]
        return f"<think>turn {turn}: thinking</think>\n{out}" if reasoning else out

    return choose


class RecordingEngine(ScriptedEngine):
    """The scripted policy, remembering every completion it sampled."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sampled: list[list[int]] = []

    def generate(self, prompts, params):
        outs = super().generate(prompts, params)
        self.sampled += [list(o[0].token_ids) for o in outs]
        return outs


def move_tools() -> list[dict]:
    """The schemas a tool-mode grid env's rollouts carry in their context."""
    return tool_schemas(make_env("frozenlake", action_format="tools").tools())


def _tool_rollout(tokenizer, reasoning: bool):
    chat = ChatFormat(tokenizer, "hermes")
    engine = RecordingEngine(tokenizer, _moves(reasoning))
    ctx = RolloutContext(
        engine=engine,
        chat=chat,
        sampling=SamplingParams(max_tokens=64, stop_token_ids=chat.stop_token_ids),
        env_factory=lambda: make_env("frozenlake", action_format="tools", max_turns=8),
        tools=move_tools(),
        scorer=make_scorer("none"),
        rng=random.Random(0),
    )
    controller = make_controller("grpo", G=2)
    (tree,), stats = controller.rollout([T_TASK], ctx)
    return chat, engine, tree, stats, controller.group(tree)


T_TASK = __import__("agentree.envs.base", fromlist=["Task"]).Task("t", options={"desc": DESC})


def _check_token_exact(chat, engine, tree, stats, group):
    assert stats.extra["tool_call_errors"] == 2 * 2 and stats.extra["tool_calls"] == 2 * 6
    advs = [[1.0] * len(t.token_ids) for t in group]
    batch = make_batch(group, advs, pad=0)
    for row, t in enumerate(group):
        path = tree.path(t.leaf)
        assert t.reward == 1.0 and len(path) == 7  # G reached on the sixth turn
        # what the trainer learns from is exactly what was sampled, turn after turn
        ids = batch.ids[row, 1:][batch.mask[row].bool()].tolist()
        turns = [n.action_ids for n in path[1:]]
        assert ids == [x for a in turns for x in a]
        assert all(a in engine.sampled for a in turns)
        # and the context is prompt + sampled + glue, nothing re-rendered
        assert list(t.token_ids) == [
            *path[0].obs_ids,
            *[x for n in path[1:] for x in n.action_ids + n.obs_ids],
        ]
        assert path[1].info["tool_error"].startswith("malformed tool call")
        assert path[3].info["tool_calls"] == [{"name": "move", "arguments": {"direction": "right"}}]
    return group[0]


def test_multi_turn_tool_rollout_is_token_exact_on_smollm2(smol_tokenizer):
    chat, engine, tree, stats, group = _tool_rollout(smol_tokenizer, reasoning=False)
    t = _check_token_exact(chat, engine, tree, stats, group)
    text = smol_tokenizer.decode(t.token_ids)
    # the malformed turn is answered in a user turn, the calls in tool turns
    assert "<|im_start|>user\nInvalid action: malformed tool call" in text
    assert text.count("<|im_start|>tool\n") == 4


def test_a_template_that_rewrites_history_still_trains_on_the_sampled_ids(smol_tokenizer):
    tok = __import__("copy").deepcopy(smol_tokenizer)
    tok.chat_template = QWEN3_LIKE
    chat, engine, tree, stats, group = _tool_rollout(tok, reasoning=True)
    assert chat.native_tools
    t = _check_token_exact(chat, engine, tree, stats, group)
    path = tree.path(t.leaf)
    # the template itself, asked to render the same conversation, drops the first turn's
    # reasoning (a user turn follows it): re-rendering would not give the sampled ids
    messages = [
        {"role": "system", "content": make_env("frozenlake", action_format="tools").system_prompt}
    ]
    messages.append({"role": "user", "content": path[0].observation})
    messages.append({"role": "assistant", "content": path[1].action})
    messages.append({"role": "user", "content": path[1].observation})
    rerendered = tok.apply_chat_template(
        messages, tools=[T.tool_schema(T_MOVE)], tokenize=False, add_generation_prompt=True
    )
    assert "turn 0: thinking" not in rerendered
    ours = tok.decode([*path[0].obs_ids, *path[1].action_ids, *path[1].obs_ids])
    assert "<think>turn 0: thinking</think>" in ours
    assert ours.endswith(
        "<|im_start|>user\n" + path[1].observation + "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<tool_response>\n" in tok.decode(t.token_ids)


T_MOVE = __import__("agentree.envs.grid", fromlist=["MOVE_TOOL"]).MOVE_TOOL


@pytest.mark.parametrize("controller", ["treepo", "eptree"])
def test_token_controllers_render_the_tools_and_hand_the_env_parsed_calls(
    smol_tokenizer, controller
):
    call = call_format("hermes").format([ToolCall("move", {"direction": "right"})])
    for answer, ok in ((call, True), ("<tool_call>{move: right}</tool_call>", False)):
        chat = ChatFormat(smol_tokenizer, "hermes")
        ctx = RolloutContext(
            engine=ScriptedEngine(smol_tokenizer, lambda text, i, a=answer: a),
            chat=chat,
            sampling=SamplingParams(max_tokens=64, stop_token_ids=chat.stop_token_ids),
            env_factory=lambda: make_env("frozenlake", action_format="tools", max_turns=8),
            tools=move_tools(),
            scorer=make_scorer("none"),
            rng=random.Random(0),
        )
        (tree,), stats = make_controller(controller).rollout([T_TASK], ctx)
        # the prompt carries the tools as a turn's does
        assert smol_tokenizer.decode(tree.nodes[0].obs_ids) == smol_tokenizer.decode(
            chat.prompt_ids(
                tree.nodes[0].observation, ctx.env_factory().system_prompt, tool_schemas([T_MOVE])
            )
        )
        assert '"name": "move"' in smol_tokenizer.decode(tree.nodes[0].obs_ids)
        stepped = [n for n in tree.leaves() if n.info.get("env")]
        assert stepped and stats.extra["tool_calls"] == (len(stepped) if ok else 0)
        for leaf in stepped:
            if ok:  # the env got the call parsed in the policy's format and moved
                assert leaf.info["tool_calls"] == [
                    {"name": "move", "arguments": {"direction": "right"}}
                ]
                assert leaf.info["env"]["action_key"] == "right"
                assert not leaf.info["env"]["format_error"]
            else:  # a malformed call: the env's invalid-action turn, counted
                assert leaf.info["tool_error"].startswith("malformed tool call")
                assert leaf.info["env"]["format_error"]
        assert stats.extra.get("tool_call_errors", 0) == (0 if ok else len(stepped))


def test_judges_and_prms_read_calls_as_name_and_arguments():
    from agentree.scorers.trajectory import view_step
    from agentree.tools import readable_action
    from agentree.tree import Tree

    tree = Tree("t", {})
    tree.add_root("issue", [1])
    text = '<tool_call>{"name": "file_editor", "arguments": {...}}</tool_call>'
    calls = [
        [{"name": "file_editor", "arguments": {"command": "str_replace", "path": "/a.py"}}],
        [{"name": "execute_bash", "arguments": {"command": "python -m pytest tests"}}],
        [{"name": "file_editor", "arguments": {"command": "view", "path": "/a.py"}}],
        [{"name": "submit", "arguments": {}}],
    ]
    kinds = []
    for i, c in enumerate(calls):
        node = tree.add_child(i, action=text, observation="ok", info={"tool_calls": c})
        kinds.append(view_step(i + 1, node).tool)
    assert kinds == ["edit", "test", "read", "finish"]
    node = tree.nodes[1]
    assert readable_action(node.action, node.info) == (
        'file_editor(command="str_replace", path="/a.py")'
    )
    assert view_step(2, tree.nodes[2]).command == "python -m pytest tests"
    assert readable_action("```Up```", {}) == "```Up```"  # free text stays as written


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_a_max_tokens_too_small_for_any_call_is_refused_naming_the_fix(smol_tokenizer, fmt):
    """FrozenLake's config allows 8 tokens a turn, enough for ```Down``` but not for a `move`
    call: every call would be cut short and invalid, so the rollouts refuse to start."""
    from agentree.config import load_config
    from agentree.rollouts import LocalRollouts, rollout_parts

    tools = ["env.action_format=tools", f"policy.tool_format={fmt}"]
    cfg = load_config(overrides=[*tools, "engine.max_tokens=8"])
    parts = rollout_parts(cfg)
    with pytest.raises(ValueError, match=rf"max_tokens=8 cuts every tool call short.*{fmt}") as e:
        LocalRollouts(cfg, parts, None, smol_tokenizer)
    fix = str(e.value).split("--set ")[-1].split(" ")[0]  # engine.max_tokens=N
    suggested = load_config(overrides=[*tools, fix])
    LocalRollouts(suggested, rollout_parts(suggested), None, smol_tokenizer)  # the fix fits
    text = load_config(overrides=["engine.max_tokens=8"])  # moves as text: nothing to fit
    LocalRollouts(text, rollout_parts(text), None, smol_tokenizer)


def test_a_policy_directory_keeps_how_it_learned_to_act(
    tiny_frozenlake: Path, tmp_path: Path
) -> None:
    """Weights do not say how a policy acts: a run's checkpoint, `agentree export` and
    `agentree sft` record its call format and whether it acted through tool calls beside them,
    and `--policy DIR` reads the calls in that format, in the env's action format it learned,
    unless the config sets them, saying so when it sets others."""
    from agentree.commands.cli import main
    from agentree.config import load_config
    from agentree.hub.store import POLICY_RECORD, policy_record
    from agentree.policy import resolve_policy

    run, small = tmp_path / "run", ["env.max_turns=2", "rollout.K=2", "train.tasks_per_step=1"]
    sets = ["env.action_format=tools", "policy.tool_format=pythonic", "engine.max_tokens=48"]
    sets += [*small, "eval.tasks=1", "eval.samples=1"]
    args = ["--env", "frozenlake", "--policy", str(tiny_frozenlake), "--steps", "1"]
    assert main(["train", *args, "--output", str(run), *(f"--set={s}" for s in sets)]) == 0
    ckpt = run / "checkpoints" / "step_000001"
    acted = {"tool_format": "pythonic", "action_format": "tools"}
    assert policy_record(ckpt) == acted

    given = load_config(select={"env": "frozenlake", "policy": str(ckpt)})
    assert given.policy.tool_format == "pythonic" and given.env["action_format"] == "tools"
    notes: list[str] = []
    assert resolve_policy(given, notes.append) == str(ckpt) and notes == []
    chosen = load_config(
        select={"env": "frozenlake", "policy": str(ckpt)},
        overrides=["policy.tool_format=hermes", "env.action_format=text"],
    )
    # the config's word stands, with a note for each
    assert chosen.policy.tool_format == "hermes" and chosen.env["action_format"] == "text"
    resolve_policy(chosen, notes.append)
    assert "learned to write pythonic tool calls" in notes[0]
    assert "--set policy.tool_format=pythonic" in notes[0]
    assert "--set env.action_format=tools" in notes[1]
    # an env without the setting takes the call format only
    other = load_config(select={"env": "countdown", "policy": str(ckpt)})
    assert other.policy.tool_format == "pythonic" and "action_format" not in other.env
    # a checkpoint without the record (another tool's, or an older one) changes nothing
    assert policy_record(tiny_frozenlake) == {}
    bare = load_config(select={"env": "frozenlake", "policy": str(tiny_frozenlake)})
    assert bare.policy.tool_format == "text" and bare.env["action_format"] == "text"

    out = tmp_path / "merged"
    assert main(["export", str(run), "--output", str(out)]) == 0
    assert policy_record(out) == acted
    data = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "P _\n_ G"}, {"role": "assistant", "content": "Right"}]
    data.write_text(json.dumps({"messages": turns}) + "\n")
    sft = tmp_path / "sft"
    argv = ["sft", "--env", "frozenlake", "--policy", str(out), "--data", str(data)]
    assert main([*argv, "--output", str(sft), "--epochs", "1"]) == 0
    assert policy_record(sft) == acted  # from the policy it started from

    (sft / POLICY_RECORD).write_text("pythonic")
    with pytest.raises(ValueError, match="should be a JSON object"):
        load_config(select={"policy": str(sft)})
    (sft / POLICY_RECORD).write_text(json.dumps({**acted, "action_format": "calls"}))
    with pytest.raises(ValueError, match="should be a JSON object"):
        load_config(select={"policy": str(sft)})


# -- OpenAI messages with tools (what `agentree serve` answers) -----------------------------------
def test_requests_with_tools_render_as_rollouts_do_and_calls_come_back_as_tool_calls(
    smol_tokenizer,
):
    from agentree.tool_messages import (
        ToolRequestError,
        completion_message,
        render_request,
        request_tools,
    )

    chat = ChatFormat(smol_tokenizer, "hermes")
    body = {
        "tools": [MOVE],
        "messages": [
            {"role": "system", "content": "Walk."},
            {"role": "user", "content": "P _ G"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "move", "arguments": '{"direction": "up"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "_ P G"},
        ],
    }
    tools = request_tools(body)
    text = render_request(chat, body["messages"], tools)
    # the same ids a rollout builds: prompt, the call as the policy writes it, the tool turn
    call = '<tool_call>\n{"name": "move", "arguments": {"direction": "up"}}\n</tool_call>'
    action = [*chat.encode(call), chat.end_of_turn_id]
    expected = chat.prompt_ids("P _ G", "Walk.", tools) + action
    expected += chat.observation_ids("", action, ["_ P G"])
    assert chat.encode(text) == expected
    assert request_tools({**body, "tool_choice": "none"}) == []
    with pytest.raises(ToolRequestError, match="function schema"):
        request_tools({"tools": [{"type": "function"}]})

    ids = iter(["call_a", "call_b"])
    message, finish = completion_message(
        chat, "Going up.\n" + call + "\n" + call, tools, "stop", lambda: next(ids)
    )
    assert finish == "tool_calls" and message["content"] == "Going up."
    assert [c["id"] for c in message["tool_calls"]] == ["call_a", "call_b"]
    assert message["tool_calls"][0]["function"] == {
        "name": "move",
        "arguments": '{"direction": "up"}',
    }
    # no call, or a malformed one: the text as written
    for text in ("I am not sure.", '<tool_call>{"name": "move", "arguments": {}}</tool_call>'):
        assert completion_message(chat, text, tools, "stop") == (
            {"role": "assistant", "content": text},
            "stop",
        )


def test_a_qwen3_coder_policy_is_served_its_history_and_replies_in_its_own_format(
    smol_tokenizer,
):
    """A client's earlier `tool_calls` are written in the policy's XML, and its reply's calls
    come back typed by the request's schemas, with the text before them as content."""
    from agentree.tool_messages import completion_message, render_request, request_tools

    chat = ChatFormat(smol_tokenizer, "qwen3_coder")
    tools = request_tools({"tools": [TYPED]})
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "typed", "arguments": '{"count": 3}'},
    }
    messages = [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": "Counting.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    text = render_request(chat, messages, tools)
    written = "Counting.\n<tool_call>\n<function=typed>\n<parameter=count>\n3\n</parameter>\n"
    assert written + "</function>\n</tool_call><|im_end|>" in text
    reply = "Again.\n" + call_format("qwen3_coder").format([ToolCall("typed", {"count": 4})])
    message, finish = completion_message(chat, reply, tools, "stop", lambda: "c2")
    assert finish == "tool_calls" and message["content"] == "Again."
    assert message["tool_calls"][0]["function"]["arguments"] == '{"count": 4}'


@pytest.mark.parametrize(
    "fmt", ["hermes", "llama3_json", "pythonic", "qwen3_coder", "mistral", "mistral_json"]
)
def test_tool_demonstrations_tokenise_as_the_rollout_of_the_same_calls(smol_tokenizer, fmt):
    """`agentree sft` on the expert's tool-call episodes trains on the layout a tool rollout
    builds, in every call format: the same prompt (tools declared), the same call text, the same
    tool turns."""
    from agentree.envs.frozenlake import FrozenLakeEnv
    from agentree.models.sft import example_from_messages
    from agentree.models.warm import expert_episode

    env = FrozenLakeEnv(action_format="tools")
    for task in FrozenLakeEnv.generate_tasks(20, seed=7):  # the first with three moves or more
        conv, success = expert_episode(env, task, 1.0, random.Random(0))
        if len(conv) >= 5:
            break
    assert success and conv[1]["tool_calls"][0]["function"]["name"] == "move"
    assert [m["role"] for m in conv[:4]] == ["user", "assistant", "tool", "assistant"]
    chat = ChatFormat(smol_tokenizer, fmt)
    example = example_from_messages(chat, conv, env.system_prompt, tool_schemas(env.tools()))

    moves = [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in conv[1::2]]

    def choose(text: str, i: int) -> str:
        turn = text.count("<|im_start|>assistant") - 1
        return call_format(fmt).format([ToolCall("move", moves[turn])])

    ctx = RolloutContext(
        engine=ScriptedEngine(smol_tokenizer, choose),
        chat=chat,
        sampling=SamplingParams(max_tokens=64, stop_token_ids=chat.stop_token_ids),
        env_factory=lambda: FrozenLakeEnv(action_format="tools"),
        tools=move_tools(),
        scorer=make_scorer("none"),
        rng=random.Random(0),
    )
    (tree,), _ = make_controller("grpo", G=1).rollout([task], ctx)
    (trajectory,) = tree.trajectories()
    assert trajectory.reward == 1.0
    assert list(trajectory.token_ids) == example.token_ids
    assert list(trajectory.loss_mask) == example.loss_mask


def test_a_streamed_reply_settles_only_what_no_later_token_changes(smol_tokenizer):
    """`CallFormat.settled` on every prefix of replies in each format is a prefix of the
    reply's final content, whichever way the reply ends (plain content, calls, a malformed
    call), and plain content settles as it is written: what `agentree serve` streams."""
    from agentree.tool_messages import completion_message

    assert T.held_back("abc<tool", ["<tool_call>"]) == 5
    assert T.held_back("abc", ["<tool_call>"]) == 0
    assert T.held_back("ab<", ["<tool_call>", "<|x"]) == 1
    assert T.held_back("xx\nUs", ["STOP", "\nUser:"]) == 3
    assert T.held_back("<tool_call>", ["<tool_call>"]) == 0  # a whole mark is not held back
    hermes, pythonic, llama = (call_format(f) for f in ("hermes", "pythonic", "llama3_json"))
    for text, settled in [
        ("Going up.", "Going up."),
        ("Going up.  ", "Going up."),  # content() strips the spaces before a call
        ("Going up.<tool", "Going up."),
        ('Going up.<tool_call>{"name"', "Going up."),
        (" Going", ""),  # a leading space: plain content keeps it, content() does not
        ("", ""),
    ]:
        assert hermes.settled(text) == settled
    for text, settled in [
        ("I will", "I will"),
        ("  [move(", ""),
        ("<|python_st", ""),
        ("<|python_start|>[m", ""),
        ("<|python_start|>Hi", "<|python_start|>Hi"),
        ("  ", ""),
    ]:
        assert pythonic.settled(text) == settled
    assert (llama.settled("{"), llama.settled("<|python_tag|>{"), llama.settled("Hi")) == (
        "",
        "",
        "Hi",
    )
    assert call_format("text").settled(" [x") == " [x"

    up = {"direction": "up"}
    replies = {
        "hermes": [
            "Going up.\n" + hermes.format([ToolCall("move", up)]),
            " lead <tool_call>{bad</tool_call>",
            "plain answer  ",
            f"a {hermes.format([ToolCall('move', up)])} then more",
            "x <tool_ca",
        ],
        "qwen3_coder": [
            "Up. " + call_format("qwen3_coder").format([ToolCall("move", up)]),
            "<tool_call><function=move>",
        ],
        "pythonic": [
            pythonic.format([ToolCall("move", up)]),
            " " + pythonic.format([ToolCall("move", up)]),
            "Sure " + pythonic.format([ToolCall("move", up)]),
            "<|python_start|>" + pythonic.format([ToolCall("move", up)]) + "<|python_end|>",
            "[broken",
        ],
        "mistral": [
            "Going up." + call_format("mistral").format([ToolCall("move", up)]),
            " lead [TOOL_CALLS]move[ARGS]{bad",
            "x [TOOL_CA",
            "plain answer",
        ],
        "mistral_json": [call_format("mistral_json").format([ToolCall("move", up)])],
        "llama3_json": [
            llama.format([ToolCall("move", up)]),
            "Hi " + llama.format([ToolCall("move", up)]),
            "{bad",
        ],
    }
    for name, texts in replies.items():
        chat = ChatFormat(smol_tokenizer, name)
        for text in texts:
            message, _ = completion_message(chat, text, [MOVE], "stop")
            final = message["content"] or ""
            for k in range(len(text) + 1):
                assert final.startswith(chat.tool_format.settled(text[:k])), (name, text, k)
            if text.startswith(("plain", "Sure", "Hi")):  # plain content, settled as written
                assert chat.tool_format.settled(text) == text.rstrip() == final.rstrip()
