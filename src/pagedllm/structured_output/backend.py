"""The grammar-library seam: a GrammarBackend compiles StructuredOutputsParams for one tokenizer; a
RequestGrammar is one request's matcher (advanced with accepted tokens, rolled back for speculation).

Backends (chosen with --structured-outputs-config '{"backend": ...}', measured in docs/benchmarks.md):
  xgrammar  (default; "auto" picks it, falling back to guidance for a spec xgrammar refuses)
  guidance  (llguidance)
Both libraries import lazily: engines that never see a structured request never load them.

Bitmask layout (both libraries): int32 [rows, ceil(vocab_size / 32)], bit j of word w allows token 32 * w + j.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, Optional, Sequence

from pagedllm.structured_output.params import SpecError, StructuredOutputsParams
from pagedllm.structured_output.schema_merge import merge_all_of, pointer_target

BACKENDS = ("auto", "xgrammar", "guidance")
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s*\S+?:\d+:\s*")  # xgrammar's "[hh:mm:ss] /path/file.cc:123: "


def clean_error(e: BaseException) -> str:
    text = str(e).strip()
    text = _CPP_PREFIX.sub("", text)
    return " ".join(text.split())


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON string escapes are valid EBNF escapes). Other
    characters stay as they are: xgrammar read an ASCII-escaped emoji as its two UTF-16 surrogates (invalid UTF-8
    out), and llguidance's GBNF reader refused \u00e9 ('é')."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def json_object_schema() -> dict:
    return {"type": "object"}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA_KEYS = ("enum", "const", "default", "examples")  # JSON values, not schemas


def strict_objects(schema: Any) -> Any:
    """A copy with allOf folded into its parent where it can be (`schema_merge`), where object schemas with
    properties and no "additionalProperties" get false, so the model keeps to the listed properties (as vLLM's
    xgrammar strict mode does) while an open {"type": "object"} stays open (strict mode would allow only {}).
    Applied for both backends alike."""
    return _closed(merge_all_of(schema)[0])


def _closed(schema: Any, close: bool = True) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if _no_op(schema, k, v):
            continue  # (llguidance refuses these keys whatever their value: "Unimplemented keys")
        if k in _DATA_KEYS:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):  # name -> schema maps are not schemas themselves
            out[k] = {name: _closed(sub) for name, sub in v.items()}
        elif k == "allOf" and isinstance(v, list):
            # An allOf left unfolded: closing the parent or a subschema would forbid the others' properties.
            out[k] = [_closed(s, close=False) for s in v]
        else:
            out[k] = _closed(v)
    if ("unevaluatedProperties" in out and "additionalProperties" not in out
            and not any(k in out for k in _APPLICATORS)):
        # Nothing but this object's own keywords evaluates its properties: the same as additionalProperties,
        # which both libraries enforce (xgrammar ignored unevaluatedProperties, llguidance does not implement it).
        out["additionalProperties"] = out.pop("unevaluatedProperties")
    if (close and "allOf" not in out and "properties" in out and "additionalProperties" not in out
            and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def _no_op(schema: dict, key: str, value: Any) -> bool:
    """Whether this keyword of the schema constrains nothing (uniqueItems false, an "if" without "then" / "else",
    an empty dependentRequired, unevaluatedProperties true, ...)."""
    if key == "uniqueItems":
        return value is False
    if key == "if":
        return "then" not in schema and "else" not in schema
    if key in ("then", "else"):
        return "if" not in schema
    if key in ("dependentRequired", "dependentSchemas", "dependencies"):
        return value == {}
    if key in ("unevaluatedProperties", "unevaluatedItems"):
        return value is True or value == {}
    return False


# Keywords through which other subschemas evaluate an object's properties (what unevaluatedProperties looks at).
_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "$recursiveRef", "if", "then", "else",
                "dependentSchemas", "dependencies")


def _xgrammar_ignored_keyword(schema: dict) -> Optional[str]:
    """A keyword of this (sub)schema that xgrammar compiles without enforcing it (checked against the library:
    a value it breaks is accepted), as it was written; None if none."""
    for key in ("contains", "if", "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
                "unevaluatedItems"):
        if key in schema and not _no_op(schema, key, schema[key]):  # (contains: true still asks for an item)
            return f"{key!r}"
    if schema.get("uniqueItems") is True:
        return "'uniqueItems'"
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if "multipleOf" in schema and "integer" not in kinds:  # xgrammar takes it for integers only
        return f"'multipleOf' of a {'number' if 'number' in kinds else 'value that is not an integer'}"
    return None


def _xgrammar_ignored(schema: Any) -> Optional[str]:
    """The first keyword anywhere in the schema that xgrammar would ignore (_xgrammar_ignored_keyword)."""
    if isinstance(schema, list):
        return next((r for r in map(_xgrammar_ignored, schema) if r), None)
    if not isinstance(schema, dict):
        return None
    found = _xgrammar_ignored_keyword(schema)
    if found:
        return found
    for k, v in schema.items():
        if k in _DATA_KEYS:
            continue
        subs = v.values() if k in _SCHEMA_MAPS and isinstance(v, dict) else [v]
        found = next((r for r in map(_xgrammar_ignored, subs) if r), None)
        if found:
            return found
    return None


def _loosened(schema: Any) -> Any:
    """A copy for the satisfiability check: "not" dropped (llguidance does not implement it, and dropping it only
    widens the schema, so what stays unsatisfiable was), except a "not" of everything, which is false."""
    if isinstance(schema, list):
        return [_loosened(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if "not" in schema and (schema["not"] is True or schema["not"] == {}):
        return False
    out = {}
    for k, v in schema.items():
        if k == "not":
            continue
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _loosened(sub) for name, sub in v.items()}
        else:
            out[k] = v if k in _DATA_KEYS else _loosened(v)
    return out


def unsatisfiable_reason(schema: Any) -> Optional[str]:
    """Why no JSON value satisfies the schema (llguidance's analysis: types that exclude each other in allOf,
    enum / anyOf [], a required property that additionalProperties forbids, ...), or None when it may be satisfied
    or cannot be analysed. xgrammar compiles many such schemas without a word, into a grammar that lets the model
    write anything, or nothing."""
    try:
        import llguidance
    except ImportError:
        return None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_loosened(schema)))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    except Exception as e:  # noqa: BLE001 - a schema llguidance cannot read is left to the backend's own check
        is_error, messages = True, [str(e)]
    if not is_error:
        return None
    for message in messages:
        found = re.search(r"Unsatisfiable schema: (.+)", clean_error(Exception(message)))
        if found:
            return found.group(1).strip().rstrip(".")
    return None


def _local_refs(schema: Any, found: dict) -> dict:
    if isinstance(schema, list):
        for s in schema:
            _local_refs(s, found)
    elif isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            found.setdefault(ref, None)
        for k, v in schema.items():
            if k not in _DATA_KEYS:
                _local_refs(v, found)
    return found


def _has_finite_value(schema: Any, finite: dict) -> bool:
    """Whether some finite JSON value may satisfy the schema, given which references do (`finite`). Errs towards
    True: only what every value needs (required properties, minItems, a $ref, allOf) can make it False."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict) or "enum" in schema or "const" in schema:
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str) and not finite.get(ref, True):
        return False
    for key, need in (("allOf", all), ("anyOf", any), ("oneOf", any)):
        subs = schema.get(key)
        if isinstance(subs, list) and subs and not need(_has_finite_value(s, finite) for s in subs):
            return False
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or any(t not in ("object", "array") for t in types):
        return True  # a scalar may do
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    extra = schema.get("additionalProperties", True)
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if "object" in types and all(_has_finite_value(props.get(name, extra), finite) for name in required
                                 if isinstance(name, str)):
        return True
    min_items = schema.get("minItems", 0)
    prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
    items = schema.get("items", True)
    if isinstance(items, list):  # the draft-07 tuple form
        prefix, items = items, schema.get("additionalItems", True)
    if "array" in types and (not isinstance(min_items, int) or all(
            _has_finite_value(prefix[i] if i < len(prefix) else items, finite) for i in range(min(min_items, 64)))):
        return True
    return False


