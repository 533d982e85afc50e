"""Native tool calling: tool schemas, the calls a policy writes, and their parsers.

An env declares its tools with `Env.tools()`: OpenAI-style function schemas
(`{"type": "function", "function": {"name", "description", "parameters"}}`) or plain Python
functions with type hints and a Google-style docstring, turned into schemas by
`transformers.utils.get_json_schema`. The policy writes calls in its own format; a parser chosen
by name reads them back:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2.5/Qwen3 and
  Hermes emit it; several blocks make several calls.
- `llama3_json`: a bare JSON object `{"name": ..., "parameters": {...}}` (Llama 3.x), optionally
  after `<|python_tag|>`; several objects separated by `;` or newlines.
- `pythonic`: a Python list of calls, `[move(direction="up"), submit()]` (Llama 3.2/4).
- `qwen3_coder`: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>`, a tag for each parameter with its value written raw (Qwen3-Coder); values are read
  back in the types the tool's schema declares.
- `mistral`: `[TOOL_CALLS]NAME[ARGS]{...}` for each call (Mistral's tokenizers from v11 on,
  whose vocabulary has an `[ARGS]` token); `mistral_json`: `[TOOL_CALLS][{"name": ...,
  "arguments": {...}}, ...]` (the earlier ones: Mistral 7B Instruct v0.3, Mixtral 8x22B, Mistral
  Nemo). Each reads both.
- `text`: no parsing; the env reads the free text itself (every env before tools).

A parsed turn reaches `Env.step` as a `ToolAction`: a `str` holding the raw text, so envs that
read text keep working, with `.calls` (name, arguments) and `.error` (why the turn is not a
well-formed call: bad JSON, an unknown tool, arguments that fail the schema, no call at all).
Arguments are checked with `jsonschema` when it is installed, else with the subset of JSON
Schema that function signatures use (required, type, enum, additionalProperties).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentree.registry import Registry

ToolSpec = dict[str, Any] | Callable[..., Any]
"""What `Env.tools()` may list: an OpenAI function schema or a documented Python function."""


@dataclass(frozen=True)
class ToolCall:
    """One function call: its name and JSON arguments (`id` as the OpenAI API numbers it)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI `tool_calls` entry (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }

    def readable(self) -> str:
        """`name(key=value, ...)`: how judges, PRMs and the viewer show the call."""
        args = ", ".join(f"{k}={json.dumps(v)}" for k, v in self.arguments.items())
        return f"{self.name}({args})"


class ToolAction(str):
    """The raw text of a turn (it *is* that string) with the calls parsed from it.

    `calls` holds the well-formed calls in order; `error` says, in one sentence the policy can
    act on, why the turn is not a well-formed call (then `calls` may still hold the ones before
    the bad one, but envs should treat the turn as invalid).
    """

    calls: tuple[ToolCall, ...]
    error: str | None

    def __new__(
        cls, text: str, calls: Sequence[ToolCall] = (), error: str | None = None
    ) -> ToolAction:
        obj = super().__new__(cls, text)
        obj.calls = tuple(calls)
        obj.error = error
        return obj

    def readable(self) -> str:
        """The calls as `name(args)` lines, or the raw text when there are none."""
        return "\n".join(c.readable() for c in self.calls) if self.calls else str(self)


