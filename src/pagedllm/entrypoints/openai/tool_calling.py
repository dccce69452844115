"""Tool calling around one chat request: check tools / tool_choice, put the tools into the prompt, turn
"required" and named choices into a grammar, and turn the output back into OpenAI tool calls.

  tool_choice "none"       tools go into the prompt as for "auto" (vLLM's default; show_unused=False: left out);
                           the output is content
  tool_choice "auto"       tools go into the chat template; the parser reads whatever the model writes
  tool_choice "required"   the grammar forces a JSON list of >= 1 calls [{"name": ..., "arguments": {...}}]
  named function           the grammar forces that function's arguments (its JSON schema)

Chat templates that do not take `tools` (SmolLM2's) get the tools described in a system message in the hermes
format, and earlier calls / results written the same way, so every model sees them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.entrypoints.openai.chat_template import message_text
from pagedllm.entrypoints.openai.tool_parsers import (ExtractedToolCalls, ToolCall, ToolParser, detect_tool_parser,
                                                      get_tool_parser, make_call_id, make_mistral_call_id)
from pagedllm.structured_output.params import StructuredOutputsParams


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolPlan:
    """What one request does with tools (mode: none | auto | required | named)."""

    mode: str
    tools: list[dict] = field(default_factory=list)
    named: Optional[str] = None
    parallel: bool = True
    parser: Optional[ToolParser] = None
    mistral_ids: bool = False  # the mistral format: call ids of 9 alphanumeric characters (its templates check them)

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def call_id(self) -> str:
        return make_mistral_call_id() if self.mistral_ids else make_call_id()


def _function(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            tool.get("function"), dict):
        raise ToolRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}.", "tools")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolRequestError(f"tools[{i}].function.name must be a non-empty string.", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ToolRequestError(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):  # as response_format's strict
        raise ToolRequestError(f"tools[{i}].function.strict must be true or false, got {fn['strict']!r:.40}.", "tools")
    kind = (params or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        # Arguments are a JSON object (OpenAI's shape): a grammar from another type would write a string or a
        # number where clients parse an object.
        raise ToolRequestError(f"tools[{i}].function.parameters must describe an object (type 'object'), got type "
                               f"{kind!r}.", "tools")
    return {"type": "function", "function": fn}


def plan_tools(tools: Optional[list], tool_choice: Any, parallel_tool_calls: Optional[bool], parser_name: str,
               chat_template: Optional[str], show_unused: bool = True) -> ToolPlan:
    """Validate tools / tool_choice (ToolRequestError -> 400) and decide what to do. show_unused: tool_choice
    "none" still puts the tools into the prompt (vLLM's default, --exclude-tools-when-tool-choice-none off)."""
    tools = [_function(t, i) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in tools]
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:  # a call names its function: two of one name would be ambiguous (OpenAI refuses them too)
            raise ToolRequestError(f"tools[{i}].function.name {name!r} duplicates tools[{seen[name]}]'s: function "
                                   "names must be unique.", "tools")
        seen[name] = i
    check_schemas(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if tool_choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolRequestError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                   "'function': {'name': ...}}.", "tool_choice")
        if not tools:
            raise ToolRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if name not in names:
            raise ToolRequestError(f"tool_choice names the function {name!r}, which is not in tools "
                                   f"({', '.join(names)}).", "tool_choice")
        return ToolPlan("named", tools, named=name, parallel=parallel_tool_calls is not False,
                        mistral_ids=_parser_name(parser_name, chat_template) == "mistral")
    if tool_choice not in ("none", "auto", "required"):
        raise ToolRequestError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}.",
                               "tool_choice")
    if tool_choice != "none" and not tools:
        raise ToolRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if tool_choice == "none":
        return ToolPlan("none", tools if show_unused else [])
    plan = ToolPlan(tool_choice, tools, parallel=parallel_tool_calls is not False,
                    mistral_ids=_parser_name(parser_name, chat_template) == "mistral")
    if tool_choice == "auto":
        try:
            plan.parser = get_tool_parser(parser_name, tools, chat_template)
        except ValueError as e:
            raise ToolRequestError(str(e), "tool_choice") from None
    return plan


def _parser_name(name: str, chat_template: Optional[str]) -> str:
    return detect_tool_parser(chat_template) if name == "auto" else name


