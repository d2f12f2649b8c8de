"""Token counting the way vLLM counts, and left-truncation.

Completions prompts are tokenized with special tokens added; chat messages
are rendered with the model's chat template (generation prompt added) and
tokenized without adding special tokens again. That mirrors vLLM's OpenAI
server, so the guard's count matches the ``usage.prompt_tokens`` vLLM returns.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Sequence

from gpufleet_api.guard import kv_blocks


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]:
        """Token ids of a completions prompt."""

    def decode(self, ids: Sequence[int]) -> str:
        ...

    def chat_ids(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        """Token ids of a chat conversation with the generation prompt."""


class HfTokenizer:
    """A ``transformers`` tokenizer (the model's own, from its folder or id)."""

    def __init__(self, hf_tokenizer: Any):
        self._tok = hf_tokenizer
        self._portable: kv_blocks.TokenizerFiles | None = None

    @classmethod
    def load(cls, name_or_path: str, revision: str | None = None) -> "HfTokenizer":
        """``revision``: the model repository's branch, tag or commit, the one vLLM loads
        (``--tokenizer-revision``); None for the default branch or a local folder."""
        from transformers import AutoTokenizer  # heavy import; only the real server pays it

        if revision:
            return cls(AutoTokenizer.from_pretrained(name_or_path, revision=revision))
        return cls(AutoTokenizer.from_pretrained(name_or_path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def chat_ids(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        text = self._tok.apply_chat_template(messages, tokenize=False, **template_kwargs)
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def portable(self) -> kv_blocks.TokenizerFiles | None:
        """The tokenizer as the router loads it (the ``tokenizers`` library's JSON, the chat template and the
        special tokens the template names); None for a slow tokenizer, which has no such file."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if self._portable is None and backend is not None:
            template = getattr(self._tok, "chat_template", None)
            special = {k: v for k, v in self._tok.special_tokens_map.items() if isinstance(v, str)}
            self._portable = kv_blocks.TokenizerFiles(backend.to_str(), template if isinstance(template, str)
                                                      else None, special)
        return self._portable


def keep_last(ids: Sequence[int], keep: int) -> list[int]:
    """The newest ``keep`` tokens: left-truncation keeps the end of the context."""
    if keep <= 0:
        return []
    return list(ids[-keep:])


def truncate_text_left(tokenizer: Tokenizer, text: str, drop: int) -> str:
    """``text`` without roughly its first ``drop`` tokens (as counted standalone)."""
    ids = tokenizer.encode(text)
    if drop >= len(ids):
        return ""
    return tokenizer.decode(ids[drop:])


def generation_default_max_tokens(model: str) -> int | None:
    """``max_new_tokens`` of the model folder's generation_config.json: vLLM's default max_tokens
    for a chat without one (``--generation-config auto``). None when unset or not a local folder."""
    try:
        config = json.loads((Path(model) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_new_tokens") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
