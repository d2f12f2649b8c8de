"""A request's prompt tokenized as vLLM's OpenAI server tokenizes it, from the files a guard serves.

vLLM renders a chat with the model's chat template (or the request's ``chat_template`` where it is told to
trust one; here only where it is the model's own, which the bench and some gateways send) through
transformers' sandboxed Jinja environment, the generation prompt added, and tokenizes the text without adding
special tokens again; a completions prompt is tokenized with them. This does the same with the ``tokenizers``
library and Jinja2 (no transformers or torch in the router): the token ids only have to match vLLM's for the
prompt's leading blocks to be found in what its prefix cache holds, and a request this cannot render (images,
a template that fails) returns None and is placed by what the router learned instead.

The template and the tokenizer come from the service's model and run on the router's event loop: a service
whose prompt took longer than ``SLOW_SECONDS`` is not tokenized again by this router. One slow render still
holds the loop for its length; running them out of the router's process, with a deadline, is not built.
"""
from __future__ import annotations

import collections
import datetime
import logging
import time
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from gpufleet_api.guard.kv_blocks import TokenizerFiles

from .policy import requests as rq

log = logging.getLogger(__name__)

TEMPLATES_KEPT = 16   # compiled chat templates
# A prompt whose template and tokenizer took longer than this turns the service's tokenizing off in this router
# (its prompts are placed by what the router learned): the template and the tokenizer come from the service's
# model, and they run on the router's event loop, which every tenant's requests share.
SLOW_SECONDS = 0.25


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class PromptTokens:
    def __init__(self, files: TokenizerFiles):
        self.tokenizer = Tokenizer.from_str(files.tokenizer)
        self.chat_template = files.chat_template
        self.special_tokens = dict(files.special_tokens)
        # transformers' environment for chat templates (its chat_template_utils): the same options and globals.
        self._env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self._env.globals["raise_exception"] = _raise
        self._env.globals["strftime_now"] = _strftime_now
        self._templates: collections.OrderedDict[str, jinja2.Template] = collections.OrderedDict()
        self.off_because = ""   # why this router no longer tokenizes the service's prompts (SLOW_SECONDS)

    def ids(self, doc: dict, route: str) -> Sequence[int] | None:
        """The prompt's token ids, or None where they cannot be known here."""
        if self.off_because:
            return None
        started = time.monotonic()
        try:
            return self._ids(doc, route)
        finally:
            took = time.monotonic() - started
            if took > SLOW_SECONDS:
                self.off_because = f"one prompt took {took:.2f}s to render and tokenize"
                log.warning("stopped tokenizing this service's prompts: %s (its chat template or tokenizer is "
                            "too slow to run on the router's event loop); they are placed by what the router "
                            "learned", self.off_because)

    def _ids(self, doc: dict, route: str) -> Sequence[int] | None:
        try:
            if route == rq.CHAT:
                return self._chat(doc)
            if route == rq.COMPLETIONS:
                prompt = doc.get("prompt")
                if isinstance(prompt, str):
                    return self.tokenizer.encode(prompt, add_special_tokens=True).ids
                if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                    return prompt
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, AttributeError):
            return None
        return None

    def _chat(self, doc: dict) -> Sequence[int] | None:
        messages = doc.get("messages")
        # A request's own template only where it is the model's: any client may send one, and it would run on
        # the router every tenant shares (vLLM itself refuses one unless started with
        # --trust-request-chat-template). Any other is left to the learned placement.
        own = doc.get("chat_template")
        if own is not None and own != self.chat_template:
            return None
        template_text = self.chat_template
        if not isinstance(messages, list) or not isinstance(template_text, str):
            return None
        conversation = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            content = message.get("content")
            if isinstance(content, list):
                # vLLM's "string" content format: the text parts joined by newlines; anything else (an
                # image) is not text this can tokenize.
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    return None
                content = "\n".join(str(p.get("text", "")) for p in content)
            conversation.append({**message, "content": content})
        kwargs: dict[str, Any] = dict(self.special_tokens)
        extra = doc.get("chat_template_kwargs")
        if isinstance(extra, dict):
            kwargs.update(extra)
        kwargs.update(messages=conversation, add_generation_prompt=doc.get("add_generation_prompt", True),
                      continue_final_message=doc.get("continue_final_message", False))
        if doc.get("tools") is not None:
            kwargs["tools"] = doc["tools"]
        text = self._template(template_text).render(**kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _template(self, text: str) -> jinja2.Template:
        template = self._templates.get(text)
        if template is None:
            template = self._templates[text] = self._env.from_string(text)
            while len(self._templates) > TEMPLATES_KEPT:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(text)
        return template