def endless_recursion(schema: Any) -> Optional[str]:
    """Why references make every value of the schema infinitely deep ({"$ref": "#"}, "#/$defs/A" -> "#/$defs/B"
    -> "#/$defs/A", a required property whose schema is its parent's): None if a finite value may do. xgrammar
    refuses only a chain of bare references (and "auto" then took llguidance, whose grammar matched nothing: empty
    output); a recursive required property made the model write until max_tokens."""
    refs = _local_refs(schema, {})
    if not refs:
        return None
    finite = dict.fromkeys(refs, False)  # least fixed point: a reference is finite once its target is shown to be
    changed = True
    while changed:
        changed = False
        for ref in finite:
            target = pointer_target(schema, ref)
            if not finite[ref] and (target is None or _has_finite_value(target, finite)):
                finite[ref] = changed = True
    if _has_finite_value(schema, finite) or not _has_finite_value(schema, dict.fromkeys(refs, True)):
        return None  # (the latter: unsatisfiable for another reason, which unsatisfiable_reason words)
    endless = [r for r, ok in finite.items() if not ok]
    return (f"its references recurse without end: every value through {', '.join(map(repr, endless[:3]))} would "
            "hold itself again; give the recursion a way out: an optional property, anyOf with null, minItems 0")


def check_satisfiable(params: StructuredOutputsParams) -> None:
    """ValueError (-> 400) if the request's JSON schema admits no value at all."""
    if params.kind != "json":
        return
    endless = endless_recursion(params.json)
    if endless:
        raise SpecError(params, f"no JSON value satisfies the schema ({endless}).")
    reason = unsatisfiable_reason(strict_objects(params.json))
    if reason is None:
        return
    if unsatisfiable_reason(params.json) is None:  # only so with the additionalProperties false strict_objects adds
        reason += "; an object schema with properties allows no others unless additionalProperties says so"
    raise SpecError(params, f"no JSON value satisfies the schema ({reason}).")


