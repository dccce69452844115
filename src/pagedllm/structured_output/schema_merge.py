"""allOf folded into the schema that holds it, where the subschemas' keywords combine into one schema that
accepts exactly the same values.

Why: xgrammar compiles allOf of several schemas into "any JSON value" (only a warning), and closing every object
schema that lists properties (`backend.strict_objects`) would close each subschema against the others' properties,
so {"properties": {"a": ...}, "allOf": [{"required": ["a"]}, {"properties": {"b": ...}}]} admitted no value at all.
Once folded, both libraries see one plain schema. Subschemas whose keywords cannot be combined (two different
patterns, two anyOf, a $ref into a recursive definition, ...) stay in allOf and their keywords are reported, so the
xgrammar backend can refuse naming them while llguidance, which intersects allOf itself, takes them.
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional

_LARGEST = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
_SMALLEST = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")
# No constraint: the first schema's wins.
_ANNOTATIONS = ("title", "description", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly",
                "$schema", "$id", "$anchor")
_DATA_KEYS = ("enum", "const", "default", "examples")  # JSON values, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords combined together by _merge_object_keys / _merge_array_keys rather than one by one.
_OBJECT_KEYS = ("properties", "patternProperties", "additionalProperties")
_ARRAY_KEYS = ("items", "prefixItems", "additionalItems")
# Keywords whose meaning depends on which sibling subschemas evaluated what: merging would change it.
_UNMERGEABLE = ("unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$recursiveRef")



def pointer_target(root: Any, ref: str) -> Any:
    """The subschema a local "$ref" ("#", "#/$defs/A", with JSON pointer and URL escapes) points at; None if none."""
    from urllib.parse import unquote

    node = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node

class _Conflict(Exception):
    def __init__(self, keyword: str) -> None:
        super().__init__(keyword)
        self.keyword = keyword


def _same(x: Any, y: Any) -> bool:
    return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)


def _constraining(schema: Any) -> bool:
    """Whether the schema says more than annotations (a $ref beside it must then be inlined to merge)."""
    return not isinstance(schema, dict) or any(k not in _ANNOTATIONS for k in schema)


def _types(t: Any) -> list:
    if isinstance(t, str):
        return [t]
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return t
    raise _Conflict("type")


def _merge_type(x: Any, y: Any) -> Any:
    xs, ys = _types(x), _types(y)
    both = [t for t in xs if t in ys or (t == "integer" and "number" in ys)]
    both += [t for t in ys if t == "integer" and "number" in xs and t not in both]
    if not both:  # left to the satisfiability check, which says "incompatible types"
        raise _Conflict("type")
    return both[0] if len(both) == 1 else both


def _merge_multiple_of(x: Any, y: Any) -> Any:
    if isinstance(x, int) and isinstance(y, int) and x > 0 and y > 0:
        return x * y // math.gcd(x, y)
    big, small = max(x, y), min(x, y)
    if small > 0 and float(big / small).is_integer():
        return big
    raise _Conflict("multipleOf")


class _Merger:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.conflicts: list[str] = []

    # ------------------------------------------------------------------ the tree
    def fold(self, schema: Any, refs: tuple = ()) -> Any:
        """The schema with every allOf it holds, at any depth, folded where it can be."""
        if isinstance(schema, list):
            return [self.fold(s, refs) for s in schema]
        if not isinstance(schema, dict):
            return schema
        if isinstance(schema.get("allOf"), list):
            schema, refs = self._fold_level(schema, refs)
            if not isinstance(schema, dict):
                return schema
        out = {}
        for k, v in schema.items():
            if k in _DATA_KEYS:
                out[k] = v
            elif k in _SCHEMA_MAPS and isinstance(v, dict):  # name -> schema maps are not schemas themselves
                out[k] = {name: self.fold(sub, refs) for name, sub in v.items()}
            else:
                out[k] = self.fold(v, refs)
        return out

    def _fold_level(self, schema: dict, refs: tuple) -> tuple[Any, tuple]:
        merged: Any = {k: v for k, v in schema.items() if k != "allOf"}
        queue, left = list(schema["allOf"]), []
        while queue:
            branch = queue.pop(0)
            if isinstance(branch, dict) and isinstance(branch.get("allOf"), list):  # nested allOf: same level
                queue = list(branch["allOf"]) + [{k: v for k, v in branch.items() if k != "allOf"}] + queue
                continue
            try:
                merged, refs = self._merge_inlining(merged, branch, refs)
            except _Conflict as c:
                self.conflicts.append(c.keyword)
                left.append(branch)
        if left:
            if not isinstance(merged, dict):  # false: nothing else matters
                return merged, refs
            merged = dict(merged, allOf=left)  # (merged may be one of the caller's subschemas)
        return merged, refs

    def _merge_inlining(self, a: Any, b: Any, refs: tuple) -> tuple[Any, tuple]:
        """a and b merged; a $ref on one side beside constraints on the other is replaced by its (local) target,
        once per path (refs: those inlined above), so a recursive definition is unrolled at most one level."""
        for side in (0, 1):
            this, other = (a, b) if side == 0 else (b, a)
            if isinstance(this, dict) and "$ref" in this and _constraining(other):
                ref = this["$ref"]
                target = self._resolve(ref)
                if target is None or ref in refs:
                    raise _Conflict("$ref")
                rest = {k: v for k, v in this.items() if k != "$ref"}
                inlined = self.merge(target, rest)
                a, b = (inlined, b) if side == 0 else (a, inlined)
                refs = refs + (ref,)
        return self.merge(a, b), refs

    def _resolve(self, ref: Any) -> Optional[Any]:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = pointer_target(self.root, ref)
        if isinstance(node, dict) and "$ref" in node:  # a chain of references: not followed
            return None
        return node

    # ------------------------------------------------------------------ two schemas
    def merge(self, a: Any, b: Any) -> Any:
        """One schema accepting exactly what both accept; _Conflict(keyword) where that is not written simply."""
        if a is True or a == {}:
            return b
        if b is True or b == {}:
            return a
        if a is False or b is False:
            return False
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise _Conflict("allOf")
        if "$ref" in a or "$ref" in b:
            if "$ref" in a and "$ref" in b and not _same(a["$ref"], b["$ref"]):
                raise _Conflict("$ref")
            if (_constraining({k: v for k, v in a.items() if k != "$ref"})
                    or _constraining({k: v for k, v in b.items() if k != "$ref"})):
                raise _Conflict("$ref")  # what the reference says is merged only by _merge_inlining
        out = dict(a)
        for key in _UNMERGEABLE:
            if key in a or key in b:
                raise _Conflict(key)
        for k, v in b.items():
            if k in _OBJECT_KEYS or k in _ARRAY_KEYS:
                continue
            if k not in out or k in _ANNOTATIONS:
                out.setdefault(k, v)
            elif _same(out[k], v):
                continue
            elif k == "type":
                out[k] = _merge_type(out[k], v)
            elif k in _LARGEST:
                out[k] = max(out[k], v)
            elif k in _SMALLEST:
                out[k] = min(out[k], v)
            elif k == "multipleOf":
                out[k] = _merge_multiple_of(out[k], v)
            elif k == "required" and isinstance(v, list) and isinstance(out[k], list):
                out[k] = list(dict.fromkeys(out[k] + v))
            elif k == "enum" and isinstance(v, list) and isinstance(out[k], list):
                both = [x for x in out[k] if any(_same(x, y) for y in v)]
                if not both:
                    raise _Conflict("enum")
                out[k] = both
            elif k == "uniqueItems":
                out[k] = bool(out[k]) or bool(v)
            elif k in ("contains", "propertyNames"):
                out[k] = self._merge_or_all_of(out[k], v)
            elif k == "dependentRequired" and isinstance(v, dict) and isinstance(out[k], dict):
                out[k] = {n: list(dict.fromkeys(out[k].get(n, []) + v.get(n, []))) for n in {**out[k], **v}}
            else:  # pattern, format, const, anyOf, oneOf, not, if / then / else, ...: one of each only
                raise _Conflict(k)
        self._merge_object_keys(a, b, out)
        self._merge_array_keys(a, b, out)
        return out

    def _merge_or_all_of(self, x: Any, y: Any) -> Any:
        """Subschemas that do not merge stay together in an allOf of their own (a narrower refusal)."""
        try:
            return self.merge(x, y)
        except _Conflict as c:
            self.conflicts.append(c.keyword)
            return {"allOf": [x, y]}

    def _merge_object_keys(self, a: dict, b: dict, out: dict) -> None:
        if not any(k in s for s in (a, b) for k in _OBJECT_KEYS):
            return
        if "patternProperties" in a or "patternProperties" in b:
            # Which names a pattern takes from additionalProperties is not followed here: merged only when the
            # other side says nothing about properties at all.
            for x, y in ((a, b), (b, a)):
                if not any(k in y for k in _OBJECT_KEYS):
                    for k in _OBJECT_KEYS:
                        if k in x:
                            out[k] = x[k]
                    return
            raise _Conflict("patternProperties")
        props_a, props_b = a.get("properties", {}), b.get("properties", {})
        if not isinstance(props_a, dict) or not isinstance(props_b, dict):
            raise _Conflict("properties")
        props = {}
        # A name one side lists and the other does not is an "additional" property of the other: it takes that
        # side's additionalProperties (false: it may not appear).
        for name in {**props_a, **props_b}:
            if name in props_a and name in props_b:
                props[name] = self._merge_or_all_of(props_a[name], props_b[name])
            elif name in props_a:
                props[name] = self._merge_or_all_of(props_a[name], b.get("additionalProperties", True))
            else:
                props[name] = self._merge_or_all_of(props_b[name], a.get("additionalProperties", True))
        out.pop("properties", None)
        if "additionalProperties" in a or "additionalProperties" in b:
            out["additionalProperties"] = self._merge_or_all_of(a.get("additionalProperties", True),
                                                                b.get("additionalProperties", True))
        if out.get("additionalProperties") is False:  # a name only one side allowed is as unlisted: forbidden
            props = {name: sub for name, sub in props.items() if sub is not False}
        if props or "properties" in a or "properties" in b:
            out["properties"] = props

    def _merge_array_keys(self, a: dict, b: dict, out: dict) -> None:
        present = [s for s in (a, b) if any(k in s for k in _ARRAY_KEYS)]
        if len(present) < 2:
            for s in present:
                out.update({k: s[k] for k in _ARRAY_KEYS if k in s})
            return
        tuple_form = any("prefixItems" in s or isinstance(s.get("items"), list) for s in (a, b))
        if tuple_form:  # positions shift "items" / "additionalItems": only the same layout on both sides merges
            if not all(_same(a.get(k), b.get(k)) for k in _ARRAY_KEYS):
                raise _Conflict("prefixItems" if any("prefixItems" in s for s in (a, b)) else "items")
            return
        if "additionalItems" in a or "additionalItems" in b:  # ignored beside a schema "items": drop it
            out.pop("additionalItems", None)
        if "items" in a or "items" in b:
            out["items"] = self._merge_or_all_of(a.get("items", True), b.get("items", True))


def merge_all_of(schema: Any) -> tuple[Any, list[str]]:
    """(the schema with its allOf folded where possible, the keywords of subschemas left in allOf)."""
    merger = _Merger(schema)
    return merger.fold(schema), merger.conflicts
