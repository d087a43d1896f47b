"""/v1/chat/completions: a conversation rendered to one prompt by the model's chat template, as
transformers renders it (Jinja2 in a sandbox, over `messages` and `add_generation_prompt`, with the
tokenizer's special tokens as variables), and validation of a chat request body.

A tokenizer's template comes from its tokenizer_config.json (`hybridpar data train-tokenizer` writes a
ChatML one); a byte-level model gets the plain DEFAULT_TEMPLATE. The answer ends at the tokenizer's
end-of-sequence token (eos_token, `<|im_end|>` for ChatML), which is not part of the text.
"""

from __future__ import annotations

from typing import Any, Callable

from hybridpar.serve.api import ApiError, _short, _text, load_body, parse_options

# For models without a template of their own (byte-level): one "role: content" line per message.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
ROLES = ("system", "user", "assistant", "developer", "tool")


class ChatTemplate:
    """A compiled chat template; `render(messages)` gives the prompt text (TemplateError for a template
    that fails on these messages, e.g. one that raises on a role it does not know)."""

    def __init__(self, source: str, variables: dict[str, Any] | None = None) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:  # what transformers' templates call to refuse input
            from jinja2.exceptions import TemplateError

            raise TemplateError(message)

        # As transformers compiles chat templates: blocks trimmed, sandboxed (a template is data, not code).
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.variables = variables or {}

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True, **self.variables)


def parse_chat(
    raw: bytes, model_name: str, max_seq_len: int, render: Callable[[list[dict[str, str]]], str], tokenize: Callable
) -> dict[str, Any]:
    """Validate a /v1/chat/completions body; the request as the service takes it, or ApiError."""
    from jinja2.exceptions import TemplateError

    body = load_body(raw, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ApiError(
                400,
                f"messages[{i}] must be an object with a role ({', '.join(ROLES)}) and a string content, "
                f"got {_short(m)}",
                "messages",
            )
        plain.append({"role": m["role"], "content": _text(m["content"], f"messages[{i}].content")})
    if body.get("logprobs") not in (None, False):
        raise ApiError(400, "logprobs is not supported by this server", "logprobs")
    try:
        prompt = render(plain)
    except TemplateError as e:
        raise ApiError(400, f"the chat template refuses these messages: {e}", "messages") from None
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), 16)
    rest = {k: v for k, v in body.items() if k != "logprobs"}
    return parse_options(rest, tokenize(prompt), max_seq_len, max_tokens)