def _unenforced_not(schema: Any) -> Optional[str]:
    """A "not" that neither library enforces (xgrammar ignores it, llguidance does not implement it), as the
    sentence that refuses it; None if none. "not": {} / true (no value) and "not": false (any value) are left to
    the satisfiability check."""
    if isinstance(schema, list):
        return next((r for r in map(_unenforced_not, schema) if r), None)
    if not isinstance(schema, dict):
        return None
    if "not" in schema and schema["not"] not in ({}, True, False):
        return ("'not' is not enforced by either backend (xgrammar would ignore it, llguidance does not implement "
                f"it): {json.dumps({'not': schema['not']})[:80]}; describe the allowed values instead (enum, "
                "anyOf, pattern, ...)")
    return next((r for k, v in schema.items() if k not in _DATA_KEYS for r in [_unenforced_not(v)] if r), None)


def regex_mid_anchor(regex: str) -> Optional[tuple[str, int]]:
    """The first '^' / '$' anchor of the regex that is not its leading '^' or trailing '$' (those are no-ops: a
    structured-output regex always matches the whole output), as (anchor, position); None if none. Escaped ones
    and those inside a character class are literals."""
    i, n, in_class = 0, len(regex), False
    while i < n:
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            if ch == "]":
                in_class = False
        elif ch == "[":
            in_class = True
            i += 1
            if regex[i:i + 1] == "^":  # negation
                i += 1
            if regex[i:i + 1] == "]":  # a leading ']' is a literal
                i += 1
            continue
        elif (ch == "^" and i != 0) or (ch == "$" and i != n - 1):
            return ch, i
        i += 1
    return None


class Unenforced(SpecError):
    """A spec xgrammar would compile without honouring part of it; `what` names that part (for "auto", which
    tries llguidance, to word the refusal if llguidance cannot take it either)."""

    def __init__(self, params: StructuredOutputsParams, reason: str, what: str) -> None:
        super().__init__(params, reason)
        self.what = what


def _xgrammar_unenforced(schema: Any) -> Optional[str]:
    """What in the schema xgrammar compiles as "any value" without an error (a $ref to another document; allOf
    is `_all_of_unenforced`'s), as the sentence that refuses it; None if nothing."""
    if isinstance(schema, list):
        return next((r for r in map(_xgrammar_unenforced, schema) if r), None)
    if not isinstance(schema, dict):
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"$ref {ref!r} points outside the schema; only local references such as '#/$defs/Name' are supported"
    return next((r for k, v in schema.items() if k not in _DATA_KEYS for r in [_xgrammar_unenforced(v)] if r), None)


