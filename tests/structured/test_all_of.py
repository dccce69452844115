"""allOf beside properties (schema_merge.py): subschemas that combine into one schema are folded into the parent
before the object schemas are closed, so {"properties": ..., "allOf": [{"required": ...}, {"properties": ...}]}
is accepted (it was refused as unsatisfiable: each subschema closed against the others' properties) and enforced
by xgrammar; what does not fold goes to llguidance under "auto". The generated JSON validates against the
user's schema."""
from __future__ import annotations

import copy
import json

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="validates the structured outputs")
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.structured_output import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.backend import strict_objects  # noqa: E402
from pagedllm.structured_output.manager import StructuredOutputManager  # noqa: E402
from pagedllm.structured_output.schema_merge import merge_all_of  # noqa: E402

# QA's shape, bounded so that even a random model finishes within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
    "allOf": [{"required": ["a", "b"]}, {"properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9}}}],
}
# Two patterns do not fold into one schema: llguidance intersects them.
PATTERNS = {"type": "string", "allOf": [{"pattern": "^[ab]{2,5}$"}, {"pattern": "^a"}]}


def _validate(schema: dict, backend: str = "auto") -> str:
    return StructuredOutputManager("unused", 64, [0], config={"backend": backend}).validate(
        StructuredOutputsParams(json=schema))


def test_all_of_beside_properties_folds_and_closes() -> None:
    original = copy.deepcopy(SCHEMA)
    assert strict_objects(SCHEMA) == {
        "type": "object", "required": ["a", "b"], "additionalProperties": False,
        "properties": {"a": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                       "b": {"type": "integer", "minimum": 0, "maximum": 9}}}
    assert SCHEMA == original  # the request's schema is not touched
    for backend in ("auto", "xgrammar", "guidance"):
        assert _validate(SCHEMA, backend) == ("xgrammar" if backend == "auto" else backend)


@pytest.mark.parametrize("schema, folded", [
    # a local $ref beside other constraints is inlined (pydantic's inheritance shape)
    ({"$defs": {"B": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
      "allOf": [{"$ref": "#/$defs/B"}, {"properties": {"n": {"type": "string"}}, "required": ["n"]}]},
     {"type": "object", "properties": {"id": {"type": "integer"}, "n": {"type": "string"}}, "required": ["id", "n"]}),
    # a name the closed side does not list may not appear: dropped from the folded properties
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False,
      "allOf": [{"properties": {"y": {"type": "string"}}}]},
     {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False}),
    ({"allOf": [{"type": "number", "minimum": 1, "multipleOf": 2}, {"type": "integer", "minimum": 3,
                                                                  "multipleOf": 3}, {"enum": [6, 7, 12]}]},
     {"type": "integer", "minimum": 3, "multipleOf": 6, "enum": [6, 7, 12]}),
])
def test_folds(schema: dict, folded: dict) -> None:
    got, conflicts = merge_all_of(schema)
    assert conflicts == []
    assert {k: v for k, v in got.items() if k != "$defs"} == folded


def test_what_does_not_fold_is_named() -> None:
    got, conflicts = merge_all_of(PATTERNS)
    assert conflicts == ["pattern"] and got["allOf"] == [{"pattern": "^a"}]
    assert _validate(PATTERNS) == "guidance"
    with pytest.raises(ValueError, match="xgrammar backend does not enforce allOf .*each sets 'pattern'"):
        _validate(PATTERNS, "xgrammar")
    # A recursive definition is unrolled once, never looped over.
    tree = {"$defs": {"T": {"type": "object", "properties": {"kids": {"type": "array", "items": {
        "allOf": [{"$ref": "#/$defs/T"}, {"maxProperties": 1}]}}}}}, "$ref": "#/$defs/T"}
    assert merge_all_of(tree)[1] == ["$ref"]


def test_generated_json_validates_against_the_schema(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64, max_num_seqs=4)
    so = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
          StructuredOutputsParams(json=PATTERNS, disable_any_whitespace=True)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=so[s % 2]) for s in range(4)]
    outs = llm.generate(["x", "y", "z", "w"], params, use_tqdm=False)
    for i, o in enumerate(outs):
        value = json.loads(o.outputs[0].text)
        jsonschema.validate(value, [SCHEMA, PATTERNS][i % 2])
        assert o.outputs[0].finish_reason == "stop"
        if i % 2 == 0:
            assert sorted(value) == ["a", "b"]  # closed, as the properties-only schemas are
