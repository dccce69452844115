"""The chat template's inputs beyond the messages: request fields vLLM hands to the template."""
from __future__ import annotations


def test_chat_request_documents_reach_the_template() -> None:
    """vLLM's `documents` (RAG) go to the chat template as `documents`: the field was ignored with a warning, so a
    template that lists them (Command-R's, Granite's) rendered none; chat_template_kwargs' own `documents` win."""
    from pagedllm.entrypoints.openai.chat_template import render_chat
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from tests.conftest import build_tiny_tokenizer

    template = ("{% for d in documents or [] %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
                "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Q?"}],
                                documents=[{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}])
    tok = build_tiny_tokenizer()
    text, _ = render_chat(tok, req.messages, False, False, template, documents=req.documents)
    assert text == "[A: alpha][B: beta]<user>Q?"
    text, _ = render_chat(tok, req.messages, False, False, template, {"documents": [{"title": "C", "text": "c"}]},
                          documents=req.documents)
    assert text == "[C: c]<user>Q?"
