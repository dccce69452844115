"""What a request may carry beyond its model's fields: features other work will build (refused with a 400 until
their field exists on the request model), and everything else (accepted, ignored, and named in a warning, as
vLLM does, so a typo such as `max_token` shows in the server log)."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import APIError

logger = logging.getLogger("pagedllm.api")

# field -> whether a value actually asks for the feature. Each rule stops applying as soon as the request model
# gains the field (its owner then honours it).
NOT_SUPPORTED_YET: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none", "auto"),
    "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none", "auto"),
    "response_format": lambda v: v is not None and not (isinstance(v, dict) and v.get("type") == "text"),
    "structured_outputs": lambda v: v is not None,
    "guided_json": lambda v: v is not None,
    "guided_regex": lambda v: v is not None,
    "guided_choice": lambda v: v is not None,
    "guided_grammar": lambda v: v is not None,
    "use_beam_search": lambda v: bool(v),
    # vLLM's extras that change what is generated or returned: ignoring them would answer another question.
    "logits_processors": lambda v: bool(v),
    "prompt_embeds": lambda v: v is not None,
    "kv_transfer_params": lambda v: v is not None,
    "structural_tag": lambda v: v is not None,
    # OpenAI's outputs beyond text: an answer without them would look complete
    "modalities": lambda v: isinstance(v, list) and any(m != "text" for m in v),
    "audio": lambda v: v is not None,
    "web_search_options": lambda v: v is not None,
}


@functools.lru_cache(maxsize=None)
def _known(model: type[BaseModel]) -> frozenset[str]:
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return frozenset(names)


# What to send instead, for refused fields that have a supported counterpart.
_INSTEAD = {"functions": " (OpenAI deprecated it): describe them in 'tools'",
            "function_call": " (OpenAI deprecated it): use 'tool_choice' with 'tools'"}


def check_extra_fields(model: type[BaseModel], data: dict) -> None:
    known = _known(model)
    for name, in_use in NOT_SUPPORTED_YET.items():
        if name in data and name not in known and in_use(data[name]):
            raise APIError(f"'{name}' is not supported yet by pagedllm{_INSTEAD.get(name, '')}.", param=name)
    # A refused field with a value that asks for nothing (function_call "auto") is ignored too, so it is named
    # (it was dropped without a word).
    ignored = sorted(k for k in data if k not in known)
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s", ignored)
