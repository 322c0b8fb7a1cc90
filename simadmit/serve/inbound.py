"""Reading an OpenAI-compatible request: its body, its tier and its deadline, or a clear 4xx saying why not.

What the admission layer needs from a request is what the simulator's `Request` holds: the tier (a header,
else the API key's tier in the scenario, else the default tier), the prompt length (counted by a backend's
`/tokenize`), `max_tokens` and an optional deadline (a header, in seconds from arrival). A request without
`max_tokens` gets its tier's `max_tokens` from the scenario written into the body it is forwarded with, so
what is charged is what the backend enforces.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from simadmit.config.errors import TOO_DEEP

COMPLETIONS = "completions"
CHAT = "chat"


class ClientError(Exception):
    """A request the gateway refuses before admission: HTTP `status` and a one-line message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A validated request body, ready to be tokenized and forwarded."""

    route: str  # COMPLETIONS | CHAT
    body: dict[str, Any]  # what goes to the backend (max_tokens filled in)
    stream: bool
    max_tokens: int
    token_ids: int | None  # prompt length when the prompt is given as token ids


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ClientError(400, f"'{key}' must be a positive integer, got {value!r}")
    return value


def parse_body(raw: bytes, route: str, default_max_tokens: int) -> OpenAIRequest:
    """Validate a /v1/completions or /v1/chat/completions body (one prompt, one choice)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ClientError(400, f"request body is not valid JSON: {e}") from None
    except ValueError:  # Python's reader refuses integers of more than 4300 digits
        raise ClientError(400, "request body is not valid JSON: a number too long") from None
    except RecursionError:
        raise ClientError(400, f"request body is not valid JSON: {TOO_DEEP}") from None
    if not isinstance(body, dict):
        raise ClientError(400, "request body must be a JSON object")
    token_ids = None
    if route == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ClientError(400, "missing field 'messages': a non-empty list of messages")
        if not all(isinstance(m, dict) for m in messages):
            raise ClientError(400, "'messages' must be a list of objects")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            token_ids = len(prompt)
        elif not isinstance(prompt, str) or not prompt:
            raise ClientError(
                400,
                "missing field 'prompt': a non-empty string or list of token ids (one prompt per request)",
            )
    n = body.get("n", 1)
    if n != 1:
        raise ClientError(400, f"'n' must be 1 behind the admission gateway, got {n!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ClientError(400, f"'stream' must be true or false, got {stream!r}")
    keys = ("max_tokens", "max_completion_tokens") if route == CHAT else ("max_tokens",)
    given = [v for v in (_positive_int(body, k) for k in keys) if v is not None]
    max_tokens = min(given) if given else default_max_tokens
    if not given:
        body["max_tokens"] = max_tokens
    return OpenAIRequest(route, body, stream, max_tokens, token_ids)


def tokenize_payload(req: OpenAIRequest) -> dict[str, Any]:
    """The body of vLLM's `/tokenize` for this request (its chat template applied for chat)."""
    out: dict[str, Any] = {}
    if "model" in req.body:
        out["model"] = req.body["model"]
    if req.route == CHAT:
        out["messages"] = req.body["messages"]
        out["add_generation_prompt"] = True
    else:
        prompt = req.body["prompt"]
        out["prompt"] = prompt[0] if isinstance(prompt, list) else prompt
    return out


def tier_of(
    headers: Mapping[str, str], tier_header: str, api_keys: Mapping[str, str], default: str, known: set[str]
) -> str:
    """The request's tier: its tier header, else its API key's tier, else the default; unknown -> 400."""
    tier = headers.get(tier_header)
    if tier is None and api_keys:
        auth = headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        tier = api_keys.get(key)
    if tier is None:
        return default
    if tier not in known:
        raise ClientError(400, f"unknown tier {tier!r} (known: {', '.join(sorted(known))})")
    return tier


def elapsed_of(headers: Mapping[str, str], header: str) -> float:
    """Seconds a retrying client says it has been trying (0 when it says nothing); a bad value -> 400."""
    value = headers.get(header)
    if value is None:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        raise ClientError(400, f"header {header} must be a non-negative number of seconds, got {value!r}")
    return seconds


def deadline_of(headers: Mapping[str, str], header: str, arrival_s: float) -> float | None:
    """Absolute deadline from a header giving the seconds the client can wait; a bad value -> 400."""
    value = headers.get(header)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        raise ClientError(400, f"header {header} must be a positive number of seconds, got {value!r}")
    return arrival_s + seconds
