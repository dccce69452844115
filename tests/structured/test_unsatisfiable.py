"""Specs no output can satisfy are refused when the request arrives (a 400 with the reason), not compiled into a
grammar that lets the model write anything, or nothing; allOf of several schemas that do not fold into one, which
xgrammar compiles into "any JSON value", goes to llguidance under "auto" and is refused by an explicit xgrammar
backend."""
from __future__ import annotations

import re

import pytest

from pagedllm.structured_output.backend import XGrammarBackend, unsatisfiable_reason
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.params import StructuredOutputsParams

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")


def _manager(backend: str) -> StructuredOutputManager:
    # validate() needs no tokenizer: nothing is loaded here.
    return StructuredOutputManager("unused", 64, [0], config={"backend": backend})


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
@pytest.mark.parametrize("schema, reason", [
    ({"type": "integer", "minimum": 5, "maximum": 3}, "minimum (5) is greater than maximum (3)"),
    ({"enum": []}, "empty"),
    ({"anyOf": []}, "anyOf is empty"),
    ({"type": []}, "empty"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "incompatible types"),
    ({"not": {}}, "false"),
    ({"const": 1, "type": "string"}, "incompatible types"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "required property 'a'"),
    ({"type": "object", "properties": {"a": {"not": True}}, "required": ["a"]}, "required property 'a'"),
    ({"type": "object", "$defs": {"x": {"enum": []}}, "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"]},
     "empty"),
    ({"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 3, "maxLength": 1}}, ""),
])
def test_unsatisfiable_json_schemas_are_refused(backend: str, schema: dict, reason: str) -> None:
    with pytest.raises(ValueError, match="no JSON value satisfies the schema") as e:
        _manager(backend).validate(StructuredOutputsParams(json=schema))
    assert str(e.value).startswith("Invalid structured_outputs.json: ") and reason in str(e.value)


def test_required_property_that_strict_objects_forbid_says_why() -> None:
    """pagedllm closes object schemas that list properties (as vLLM's strict xgrammar): a required property not
    listed is then impossible, and the message says so."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}
    with pytest.raises(ValueError, match="required property 'b'.*unless additionalProperties says so"):
        _manager("auto").validate(StructuredOutputsParams(json=schema))
    schema["additionalProperties"] = True
    assert _manager("auto").validate(StructuredOutputsParams(json=schema)) == "xgrammar"


@pytest.mark.parametrize("schema", [
    {"type": "object"},
    {"type": "object", "properties": {"a": {"not": {}}}},  # an optional property that can never be present
    {"enum": [{"not": {}}]},  # a value, not a schema
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}, "required": ["a"]},
])
def test_satisfiable_schemas_pass(schema: dict) -> None:
    assert unsatisfiable_reason(schema) is None
    _manager("auto").validate(StructuredOutputsParams(json=schema))


def test_all_of_that_does_not_fold_goes_to_llguidance() -> None:
    """allOf subschemas that combine into one schema are folded (xgrammar takes it); what does not fold (two
    patterns), which xgrammar would compile into any value: "auto" takes llguidance, which intersects them; an
    explicit xgrammar backend refuses it, naming the keyword and the way out."""
    folded = StructuredOutputsParams(json={"allOf": [{"type": "integer", "minimum": 1}, {"maximum": 5}]})
    assert _manager("auto").validate(folded) == "xgrammar"
    spec = StructuredOutputsParams(json={"type": "string", "allOf": [{"pattern": "^a"}, {"pattern": "b$"}]})
    assert _manager("auto").validate(spec) == "guidance"
    with pytest.raises(ValueError, match="xgrammar backend does not enforce allOf .*each sets 'pattern'.*guidance"):
        XGrammarBackend.check_enforceable(spec)
    XGrammarBackend.check_enforceable(StructuredOutputsParams(json={"allOf": [{"type": "integer"}]}))


def test_refs_to_other_documents_are_refused() -> None:
    """xgrammar does not fetch a remote $ref and allows any value there; llguidance refuses it: a 400 either way."""
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "other.json#/a"}}})
    for backend in ("auto", "xgrammar"):
        with pytest.raises(ValueError, match="'other.json#/a' points outside the schema"):
            if backend == "auto":
                _manager(backend).validate(spec)
            else:
                XGrammarBackend.check_enforceable(spec)
    XGrammarBackend.check_enforceable(StructuredOutputsParams(json={"$defs": {"a": {}}, "$ref": "#/$defs/a"}))


@pytest.mark.parametrize("schema", [{"not": {"type": "string"}},
                                    {"type": "object", "properties": {"a": {"not": {"const": 1}}}}])
@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
def test_a_not_no_backend_enforces_is_refused(backend: str, schema: dict) -> None:
    """A "not" other than {} / true / false: left out of the satisfiability analysis (never unsatisfiable for it),
    but neither library enforces it (xgrammar once compiled it away: a 200 whose output broke the schema)."""
    assert unsatisfiable_reason(schema) is None
    with pytest.raises(ValueError, match="'not' is not enforced by either backend") as e:
        _manager(backend).validate(StructuredOutputsParams(json=schema, origin="guided_json"))
    assert str(e.value).startswith("Invalid guided_json: ")


@pytest.mark.parametrize("regex, anchor", [("a^b", None), ("a$b", None), ("x|^y", ("^", 2)), ("(^a)b", ("^", 1)),
                                           ("(a$)", ("$", 2))])
def test_regex_mid_anchors(regex: str, anchor) -> None:
    """xgrammar ignores an anchor that is not the regex's leading '^' / trailing '$' (only a warning on stderr):
    "auto" hands such a regex to llguidance, which honours it or refuses it; an explicit xgrammar refuses it,
    naming llguidance."""
    from pagedllm.structured_output.backend import regex_mid_anchor

    spec = StructuredOutputsParams(regex=regex, origin="guided_regex")
    position = regex_mid_anchor(regex)
    assert position is not None and (anchor is None or position == anchor)
    with pytest.raises(ValueError, match="xgrammar ignores the anchor .* the guidance backend \\(llguidance\\)"):
        _manager("xgrammar").validate(spec)
    if anchor is None:  # no output can honour it: a 400 under auto as well, saying which anchor
        with pytest.raises(ValueError, match=re.escape(f"Invalid guided_regex: the anchor '{regex[1]}' at position 1 "
                                                       "of the regex cannot be honoured: ")):
            _manager("auto").validate(spec)
    else:
        assert _manager("auto").validate(spec) == "guidance"


@pytest.mark.parametrize("regex", ["^ab$", "^a", "b$", r"a\$b", "[$^]x", "[^^]", "[]^]", r"\^", "a\\\\$"])
def test_regex_edge_anchors_and_literals_stay_with_xgrammar(regex: str) -> None:
    from pagedllm.structured_output.backend import regex_mid_anchor

    assert regex_mid_anchor(regex) is None
    if regex != "[]^]":  # (xgrammar does not take a leading ']' in a class: llguidance does)
        assert _manager("auto").validate(StructuredOutputsParams(regex=regex)) == "xgrammar"


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
@pytest.mark.parametrize("schema, where", [
    ({"$ref": "#"}, "'#'"),  # once empty output: xgrammar refused it, "auto" took llguidance, which matched nothing
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "'#/$defs/a'"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "'#'"),  # once {"a": {"a": ...
    ({"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
                "B": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/A"}}}, "$ref": "#/$defs/A"},
     "'#/$defs/A', '#/$defs/B'"),
])
def test_endless_recursion_is_refused(backend: str, schema: dict, where: str) -> None:
    with pytest.raises(ValueError, match="no JSON value satisfies the schema .its references recurse without end"
                       ) as e:
        _manager(backend).validate(StructuredOutputsParams(json=schema))
    assert where in str(e.value)


@pytest.mark.parametrize("schema", [
    {"$defs": {"n": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                     "required": ["next"]}}, "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    {"type": "object", "properties": {"a": {"$ref": "#"}}},
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
])
def test_recursion_with_a_way_out_passes(schema: dict) -> None:
    assert _manager("auto").validate(StructuredOutputsParams(json=schema)) == "xgrammar"


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),  # [1, 1] came out
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, "if"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "properties": {"x": {"type": "object", "properties": {"a": {"type": "integer"}},
                                             "dependencies": {"a": ["b"]}}}}, "dependencies"),
])
def test_keywords_no_backend_enforces_are_refused(schema: dict, keyword: str) -> None:
    """xgrammar compiled these without enforcing them (a value breaking them was accepted), and "auto" kept it;
    llguidance does not implement them: a 400 naming the keyword, with either backend."""
    for backend in ("auto", "xgrammar", "guidance"):
        with pytest.raises(ValueError, match=re.escape(keyword)):
            _manager(backend).validate(StructuredOutputsParams(json=schema))


def test_multiple_of_a_number_goes_to_llguidance() -> None:
    """xgrammar enforces multipleOf for integers only: a number's goes to llguidance, which enforces it."""
    assert _manager("auto").validate(StructuredOutputsParams(json={"type": "integer", "multipleOf": 3})) == "xgrammar"
    schema = {"type": "number", "multipleOf": 0.5}
    assert _manager("auto").validate(StructuredOutputsParams(json=schema)) == "guidance"
    with pytest.raises(ValueError, match="does not enforce the JSON schema keyword 'multipleOf' of a number"):
        _manager("xgrammar").validate(StructuredOutputsParams(json=schema))


def test_properties_named_like_keywords_are_not_keywords() -> None:
    schema = {"type": "object", "properties": {"contains": {"type": "string"}, "if": {"type": "integer"},
                                               "uniqueItems": {"type": "boolean"}}}
    assert _manager("auto").validate(StructuredOutputsParams(json=schema)) == "xgrammar"


def test_unevaluated_properties_alone_is_additional_properties() -> None:
    """Nothing else evaluates the object's properties: unevaluatedProperties is additionalProperties, which both
    libraries enforce (xgrammar ignored it and let any property through; llguidance refused it)."""
    import json

    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from pagedllm.structured_output.backend import strict_objects

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False}
    for backend in ("auto", "guidance"):
        _manager(backend).validate(StructuredOutputsParams(json=schema))
    grammar = xgr.Grammar.from_json_schema(json.dumps(strict_objects(schema)), strict_mode=False)
    assert _is_grammar_accept_string(grammar, '{"a": 1}')
    assert not _is_grammar_accept_string(grammar, '{"a": 1, "b": 2}')