def _parameters(tool: dict) -> dict:
    """The parameters as the grammar's schema: always an object. A nullable root ("type": ["object", "null"]) or
    one with no type would let the model write `null` or a number as the arguments, where clients parse an object."""
    params = tool["function"].get("parameters") or {"type": "object", "properties": {}}
    if params.get("type") != "object":
        params = dict(params, type="object")
    for key in ("anyOf", "oneOf"):  # (the backend does not intersect a sibling "type" with these: drop the branches)
        branches = params.get(key)
        if isinstance(branches, list):
            kept = [b for b in branches if not _not_object(b)]
            if kept and len(kept) < len(branches):
                params = dict(params, **{key: kept})
    return params


def _not_object(schema: Any) -> bool:
    """A schema whose own type rules an object out ({"type": "null"}, Optional's other branch)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind)


def _self_refs(schema: Any, base: str) -> tuple[Any, bool]:
    """(schema with its references to its own root ("#", "#/properties/...") pointing at base instead, whether
    there were any). References into $defs / definitions stay: those move to the joined schema's root."""
    if isinstance(schema, list):
        pairs = [_self_refs(s, base) for s in schema]
        return [p[0] for p in pairs], any(p[1] for p in pairs)
    if not isinstance(schema, dict):
        return schema, False
    out, found = {}, False
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")) \
                and not v.startswith(("#/$defs/", "#/definitions/")):
            out[k], found = base + v[1:], True
        elif k in ("enum", "const", "default", "examples"):  # values, not schemas
            out[k] = v
        else:
            out[k], sub = _self_refs(v, base)
            found = found or sub
    return out, found


def _check_callable(plan: ToolPlan) -> None:
    """ValueError naming the function whose parameters no arguments satisfy (the engine would refuse the joined
    schema without saying which function's it is)."""
    from pagedllm.structured_output.backend import endless_recursion, strict_objects, unsatisfiable_reason

    for i, t in enumerate(plan.tools):
        if plan.mode == "named" and t["function"]["name"] != plan.named:
            continue
        reason = endless_recursion(_parameters(t)) or unsatisfiable_reason(strict_objects(_parameters(t)))
        if reason is not None:
            raise ValueError(f"tools[{i}].function.parameters admit no arguments at all ({reason}), so "
                             f"{t['function']['name']!r} cannot be called.")