# -- schemas ------------------------------------------------------------------------------------
def tool_schema(spec: ToolSpec) -> dict[str, Any]:
    """An OpenAI function schema from a schema (checked) or a documented Python function."""
    if callable(spec) and not isinstance(spec, dict):
        # deferred: transformers is heavy and only function-declared tools need its converter
        from transformers.utils import get_json_schema

        try:
            return get_json_schema(spec)
        except Exception as e:  # its errors name the missing docstring/type hint
            raise ValueError(f"tool {getattr(spec, '__name__', spec)!r}: {e}") from None
    fn = spec.get("function", spec) if isinstance(spec, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(
            f"a tool must be a function schema like {{'type': 'function', 'function': "
            f"{{'name': ..., 'parameters': {{...}}}}}} or a typed Python function, got {spec!r}"
        )
    fn = dict(fn)
    fn.setdefault("parameters", {"type": "object", "properties": {}})
    return {"type": "function", "function": fn}


def tool_schemas(specs: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """`tool_schema` of each spec; two tools with one name are an error."""
    out = [tool_schema(s) for s in specs]
    names = [s["function"]["name"] for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    return out


def check_call(call: ToolCall, schemas: Sequence[dict[str, Any]]) -> str | None:
    """Why `call` does not fit the declared tools (one sentence), or None when it does."""
    by_name = {s["function"]["name"]: s["function"] for s in schemas}
    if call.name not in by_name:
        return f"unknown tool {call.name!r}; the tools are: {', '.join(sorted(by_name))}."
    params = by_name[call.name].get("parameters") or {"type": "object"}
    problem = _schema_problem(call.arguments, params)
    return None if problem is None else f"bad arguments for {call.name}: {problem}."


def _schema_problem(args: dict[str, Any], schema: dict[str, Any]) -> str | None:
    try:
        # deferred: jsonschema is optional; without it a built-in subset does the check
        import jsonschema
    except ImportError:
        return _subset_problem(args, schema, "")
    errors = sorted(
        jsonschema.Draft202012Validator(schema).iter_errors(args), key=lambda e: list(e.path)
    )
    if not errors:
        return None
    e = errors[0]
    where = "/".join(str(p) for p in e.path)
    return f"{where}: {e.message}" if where else e.message


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _of_type(value: Any, json_type: str) -> bool:
    """`value` is of the JSON Schema type (a bool is no integer or number; unknown types pass)."""
    if json_type in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _JSON_TYPES.get(json_type, (object,)))


def _subset_problem(value: Any, schema: dict[str, Any], where: str) -> str | None:
    """The JSON Schema subset that function signatures use: type, enum, required,
    properties, additionalProperties, items."""
    prefix = f"{where}: " if where else ""
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else list(types)
        ok = any(_of_type(value, t) for t in allowed)
        if not ok:
            return f"{prefix}{value!r} is not of type {', '.join(map(repr, allowed))}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{prefix}{value!r} is not one of {schema['enum']}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                return f"{prefix}{key!r} is a required property"
        props = schema.get("properties", {})
        for key, v in value.items():
            if key in props:
                problem = _subset_problem(v, props[key], f"{where}/{key}".lstrip("/"))
                if problem:
                    return problem
            elif schema.get("additionalProperties") is False:
                return f"{prefix}Additional properties are not allowed ({key!r} was unexpected)"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            problem = _subset_problem(v, schema["items"], f"{where}/{i}".lstrip("/"))
            if problem:
                return problem
    return None


# -- parsers ------------------------------------------------------------------------------------
class CallFormat:
    """How one family of models writes calls: `parse` reads a turn, `format` writes calls.

    `parse` only splits the text into calls (raising `ValueError` with a readable reason on a
    malformed one); `parse_action` adds the checks against the declared tools.
    """

    name = "text"
    generic_prompt: str | None = None
    """Prompt template (under `agentree/prompts/`) that teaches this format to a model whose
    chat template cannot render tools; None for `text`."""

    def parse(self, text: str, schemas: Sequence[dict[str, Any]] = ()) -> list[ToolCall]:
        """The calls in `text`. `schemas` are the declared tools, for formats that write values
        untyped and read them back in the schema's types (`qwen3_coder`); the others ignore it."""
        raise NotImplementedError

    def format(self, calls: Sequence[ToolCall]) -> str:
        raise NotImplementedError

    def content(self, text: str) -> str:
        """The text of a turn around its calls (an API reply's `content`): none where the calls
        are the whole turn, as in the JSON and Python formats."""
        return ""

    _opener = ""
    """How calls begin: the first character of a turn that is calls (after `_tags` and
    spaces) in the JSON and Python formats, the tag that opens each call in Hermes'."""
    _tags: tuple[str, ...] = ()
    """Markers the format allows around its calls, read as nothing."""

    def _untagged(self, text: str) -> str:
        for tag in self._tags:
            text = text.replace(tag, "")
        return text.strip()

    def settled(self, text: str) -> str:
        """The start of a reply's `content` that no continuation of `text` can change, for
        streaming it while the rest is generated: a reply is either plain content (the whole
        text) or calls with `content(text)` around them, and what is returned starts both. In
        the JSON and Python formats a turn is calls from its first character on, so nothing
        is settled until a first character that is neither the opener nor part of a tag."""
        body = self._untagged(text)
        if not body or body.startswith(self._opener) or held_back(body, self._tags) == len(body):
            return ""
        return text

    def parse_action(self, text: str, schemas: Sequence[dict[str, Any]]) -> ToolAction:
        """`text` with its calls, or with the first reason it is not a well-formed call."""
        try:
            calls = self.parse(text, schemas)
        except ValueError as e:
            return ToolAction(text, (), f"malformed tool call: {e}.")
        if not calls:
            names = ", ".join(s["function"]["name"] for s in schemas)
            return ToolAction(text, (), f"no tool call found; call one of: {names}.")
        calls = [ToolCall(c.name, c.arguments, c.id or f"call_{i}") for i, c in enumerate(calls)]
        for i, call in enumerate(calls):
            problem = check_call(call, schemas)
            if problem is not None:
                return ToolAction(text, calls[:i], problem)
        return ToolAction(text, calls)


class TextFormat(CallFormat):
    """Free-text actions: the env parses the text (no calls are read here)."""

    name = "text"

    def parse(self, text: str, schemas: Sequence[dict[str, Any]] = ()) -> list[ToolCall]:
        return []

    def format(self, calls: Sequence[ToolCall]) -> str:
        raise ValueError(
            "the text format has no tool calls; pick one of "
            + ", ".join(n for n in CALL_FORMATS.names() if n != "text")
        )

    def settled(self, text: str) -> str:
        return text


def held_back(text: str, marks: Sequence[str]) -> int:
    """How many characters at the end of `text` may be the start of one of `marks` (the
    longest such suffix, shorter than the mark): what a stream holds back until the next
    token says whether the mark is there."""
    return max(
        (
            k
            for m in marks
            for k in range(min(len(m) - 1, len(text)), 0, -1)
            if text.endswith(m[:k])
        ),
        default=0,
    )


def _call_from_json(obj: Any, arg_keys: tuple[str, ...]) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError('a call must be a JSON object with a string "name"')
    key = next((k for k in arg_keys if k in obj), None)
    args = obj.get(key, {}) if key else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string, as the API does
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"the arguments of {obj['name']} are not JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise ValueError(f"the arguments of {obj['name']} must be a JSON object")
    return ToolCall(obj["name"], args)


class HermesFormat(CallFormat):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen, Hermes)."""

    name = "hermes"
    generic_prompt = "tools/hermes.txt"
    _opener = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str, schemas: Sequence[dict[str, Any]] = ()) -> list[ToolCall]:
        return [self._call(body, schemas) for body in self._BLOCK.findall(text)]

    def _call(self, body: str, schemas: Sequence[dict[str, Any]]) -> ToolCall:
        """The call in one `<tool_call>` block's body."""
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            raise ValueError(f"the <tool_call> body is not JSON ({e.msg})") from None
        return _call_from_json(obj, ("arguments", "parameters"))

    def format(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(f"<tool_call>\n{self._body(c)}\n</tool_call>" for c in calls)

    def _body(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "arguments": call.arguments})

    def content(self, text: str) -> str:
        return self._BLOCK.sub("", text).strip()

    def settled(self, text: str) -> str:
        return settled_before(text, self._opener)


def settled_before(text: str, opener: str) -> str:
    """What of `text` is settled where calls begin with `opener` and the content is the text
    around them: the text before the first `opener` (or the start of one), without its trailing
    spaces, which `content` strips when calls follow; nothing while the text starts with a
    space, which `content` strips too and plain content keeps."""
    start = text.find(opener)
    head = text[:start] if start >= 0 else text[: len(text) - held_back(text, [opener])]
    return head.rstrip() if head == head.lstrip() else ""


class Qwen3CoderFormat(HermesFormat):
    """`<tool_call>` blocks holding `<function=NAME>` and a `<parameter=KEY>` tag for each value
    (Qwen3-Coder), as its chat template writes a call:

        <tool_call>
        <function=file_editor>
        <parameter=command>
        view
        </parameter>
        <parameter=view_range>
        [1, 20]
        </parameter>
        </function>
        </tool_call>

    A value is written raw (a string as it is, over as many lines as it has; an object or a list
    as JSON; another scalar as the template's `string` filter writes it), one newline after the
    opening tag and one before the closing tag belonging to the markup. So the text alone does
    not say `5` from `"5"`: a value is read back in the type the tool's schema declares for its
    parameter (integer, number, boolean, null, or object/array as JSON or a Python literal), and
    stays a string where the schema says string, names no type, or the text is not of the type
    (which the schema check then reports).
    """

    name = "qwen3_coder"
    generic_prompt = "tools/qwen3_coder.txt"
    _FUNCTION = re.compile(r"<function=([^>]*)>(.*?)(?:</function>|$)", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)

    def _call(self, body: str, schemas: Sequence[dict[str, Any]]) -> ToolCall:
        m = self._FUNCTION.search(body)
        if m is None:
            raise ValueError("a <tool_call> must hold <function=NAME> ... </function>")
        name = m.group(1).strip()
        if not name:
            raise ValueError("<function=...> names no function")
        props = _properties(name, schemas)
        args: dict[str, Any] = {}
        for key, raw in self._PARAMETER.findall(m.group(2)):
            key = key.strip()
            if key in args:
                raise ValueError(f"{name}: parameter {key!r} is given twice")
            value = raw[1:] if raw.startswith("\n") else raw
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _typed(value, props.get(key))
        return ToolCall(name, args)

    def _body(self, call: ToolCall) -> str:
        params = "".join(
            f"<parameter={k}>\n{_raw(v)}\n</parameter>\n" for k, v in call.arguments.items()
        )
        return f"<function={call.name}>\n{params}</function>"


def _properties(name: str, schemas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The declared parameters of tool `name` ({} for an undeclared tool)."""
    for s in schemas:
        if s["function"]["name"] == name:
            return (s["function"].get("parameters") or {}).get("properties") or {}
    return {}


def _raw(value: Any) -> str:
    """A value as Qwen3-Coder's template writes it: JSON for objects and lists, else `str`."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) else str(value)


def _typed(text: str, schema: dict[str, Any] | None) -> Any:
    """`text` read as JSON or a Python literal, if that is of a type the parameter's schema
    declares (its `type`, or the types of its `anyOf`/`oneOf` branches, as pydantic writes
    `int | None`) other than string; else the text itself."""
    schema = schema or {}
    types: list[str] = []
    for part in [schema, *schema.get("anyOf", []), *schema.get("oneOf", [])]:
        declared = part.get("type") if isinstance(part, dict) else None
        types += [declared] if isinstance(declared, str) else list(declared or [])
    types = [t for t in types if t in _JSON_TYPES and t != "string"]
    value = _literal(text.strip()) if types else _UNREAD
    if value is not _UNREAD and any(_of_type(value, t) for t in types):
        return value
    return text


_UNREAD = object()
"""What `_literal` returns for text that is neither JSON nor a Python literal."""


def _literal(text: str) -> Any:
    """`text` as JSON, else as a Python literal (`True`, `{'a': 1}`, `None`), else `_UNREAD`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return _UNREAD


class Llama3JsonFormat(CallFormat):
    """`{"name": ..., "parameters": {...}}` objects (Llama 3.x JSON tool calling)."""

    name = "llama3_json"
    generic_prompt = "tools/llama3_json.txt"
    _opener = "{"
    _tags = ("<|python_tag|>",)

    def parse(self, text: str, schemas: Sequence[dict[str, Any]] = ()) -> list[ToolCall]:
        body = self._untagged(text)
        if not body.startswith(self._opener):
            return []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError as e:
                raise ValueError(f"the call is not JSON ({e.msg} at character {e.pos})") from None
            calls.append(_call_from_json(obj, ("parameters", "arguments")))
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return calls

    def format(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


class PythonicFormat(CallFormat):
    """`[name(arg=value, ...), ...]`: a Python list of calls with literal keyword arguments."""

    name = "pythonic"
    generic_prompt = "tools/pythonic.txt"
    _opener = "["
    _tags = ("<|python_start|>", "<|python_end|>")

    def parse(self, text: str, schemas: Sequence[dict[str, Any]] = ()) -> list[ToolCall]:
        body = self._untagged(text)
        if not body.startswith(self._opener):
            return []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError as e:
            raise ValueError(f"the call list is not valid Python ({e.msg})") from None
        if not isinstance(tree, ast.List):
            raise ValueError("the calls must be one Python list, e.g. [name(arg=value)]")
        return [self._call(node) for node in tree.elts]

    @staticmethod
    def _call(node: ast.expr) -> ToolCall:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError(f"{ast.unparse(node)!r} is not a call like name(arg=value)")
        if node.args:
            raise ValueError(f"{node.func.id} takes keyword arguments only (arg=value)")
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError(f"{node.func.id}: **kwargs are not allowed")
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                raise ValueError(
                    f"{node.func.id}({kw.arg}=...) must be a literal, got {ast.unparse(kw.value)}"
                ) from None
        return ToolCall(node.func.id, args)

    def format(self, calls: Sequence[ToolCall]) -> str:
        parts = [
            f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})" for c in calls
        ]
        return "[" + ", ".join(parts) + "]"


class MistralFormat(CallFormat):
    """`[TOOL_CALLS]NAME[ARGS]{...}`, the marker before each call, as Mistral's tokenizers from
    v11 on write a call (those whose vocabulary has an `[ARGS]` token; `[TOOL_CALLS]` and
    `[ARGS]` are control tokens, kept in the text because agentree decodes with special
    tokens), the arguments as `mistral_common` writes them (non-ASCII kept). Also read:
    `[CALL_ID]ID` before `[ARGS]` (the v11 tokenizer writes a call's id there in a
    conversation's history), a `{` straight after the name, and the JSON list the earlier
    tokenizers write (`mistral_json`). The text before the first marker is the reply's
    content; the arguments end with their JSON object, and what a model writes after it until
    the next marker is dropped, as vLLM's Mistral parser drops it."""

    name = "mistral"
    generic_prompt = "tools/mistral.txt"
    _opener = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([^\s\[{]+)\s*(?:\[CALL_ID\]\s*([^\s\[{]*)\s*)?(?:\[ARGS\])?")

    def parse(self, text: str, schemas: Sequence[dict[str, Any]] = ()) -> list[ToolCall]:
        start = text.find(self._opener)
        if start < 0:
            return []
        parts = text[start + len(self._opener) :].split(self._opener)
        return [call for part in parts for call in self._calls(part)]

    def _calls(self, part: str) -> list[ToolCall]:
        """The calls after one marker: a JSON list (or object) of calls, or NAME[ARGS]{...}."""
        body = part.strip()
        if body.startswith(("[", "{")):
            found = _first_json(body, f"the calls after {self._opener}")
            items = found if isinstance(found, list) else [found]
            if not items:
                raise ValueError(f"the list after {self._opener} holds no call")
            return [_with_id(_call_from_json(item, ("arguments",)), item) for item in items]
        m = self._NAMED.match(part)
        if m is None or not part[m.end() :].strip():
            name = m.group(1) if m else "the call"
            raise ValueError(f"{name} has no arguments: write {self._opener}NAME[ARGS]{{...}}")
        name, call_id = m.group(1), m.group(2)
        args = _first_json(part[m.end() :].strip(), f"the arguments of {name}")
        if not isinstance(args, dict):
            raise ValueError(f"the arguments of {name} must be a JSON object")
        return [ToolCall(name, args, call_id or "")]

    def format(self, calls: Sequence[ToolCall]) -> str:
        return "".join(f"{self._opener}{c.name}[ARGS]{_json(c.arguments)}" for c in calls)

    def content(self, text: str) -> str:
        return text.split(self._opener, 1)[0].strip()

    def settled(self, text: str) -> str:
        return settled_before(text, self._opener)


class MistralJsonFormat(MistralFormat):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`: one marker, then every call of the
    turn as a JSON list, as Mistral's tokenizers before v11 write calls (Mistral 7B Instruct
    v0.3, Mixtral 8x22B, Mistral Nemo). Reads what `mistral` reads."""

    name = "mistral_json"
    generic_prompt = "tools/mistral_json.txt"

    def format(self, calls: Sequence[ToolCall]) -> str:
        return self._opener + _json([{"name": c.name, "arguments": c.arguments} for c in calls])


def _json(value: Any) -> str:
    """JSON as Mistral's tokenizers write it (`mistral_common`): other characters than ASCII as
    they are, not escaped."""
    return json.dumps(value, ensure_ascii=False)


def _first_json(text: str, what: str) -> Any:
    """The JSON value `text` starts with (what follows it is not read)."""
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} are not JSON ({e.msg} at character {e.pos})") from None


def _with_id(call: ToolCall, obj: dict[str, Any]) -> ToolCall:
    """`call` with the id its JSON object gives, if any."""
    given = obj.get("id")
    return ToolCall(call.name, call.arguments, given) if isinstance(given, str) else call


CALL_FORMATS: Registry[type[CallFormat]] = Registry(
    "tool call format",
    CallFormat,
    {
        "text": "agentree.tools:TextFormat",
        "hermes": "agentree.tools:HermesFormat",
        "llama3_json": "agentree.tools:Llama3JsonFormat",
        "pythonic": "agentree.tools:PythonicFormat",
        "qwen3_coder": "agentree.tools:Qwen3CoderFormat",
        "mistral": "agentree.tools:MistralFormat",
        "mistral_json": "agentree.tools:MistralJsonFormat",
    },
)


def call_format(name: str) -> CallFormat:
    """The parser registered as `name` (text, hermes, llama3_json, pythonic, qwen3_coder,
    mistral, mistral_json or module:Class)."""
    return CALL_FORMATS.get(name)()


def written_format(name: str) -> CallFormat:
    """The format calls are written and read in under `policy.tool_format` `name`: that format,
    or Hermes for `text` (an env with tools then reads the generic rendering's Hermes calls)."""
    fmt = call_format(name)
    return fmt if fmt.generic_prompt else HermesFormat()


def as_tool_action(
    action: str, schemas: Sequence[dict[str, Any]], fmt: str = "hermes"
) -> ToolAction:
    """`action` parsed against `schemas` (already parsed actions pass through).

    Envs call this in `step`: the rollout parses with the configured format, while scripted
    policies and `check_env` hand plain text, read in `fmt` (the generic rendering's format).
    """
    if isinstance(action, ToolAction):
        return action
    return call_format(fmt).parse_action(action, schemas)


def example_calls(env: Any) -> list[tuple[ToolCall, ...]]:
    """The calls of each of `env`'s example actions that is a well-formed call of its tools
    (written as scripted policies write them); none for an env without tools."""
    schemas = tool_schemas(env.tools())
    if not schemas:
        return []
    actions = [as_tool_action(a, schemas) for a in env.example_actions()]
    return [a.calls for a in actions if a.calls and a.error is None]


def readable_action(action: str | None, info: dict[str, Any]) -> str:
    """A tree node's action for a reader (judge, PRM, viewer): its tool calls as `name(args)`
    lines when the turn made any (the rollout records them in `info["tool_calls"]`), else the
    action text."""
    calls = info.get("tool_calls")
    if not calls:
        return action or ""
    return "\n".join(ToolCall(c["name"], c.get("arguments") or {}).readable() for c in calls)
