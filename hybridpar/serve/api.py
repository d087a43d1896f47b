"""The OpenAI-compatible API's data, apart from any transport: the error body every failure is
answered with and validation of a /v1/completions body.

Validation is total: whatever bytes a client sends, `parse_completion` returns a request or raises
ApiError (a 4xx naming the parameter) — never another exception, which would be a 500."""

from __future__ import annotations

import json
from typing import Any, Callable

MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI's API takes up to 4 stop sequences


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    # The range test comes first and rejects NaN and ±inf too; math.isfinite would raise OverflowError
    # on an integer too large for a float (JSON allows 1 followed by hundreds of zeros).
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo}, {hi}], got {_short(v)}", key)
    return float(v)


def _short(v: Any) -> str:
    """`v` for an error message: a client's value can be a 4000-digit number or nested 900 deep."""
    if isinstance(v, int) and not -(10**30) < v < 10**30:
        return f"an integer of {len(str(abs(v)))} digits"
    try:
        text = repr(v)
    except RecursionError:
        return f"a deeply nested {type(v).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _text(v: str, key: str) -> str:
    """A string that is valid Unicode: JSON's \\ud800 escapes decode to lone surrogates, which
    cannot be encoded (as UTF-8 bytes, our tokens) and are no text."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400, f"{key} is not valid Unicode: a lone surrogate {v[e.start]!r} at character {e.start}", key
        ) from None
    return v


def load_body(raw: bytes, model_name: str) -> dict[str, Any]:
    """The JSON object of a request body, for this server's model (ApiError otherwise)."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not UTF-8: {e}") from None
    except RecursionError:  # json's C parser recurses once per nesting level
        raise ApiError(400, "request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and numbers of more than sys.get_int_max_str_digits() digits
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    if body.get("model") != model_name:
        raise ApiError(
            404,
            f"model {_short(body.get('model'))} does not exist; this server serves {model_name!r}",
            "model",
            code="model_not_found",
        )
    return body


def parse_completion(
    raw: bytes, model_name: str, max_seq_len: int, vocab_size: int, tokenize: Callable[[Any], list[int]]
) -> dict[str, Any]:
    """Validate a /v1/completions body; returns the request as the service takes it, or raises ApiError."""
    body = load_body(raw, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # the client wraps a single string in a list
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
    elif isinstance(prompt, str) and prompt:
        _text(prompt, "prompt")
    else:
        raise ApiError(
            400, "prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt"
        )
    return parse_options(body, tokenize(prompt), max_seq_len, body.get("max_tokens", 16))


def parse_options(body: dict[str, Any], ids: list[int], max_seq_len: int, max_tokens: Any) -> dict[str, Any]:
    """The generation options shared by /v1/completions and /v1/chat/completions, for prompt `ids`."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, f"max_tokens must be a positive integer, got {_short(max_tokens)}", "max_tokens")
    if len(ids) + max_tokens > max_seq_len:
        raise ApiError(
            400,
            f"prompt of {len(ids)} tokens + max_tokens={_short(max_tokens)} exceeds this server's "
            f"maximum of {max_seq_len} tokens (its max_seq_len and KV-cache budget)",
            "prompt",
            code="context_length_exceeded",
        )
    for key, allowed in (
        ("n", (None, 1)),
        ("best_of", (None, 1)),
        ("echo", (None, False)),
        ("logprobs", (None,)),
        ("suffix", (None,)),
    ):
        if body.get(key) not in allowed:
            raise ApiError(400, f"{key}={_short(body.get(key))} is not supported by this server", key)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ApiError(400, f"seed must be a non-negative integer below 2**63, got {_short(seed)}", "seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (
        isinstance(stop, list)
        and len(stop) <= MAX_STOPS
        and all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stop)
    ):
        raise ApiError(
            400,
            f"stop must be a string or a list of at most {MAX_STOPS} strings, each 1 to "
            f"{MAX_STOP_CHARS} characters, got {_short(body.get('stop'))}",
            "stop",
        )
    for x in stop:
        _text(x, "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {_short(stream)}", "stream")
    return {
        **_stream_options(body.get("stream_options"), stream),
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 1e-6, 1.0),
        "seed": seed,
        "stream": stream,
        "stop": stop,
    }


def _stream_options(options: Any, stream: bool) -> dict[str, bool]:
    """OpenAI's stream_options: {include_usage: bool} (a last chunk with the usage), for streams only."""
    if options is None:
        return {"include_usage": False}
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, f"stream_options must be {{include_usage: bool}}, got {_short(options)}", "stream_options")
    if extra := sorted(set(options) - {"include_usage"}):
        raise ApiError(400, f"stream_options {', '.join(map(_short, extra))} is not supported", "stream_options")
    return {"include_usage": options.get("include_usage", False)}
