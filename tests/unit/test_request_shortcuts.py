"""The request path's shortcuts answer what the plain calls answer: field_or_none as getattr(req, name, None), the
shared JSON decoder as json.loads with the body's hooks, build_sampling_params' int64 checks."""
import json
import types

import pytest
from pydantic import BaseModel

from pagedllm.entrypoints.openai import body as body_mod
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import check_request_limits
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, field_or_none
from pagedllm.entrypoints.openai.request_params import build_sampling_params


class _WithProperty(BaseModel):
    a: int = 1

    @property
    def doubled(self) -> int:
        return 2 * self.a


def test_field_or_none_is_getattr_with_none():
    comp = CompletionRequest(prompt=[1, 2])
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    for req in (comp, chat, _WithProperty(a=3), types.SimpleNamespace(prompt="p", n=2)):
        for name in ("prompt", "messages", "n", "best_of", "guided_json_object", "doubled", "a"):
            assert field_or_none(req, name) == getattr(req, name, None), (type(req).__name__, name)


def test_limits_still_checked_through_field_or_none():
    with pytest.raises(APIError, match="'messages' may have"):
        check_request_limits(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}] * 4097))
    with pytest.raises(APIError, match="'prompt' may have"):
        check_request_limits(CompletionRequest(prompt=["a"] * 1025))


@pytest.mark.parametrize("raw", [
    b'{"a": 1.5, "b": [1, 2, {"c": "\\u00e9"}]}',
    '{"a": "\u00e9\u4e2d"}'.encode("utf-16"),
    '{"a": 2}'.encode("utf-32-le"),
    '\ufeff{"a": 1}'.encode("utf-8"),
    b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": 1e400}', b'{"a": ', b'\xff\xfe\x00',
])
def test_shared_decoder_is_json_loads_with_hooks(raw):
    def run(f):
        try:
            return ("ok", f())
        except Exception as e:  # noqa: BLE001 - the same exception type and message expected
            return (type(e), str(e))

    expected = run(lambda: json.loads(raw, parse_constant=body_mod._no_constant, parse_float=body_mod._finite_float))
    assert run(lambda: body_mod._loads(raw)) == expected


def test_sampling_params_int64_checks_and_best_of():
    req = CompletionRequest(prompt=[1], seed=2 ** 63)
    with pytest.raises(APIError, match="seed is out of range"):
        build_sampling_params(req, 4, None)
    req = CompletionRequest(prompt=[1], stop_token_ids=[2 ** 63])
    with pytest.raises(APIError, match="stop_token_ids must be non-negative"):
        build_sampling_params(req, 4, None)
    with pytest.raises(APIError, match="max_tokens is out of range"):
        build_sampling_params(CompletionRequest(prompt=[1]), 2 ** 64, None)
    assert build_sampling_params(CompletionRequest(prompt=[1], n=2, best_of=2), 4, None).best_of == 2
    plain = types.SimpleNamespace(**CompletionRequest(prompt=[1]).model_dump())
    del plain.best_of  # a request model without best_of: n is the default
    assert build_sampling_params(plain, 4, None).best_of == 1
