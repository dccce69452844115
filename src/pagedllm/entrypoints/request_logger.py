"""--enable-log-requests / --enable-log-outputs / --max-log-len (vLLM's RequestLogger): a line per request received
(its sampling parameters; the prompt at debug level) and, with --enable-log-outputs, a line per finished sample
with its text, token ids and finish reason, in vLLM's words so that log readers match both."""
from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger("pagedllm.request_logger")


class RequestLogger:
    def __init__(self, max_log_len: Optional[int] = None, log_outputs: bool = False) -> None:
        self.max_log_len = max_log_len
        self.log_outputs = log_outputs

    def log_inputs(self, request_id: str, prompt: Optional[str], prompt_token_ids: Optional[list[int]],
                   params: Any, lora_request: Any) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            n = self.max_log_len
            logger.debug("Request %s prompt: %r, prompt_token_ids: %s.", request_id,
                         prompt if prompt is None or n is None else prompt[:n],
                         prompt_token_ids if prompt_token_ids is None or n is None else prompt_token_ids[:n])
        logger.info("Received request %s: params: %s, lora_request: %s.", request_id, params, lora_request)

    def log_output(self, request_id: str, text: Optional[str], token_ids: Optional[list[int]],
                   finish_reason: Optional[str], is_streaming: bool = False) -> None:
        n = self.max_log_len
        if n is not None:
            text = None if text is None else text[:n]
            token_ids = None if token_ids is None else list(token_ids)[:n]
        logger.info("Generated response %s%s: output: %r, output_token_ids: %s, finish_reason: %s", request_id,
                    " (streaming complete)" if is_streaming else "", text, token_ids, finish_reason)