class RequestGrammar(ABC):
    """One request's matcher. Invariant: it has accepted exactly the request's output tokens so far."""

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by these tokens; False (and no advance past the first bad one) if one is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (a CPU int32 torch tensor)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the request is done."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding rejects drafts)."""

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading token_ids the grammar would accept from here, none past its end; it does not advance.
        (Accepted and rolled back: a matcher whose failed accept leaves it as it was, as xgrammar's.)"""
        n = 0
        for t in token_ids:
            if self.is_terminated() or not self.accept_tokens([t]):
                break
            n += 1
        self.rollback(n)
        return n


class GrammarBackend(ABC):
    name = "base"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids

    @classmethod
    @abstractmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Raise ValueError with the library's reason if the spec is not valid (needs no tokenizer)."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (thread-safe; runs in the manager's compile thread)."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> RequestGrammar:
        ...

    @abstractmethod
    def fill_bitmasks(self, grammars: list[RequestGrammar], bitmask: Any) -> None:
        """bitmask[i] = grammars[i]'s next-token mask, for all i (batched / parallel where the library can)."""

    def allocate_bitmask(self, num_rows: int) -> Any:
        import torch

        return torch.full((num_rows, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------- xgrammar


class XGrammarGrammar(RequestGrammar):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for t in token_ids:
            if not self.matcher.accept_token(int(t)):
                return False
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        self.batch_matcher = None

    @staticmethod
    def check_enforceable(params: StructuredOutputsParams) -> None:
        # Refused rather than compiled into "any JSON value" / a regex without its anchor, so that "auto" takes
        # llguidance where it enforces them, and an explicit xgrammar backend answers why.
        reason = (_unenforced_not(params.json) or _xgrammar_unenforced(params.json)) if params.kind == "json" else None
        if reason:
            raise SpecError(params, f"{reason}.")
        ignored = _xgrammar_ignored(strict_objects(params.json)) if params.kind == "json" else None
        if ignored:  # once compiled without a word: [1, 1] for uniqueItems, {"a": 1} against dependentRequired
            what = f"the JSON schema keyword {ignored}"
            raise Unenforced(params, f"the xgrammar backend does not enforce {what}; use the guidance backend "
                             "(--structured-outputs-config '{\"backend\": \"guidance\"}') where it does", what)
        conflicts = merge_all_of(params.json)[1] if params.kind == "json" else []
        if conflicts:  # xgrammar compiles what stays in allOf as any value
            keys = ", ".join(repr(k) for k in dict.fromkeys(conflicts))
            what = f"allOf whose subschemas cannot be combined into one schema (each sets {keys})"
            raise Unenforced(params, f"the xgrammar backend does not enforce {what}; use the guidance backend "
                             "(--structured-outputs-config '{\"backend\": \"guidance\"}')", what)
        anchor = regex_mid_anchor(params.regex) if params.kind == "regex" else None
        if anchor:
            what = f"the anchor {anchor[0]!r} at position {anchor[1]} of the regex"
            raise Unenforced(params, f"xgrammar ignores {what} (it takes only a leading '^' and a trailing '$', "
                             "which are no-ops: the output always matches the whole regex); the guidance backend "
                             "(llguidance) honours anchors where they can match, e.g. '^' starting an alternative "
                             "(--structured-outputs-config '{\"backend\": \"guidance\"}').", what)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        cls.check_enforceable(params)
        kind = params.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(json.dumps(strict_objects(params.json)),
                                             any_whitespace=not params.disable_any_whitespace, strict_mode=False)
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(params.grammar)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        except Exception as e:  # noqa: BLE001 - the library raises RuntimeError / its own types
            raise SpecError(params, clean_error(e)) from None

    def compile(self, params: StructuredOutputsParams) -> Any:
        self.check_enforceable(params)
        try:
            return self._compile(params)
        except Exception as e:  # noqa: BLE001 - the library's RuntimeError, worded with the request's field
            raise SpecError(params, clean_error(e)) from None

    def _compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        c = self.compiler
        ws = not params.disable_any_whitespace
        if kind in ("json", "json_object"):  # json_object: any object (the builtin JSON grammar takes any value)
            schema = params.json if kind == "json" else json_object_schema()
            return c.compile_json_schema(json.dumps(strict_objects(schema)), any_whitespace=ws, strict_mode=False)
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":
            return c.compile_grammar(choice_ebnf(params.choice))
        return c.compile_grammar(params.grammar)

    def new_grammar(self, compiled: Any) -> RequestGrammar:
        return XGrammarGrammar(self.xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, grammars: list[RequestGrammar], bitmask: Any) -> None:
        batch_cls = getattr(self.xgr, "BatchGrammarMatcher", None)  # xgrammar >= 0.1.25 fills in parallel
        if len(grammars) < 8 or batch_cls is None:
            for i, g in enumerate(grammars):
                g.fill_bitmask(bitmask, i)
            return
        if self.batch_matcher is None:
            self.batch_matcher = batch_cls(max_threads="auto")
        self.batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)


# ---------------------------------------------------------------------------------------------- llguidance


class GuidanceGrammar(RequestGrammar):
    def __init__(self, matcher: Any, fill: Any) -> None:
        self.matcher = matcher
        self._fill = fill
        # Tokens taken once the matcher had stopped (its stop token): llguidance records none of them, so
        # rollback() must not count them.
        self._unrecorded = 0

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for t in token_ids:
            stopped = self.matcher.is_stopped()
            if not self.matcher.consume_token(int(t)):
                return False
            self._unrecorded += stopped
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._fill(self.matcher, bitmask.numpy() if hasattr(bitmask, "numpy") else bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        unrecorded = min(num_tokens, self._unrecorded)  # (always the latest: nothing is recorded after a stop)
        self._unrecorded -= unrecorded
        if num_tokens > unrecorded:
            self.matcher.rollback(num_tokens - unrecorded)

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        # (a token llguidance refuses puts its matcher in an error state that rollback does not undo: checked only)
        return self.matcher.validate_tokens([int(t) for t in token_ids])


def _gbnf_to_lark(text: str) -> str:
    # llguidance >= 1.x has a module llguidance.gbnf_to_lark that shadows the old top-level function of that name.
    import llguidance

    convert = llguidance.gbnf_to_lark
    return getattr(convert, "gbnf_to_lark", convert)(text)


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.np = llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                eos_token=list(stop_token_ids) or None)
        self.executor = llguidance.LLExecutor(2)

    @staticmethod
    def grammar_text(params: StructuredOutputsParams) -> str:
        import llguidance

        m = llguidance.LLMatcher
        kind = params.kind
        flexible = {"whitespace_flexible": not params.disable_any_whitespace}
        if kind == "json":
            return m.grammar_from_json_schema(json.dumps(strict_objects(params.json)), defaults=flexible)
        if kind == "json_object":
            return m.grammar_from_json_schema(json.dumps(json_object_schema()), defaults=flexible)
        if kind == "regex":
            return m.grammar_from_regex(params.regex)
        if kind == "choice":
            return m.grammar_from_lark(_gbnf_to_lark(choice_ebnf(params.choice)))
        text = params.grammar
        if "::=" in text:  # GBNF / EBNF; Lark otherwise
            text = _gbnf_to_lark(text)
        return m.grammar_from_lark(text)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        import llguidance

        reason = _unenforced_not(params.json) if params.kind == "json" else None
        if reason:  # llguidance says only "Unimplemented keys"
            raise SpecError(params, f"{reason}.")
        try:
            grammar = cls.grammar_text(params)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
        except Exception as e:  # noqa: BLE001
            raise SpecError(params, clean_error(e)) from None
        if is_error:
            raise SpecError(params, clean_error(Exception(messages[0])))

    def compile(self, params: StructuredOutputsParams) -> Any:
        grammar = self.grammar_text(params)
        probe = self.llg.LLMatcher(self.tok, grammar)  # grammars compile lazily; this checks them for this vocab
        if probe.is_error():
            raise SpecError(params, clean_error(Exception(probe.get_error())))
        return grammar

    def new_grammar(self, compiled: Any) -> RequestGrammar:
        return GuidanceGrammar(self.llg.LLMatcher(self.tok, compiled), self.np.fill_next_token_bitmask)

    def fill_bitmasks(self, grammars: list[RequestGrammar], bitmask: Any) -> None:
        arr = bitmask.numpy()
        if len(grammars) < 8:
            for i, g in enumerate(grammars):
                self.np.fill_next_token_bitmask(g.matcher, arr, i)
            return
        self.np.fill_next_token_bitmask_par(self.executor, [(g.matcher, i) for i, g in enumerate(grammars)], arr)


_REGISTRY = {"xgrammar": XGrammarBackend, "guidance": GuidanceBackend}


def backend_class(name: str) -> type[GrammarBackend]:
    if name == "auto":
        name = "xgrammar"
    if name not in _REGISTRY:
        raise ValueError(f"Unknown structured outputs backend {name!r}; choose one of {', '.join(BACKENDS)}.")
    return _REGISTRY[name]


def resolve_backend_name(name: str, params: Optional[StructuredOutputsParams]) -> str:
    """"auto": xgrammar, unless it refuses a spec that llguidance accepts (e.g. Lark grammars). A backend named
    explicitly checks the spec too (SpecError), so a bad one is a 400 from add_request, not a failed compile."""
    if name != "auto":
        if params is not None:
            backend_class(name).validate(params)
        return name
    if params is None:
        return "xgrammar"
    try:
        XGrammarBackend.validate(params)
        return "xgrammar"
    except ValueError as first:
        if params.disable_fallback:  # vLLM's: the first backend's refusal stands
            raise
        try:
            GuidanceBackend.validate(params)
        except SpecError as second:
            if isinstance(first, Unenforced):  # xgrammar's message points at llguidance, which cannot either
                raise SpecError(params, f"{first.what} cannot be honoured: {second.reason}") from None
            raise first from None
        except ValueError:
            raise first from None
        return "guidance"