def test_disable_fallback_keeps_xgrammar() -> None:
    """vLLM's structured_outputs.disable_fallback (once an "unknown field" 400): "auto" does not hand a spec
    xgrammar refuses to llguidance; the refusal stands."""
    params = StructuredOutputsParams(grammar='start: "yes" | "no"', disable_fallback=True)  # Lark: llguidance only
    with pytest.raises(ValueError, match="Invalid structured_outputs.grammar: "):
        _manager("auto").validate(params)
    assert _manager("auto").validate(StructuredOutputsParams(grammar='start: "yes" | "no"')) == "guidance"
    assert StructuredOutputsParams.from_dict({"regex": "a", "disable_fallback": True}).disable_fallback is True
    with pytest.raises(ValueError, match="disable_fallback must be true or false"):
        StructuredOutputsParams(regex="a", disable_fallback="yes")


@pytest.mark.parametrize("keyword, value", [("uniqueItems", False), ("dependentRequired", {}), ("if", True),
                                             ("unevaluatedItems", True)])
def test_keywords_that_constrain_nothing_pass_both_backends(keyword: str, value) -> None:
    """llguidance refused these keys whatever their value ("Unimplemented keys"): no-ops are dropped first."""
    schema = {"type": "array", "items": {"type": "integer"}, keyword: value}
    for backend in ("auto", "xgrammar", "guidance"):
        _manager(backend).validate(StructuredOutputsParams(json=schema))


def test_contains_true_is_still_a_constraint() -> None:
    with pytest.raises(ValueError, match="'contains'"):
        _manager("auto").validate(StructuredOutputsParams(json={"type": "array", "contains": True}))
