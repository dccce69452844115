"""Spec errors name the request field the client sent (response_format, guided_*, structured_outputs, tools), in
the message and as `param`; response_format's json_schema.strict is read and checked."""
from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.structured_request import StructuredRequestError, structured_outputs_from_request
from pagedllm.entrypoints.openai.tool_calling import plan_tools, tool_structured_outputs
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.params import SpecError, StructuredOutputsParams

BAD = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
MSGS = [{"role": "user", "content": "hi"}]


def _request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MSGS, **body)


@pytest.mark.parametrize("body, where, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}},
     "response_format.json_schema.schema", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD, "strict": True}}},
     "response_format.json_schema.schema", "response_format"),
    ({"guided_json": BAD}, "guided_json", "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "guided_regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "guided_grammar"),
    ({"structured_outputs": {"json": BAD}}, "structured_outputs.json", "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "structured_outputs"),
    ({"guided_json": {"anyOf": []}}, "guided_json", "guided_json"),  # the satisfiability check
])
@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
def test_engine_validation_names_the_field(body: dict, where: str, param: str, backend: str) -> None:
    params = structured_outputs_from_request(_request(**body))
    manager = StructuredOutputManager("unused", 64, [0], config={"backend": backend})
    with pytest.raises(SpecError) as e:
        manager.validate(params)
    assert str(e.value).startswith(f"Invalid {where}: ") and e.value.param == param


def test_guided_choice_and_shape_errors_name_the_field() -> None:
    with pytest.raises(StructuredRequestError, match="^guided_choice must be a non-empty list") as e:
        structured_outputs_from_request(_request(guided_choice=[]))
    assert e.value.param == "guided_choice"
    with pytest.raises(StructuredRequestError, match="^guided_json holds the integer") as e:
        structured_outputs_from_request(_request(guided_json={"maximum": 10 ** 30}))
    assert e.value.param == "guided_json"
    assert structured_outputs_from_request(_request(guided_choice=["a"])).where == "guided_choice"
    with pytest.raises(StructuredRequestError, match="^guided_whitespace_pattern is only supported") as e:
        structured_outputs_from_request(_request(guided_json={"type": "object"}, guided_whitespace_pattern=" "))
    assert e.value.param == "guided_whitespace_pattern"
    # a client cannot set the origin through structured_outputs
    with pytest.raises(StructuredRequestError, match="Unknown structured_outputs field"):
        structured_outputs_from_request(_request(structured_outputs={"regex": "a", "origin": "x"}))


def test_tool_choice_grammars_name_the_tools() -> None:
    # A schema of the right shape that no grammar compiles (an unclosed regex group): the compile error names the
    # tool (a malformed one, BAD, is refused earlier, by plan_tools, naming it too).
    unclosed = {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g", "parameters": unclosed}}]
    with pytest.raises(ValueError, match=r"^Invalid tools\[1\]\.function\.parameters: properties\.a\.type"):
        plan_tools([tools[0], {"type": "function", "function": {"name": "g", "parameters": BAD}}], "auto", None, "auto",
                   None)
    named = tool_structured_outputs(plan_tools(tools, {"type": "function", "function": {"name": "g"}}, None, "auto",
                                               None))
    required = tool_structured_outputs(plan_tools(tools, "required", None, "auto", None))
    manager = StructuredOutputManager("unused", 64, [0])
    for so, where in ((named, "tools[1].function.parameters"), (required, "tools")):
        with pytest.raises(SpecError) as e:
            manager.validate(so)
        assert str(e.value).startswith(f"Invalid {where}: ") and e.value.param == "tools"


def test_a_shared_compile_error_is_worded_for_each_request() -> None:
    """Equal specs share one compile; its error names each request's own field."""
    first = StructuredOutputsParams(regex="a", origin="guided_regex")
    error = SpecError(first, "it matches no text at all")
    other = error.for_params(StructuredOutputsParams(regex="a"))
    assert str(error) == "Invalid guided_regex: it matches no text at all" and error.param == "guided_regex"
    assert str(other) == "Invalid structured_outputs.regex: it matches no text at all"
    assert other.param == "structured_outputs"


@pytest.mark.parametrize("strict", ["yes", 1, {}])
def test_response_format_strict_must_be_a_boolean(strict) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": strict}}
    with pytest.raises(StructuredRequestError, match="response_format.json_schema.strict must be true or false") as e:
        structured_outputs_from_request(_request(response_format=rf))
    assert e.value.param == "response_format"


def test_rejected_request_keeps_its_param_in_the_response() -> None:
    import json

    from pagedllm.entrypoints.async_engine import RequestRejected
    from pagedllm.entrypoints.openai.app import handled_error_response

    response = handled_error_response(RequestRejected("Invalid guided_json: bad", 400, "guided_json"))
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and error["param"] == "guided_json" and error["message"].startswith("Invalid")


def test_response_format_strict_keeps_the_schema_as_documented() -> None:
    """strict true, false or absent: one spec (objects that list properties are closed unless the schema says
    otherwise, as vLLM's default xgrammar; docs/architecture.md)."""
    from pagedllm.structured_output.backend import strict_objects

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    keys = set()
    for strict in (True, False, None):
        spec = {"name": "x", "schema": schema, **({} if strict is None else {"strict": strict})}
        params = structured_outputs_from_request(_request(response_format={"type": "json_schema", "json_schema": spec}))
        keys.add(params.key())
    assert len(keys) == 1
    assert strict_objects(schema)["additionalProperties"] is False
    assert "additionalProperties" not in strict_objects({"type": "object"})
    assert strict_objects(dict(schema, additionalProperties=True))["additionalProperties"] is True
