"""Counting a prompt's tokens in the gateway itself, from a Hugging Face `tokenizer.json`.

The default is a backend's `/tokenize` (exact, chat template included, one round trip per request); with
`gateway.http.tokenizer` set the gateway counts locally instead (the `tokenizers` package, Rust, about a
millisecond for thousands of tokens). A chat request is then counted as its messages' text plus
`CHAT_TOKENS_PER_MESSAGE` for the role markers a chat template adds: close enough to charge its cost, and a
request that is really too long is still refused by the backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from simadmit.config.errors import SPECIAL, InputError, problem
from simadmit.serve.inbound import CHAT, OpenAIRequest

CHAT_TOKENS_PER_MESSAGE = 4


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class LocalTokenizer:
    def __init__(self, path: Path, scenario: str | Path | None = None) -> None:
        """The tokenizer.json at `path`; its problems name the `scenario` file and its field."""
        field = "gateway.http.tokenizer"
        try:
            from tokenizers import Tokenizer
        except ImportError:
            why = "counting tokens locally needs the tokenizers package (pip install tokenizers)"
            raise InputError([problem(scenario, field, why)]) from None
        if not path.is_file():
            why = "is a folder" if path.is_dir() else SPECIAL if path.exists() else "file not found"
            raise InputError([problem(scenario, field, f"{path}: {why}")])
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise InputError([problem(scenario, field, f"{path}: not a tokenizer.json ({e})")]) from None

    def count(self, req: OpenAIRequest) -> int:
        if req.route == CHAT:
            messages = req.body["messages"]
            texts = [_text(m.get("content")) for m in messages]
            return sum(len(self.tokenizer.encode(t).ids) for t in texts) + CHAT_TOKENS_PER_MESSAGE * len(
                messages
            )
        prompt = req.body["prompt"]
        return len(self.tokenizer.encode(prompt[0] if isinstance(prompt, list) else prompt).ids)