_JSON_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "not", "contains", "propertyNames", "if", "then",
              "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def schema_problem(schema: Any, where: str = "") -> Optional[str]:
    """Why `schema` is no JSON schema (the first malformed keyword, named by its path under `where`), or None. Only
    the shape of the keywords is checked (what the JSON Schema meta-schema requires of them), not whether a grammar
    backend enforces them: under tool_choice "auto" a schema is only shown to the model."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where or 'the schema'} must be a JSON schema (an object or a boolean), got {schema!r:.60}"
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        bad = [k for k in kinds if not isinstance(k, str) or k not in _JSON_TYPES]
        if bad or not kinds:
            return (f"{_at(where, 'type')} must be one of {', '.join(sorted(_JSON_TYPES))} (or a list of them), "
                    f"got {kind!r:.60}")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        return f"{_at(where, 'required')} must be a list of property names, got {required!r:.60}"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{_at(where, 'enum')} must be a list, got {schema['enum']!r:.60}"
    if "$ref" in schema and not isinstance(schema["$ref"], str):
        return f"{_at(where, '$ref')} must be a string, got {schema['$ref']!r:.60}"
    for key in _COUNTS:
        value = schema.get(key)  # (5.0 is an integer to JSON Schema)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or (isinstance(value, float) and not value.is_integer()) or value < 0):
            return f"{_at(where, key)} must be a non-negative integer, got {value!r:.60}"
    for key in _NUMBERS:
        value = schema.get(key)
        if key.startswith("exclusive") and isinstance(value, bool):
            continue  # draft 4's form: a flag on minimum / maximum
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{_at(where, key)} must be a number, got {value!r:.60}"
    for key in _SUBSCHEMA:
        if key in schema:
            sub = schema[key]
            if key == "items" and isinstance(sub, list):  # (draft 4-7 tuple items)
                problem = next((p for j, item in enumerate(sub)
                                if (p := schema_problem(item, f"{_at(where, 'items')}[{j}]"))), None)
            else:
                problem = schema_problem(sub, _at(where, key))
            if problem:
                return problem
    for key in _SCHEMA_MAPS:
        if key in schema:
            subs = schema[key]
            if not isinstance(subs, dict):
                return f"{_at(where, key)} must be an object of schemas, got {subs!r:.60}"
            for name, sub in subs.items():
                problem = schema_problem(sub, f"{_at(where, key)}.{name}")
                if problem:
                    return problem
    for key in _SCHEMA_LISTS:
        if key in schema:
            subs = schema[key]
            if not isinstance(subs, list) or (not subs and key != "prefixItems"):
                return f"{_at(where, key)} must be a non-empty list of schemas, got {subs!r:.60}"
            for j, sub in enumerate(subs):
                problem = schema_problem(sub, f"{_at(where, key)}[{j}]")
                if problem:
                    return problem
    return None


def check_schemas(tools: list[dict]) -> None:
    """ToolRequestError naming the first function whose parameters are no JSON schema ({"type": "nonsense"}, a
    "required" that is not a list), as OpenAI refuses them whatever the tool_choice: "auto" and "none" compile no
    grammar that would find it, so such a schema went into the prompt and the request answered 200."""
    for i, t in enumerate(tools):
        params = t["function"].get("parameters")
        problem = None if params is None else schema_problem(params)
        if problem:  # (worded as the grammar's spec errors: "Invalid <field>: <reason>")
            raise ToolRequestError(f"Invalid tools[{i}].function.parameters: {problem} (the parameters of "
                                   f"{t['function']['name']!r} must be a JSON schema).", "tools")


def tool_structured_outputs(plan: ToolPlan) -> Optional[StructuredOutputsParams]:
    """The grammar that enforces a "required" / named tool choice (None for none / auto)."""
    if plan.mode in ("named", "required"):
        _check_callable(plan)
    if plan.mode == "named":
        i, tool = next((i, t) for i, t in enumerate(plan.tools) if t["function"]["name"] == plan.named)
        return StructuredOutputsParams(json=_parameters(tool), origin=f"tools[{i}].function.parameters")
    if plan.mode != "required":
        return None
    # The functions' parameters sit inside one schema here, so their local definitions ("$ref": "#/$defs/X", as
    # pydantic writes them) move up to its root, where the refs point (as vLLM does); one name, one definition.
    defs: dict[str, dict] = {}
    variants = []
    for t in plan.tools:
        params = dict(_parameters(t))
        for key in ("$defs", "definitions"):
            if not isinstance(params.get(key), dict):
                continue
            for name, sub in params.pop(key).items():
                if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                    raise ValueError(f"tools: two functions' parameters define {key}/{name} differently; tool_choice "
                                     "'required' joins them in one schema, where a name has one definition.")
        # A reference to the parameters' own root ("$ref": "#", a recursive tree) would point at the joined schema:
        # such parameters become a definition of their own, where the references are redirected.
        own = f"tools_{len(variants)}_parameters"
        moved, found = _self_refs(params, f"#/$defs/{own}")
        if found:
            defs.setdefault("$defs", {})[own] = moved
            params = {"$ref": f"#/$defs/{own}"}
        variants.append({"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                                          "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
    schema.update(defs)
    if not plan.parallel:
        schema["maxItems"] = 1
    # Errors name the tools (their parameters, joined): the client sent no schema of its own.
    return StructuredOutputsParams(json=schema, origin="tools")


# ---- the prompt ------------------------------------------------------------------------------------------


def template_takes_tools(template: Optional[str]) -> bool:
    return bool(template) and "tools" in template


def _hermes_call_text(calls: list[dict]) -> str:
    parts = []
    for call in calls:
        fn = call.get("function", {})
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        parts.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
                     + "\n</tool_call>")
    return "\n".join(parts)


def _tools_system_text(plan: ToolPlan) -> str:
    """The instructions a template without tool support gets, in the form the request's grammar enforces: the hermes
    format the auto parser reads; under "required" the JSON list of calls; under a named choice that function
    alone and its arguments' object (what the grammar makes the model write)."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t["function"]["name"] == plan.named)
        return ("Call the function below, listed between <tools> and </tools> as JSON:\n<tools>\n"
                + json.dumps(tool, ensure_ascii=False) + "\n</tools>\n"
                "Answer with its arguments only, as one JSON object.")
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
    head = ("The functions you may call are listed between <tools> and </tools>, as JSON:\n<tools>\n" + listing
            + "\n</tools>\n")
    if plan.mode == "required":
        one = "" if plan.parallel else " (one call)"
        return ("Call one or more of the functions below to help with the user's request. " + head
                + f"Answer with the calls only, as a JSON list{one}:\n"
                '[{"name": "<function name>", "arguments": {<arguments as JSON>}}]')
    return ("You can call functions to help with the user's request. " + head
            + "To call a function, answer with one JSON object per call, each between <tool_call> and </tool_call>:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>')


def check_tool_call_history(conv: list[dict]) -> None:
    """Each assistant message's earlier tool_calls in OpenAI's shape: {"function": {"name": str, "arguments": JSON
    text or object}} (ToolRequestError naming the first that is not)."""
    for i, m in enumerate(conv):
        for j, call in enumerate(m.get("tool_calls") or ()):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise ToolRequestError(f"{where}.function must be an object with the called function's 'name' and "
                                       "'arguments'.", param=f"{where}.function")
            if not isinstance(fn.get("name"), str):
                raise ToolRequestError(f"{where}.function.name must be a string.", param=f"{where}.function.name")
            if not isinstance(fn.get("arguments", "{}"), (str, dict)):
                raise ToolRequestError(f"{where}.function.arguments must be a JSON string or an object.",
                                       param=f"{where}.function.arguments")


def prepare_conversation(conv: list[dict], plan: ToolPlan, template: Optional[str]
                         ) -> tuple[list[dict], Optional[list]]:
    """(messages, tools for apply_chat_template). Assistant tool_calls and tool results pass to templates that know
    them (arguments as objects, as HF templates expect); other templates get them written in the hermes format."""
    check_tool_call_history(conv)
    native = template_takes_tools(template)
    has_history = any(m.get("tool_calls") or m.get("role") == "tool" for m in conv)
    if native:
        out = []
        for m in conv:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [_with_object_arguments(c) for c in m["tool_calls"]]
            out.append(m)
        return out, (plan.tools or None)
    if not plan.tools and not has_history:
        return conv, None
    out = []
    for m in conv:  # (content may be text parts, chat_template_content_format "openai": message_text joins them)
        m = dict(m)
        if m.get("tool_calls"):
            text = _hermes_call_text(m.pop("tool_calls"))
            m["content"] = (message_text(m.get("content")) + "\n" + text).strip()
        elif m.get("role") == "tool":
            m = {"role": "user", "content": "<tool_response>\n" + message_text(m.get("content")) + "\n</tool_response>"}
        m.pop("tool_call_id", None)
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if plan.tools:
        text = _tools_system_text(plan)
        if out and out[0].get("role") == "system":
            out[0] = dict(out[0], content=message_text(out[0].get("content")) + "\n\n" + text)
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _with_object_arguments(call: dict) -> dict:
    call = json.loads(json.dumps(call))
    fn = call.get("function") or {}
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return call


# ---- the output ------------------------------------------------------------------------------------------


def extract_tool_calls(plan: ToolPlan, text: str, finish_reason: Optional[str]) -> ExtractedToolCalls:
    """The output of a finished choice as content + calls. Never raises: what does not parse is content."""
    result = _extract_tool_calls(plan, text, finish_reason)
    if plan.mistral_ids:
        for call in result.tool_calls:
            call.id = make_mistral_call_id()
    return result


def _extract_tool_calls(plan: ToolPlan, text: str, finish_reason: Optional[str]) -> ExtractedToolCalls:
    if not plan.active:
        return ExtractedToolCalls(content=text)
    if plan.mode == "named":
        if not text:
            return ExtractedToolCalls(content=text)
        # Always the named call, its arguments the generated text itself (what streaming sent as argument deltas),
        # not a re-serialization; cut short (max_tokens, a stop string) they are unfinished and the call stays a
        # call. A forced named call keeps the finish reason the model's stop gave ("stop", not "tool_calls"), as
        # OpenAI and vLLM answer it, streamed or not ("required" and "auto" calls finish "tool_calls").
        return ExtractedToolCalls(content=None, tool_calls=[ToolCall(plan.named, text)], complete=False)
    if finish_reason == "length":
        return ExtractedToolCalls(content=text)
    if plan.mode == "required":
        try:
            items = json.loads(text)
            calls = [ToolCall(i["name"], json.dumps(i.get("arguments", {}), ensure_ascii=False)) for i in items]
        except (ValueError, TypeError, KeyError):
            return ExtractedToolCalls(content=text)
        return ExtractedToolCalls(content=None, tool_calls=calls)
    result = plan.parser.extract(text)
    if not plan.parallel and len(result.tool_calls) > 1:
        # parallel_tool_calls false: one call at most. "auto" has no grammar to stop the model writing more, so the
        # calls after the first are dropped (as vLLM does); streaming reads its calls from here too.
        result.tool_calls = result.tool_calls[:1]
    return result


def finish_reason_with_tools(result: ExtractedToolCalls, finish_reason: Optional[str]) -> Optional[str]:
    return "tool_calls" if result.called and result.complete and finish_reason == "stop" else finish_reason
