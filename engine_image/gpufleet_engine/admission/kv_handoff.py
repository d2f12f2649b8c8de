"""Which part of vLLM's prefill/decode protocol a request is, from its body alone.

A disaggregated service's router (gpufleet's, or vllm-router's P/D mode) sends
each request twice: to a prefill pod with ``kv_transfer_params:
{"do_remote_decode": true, ...}`` and ``max_tokens: 1``, then to a decode pod
with the ``kv_transfer_params`` the prefill answered (``null`` when its
connector returns none, as the shared-storage connector does: it finds KV by
the prompt's hash). What each costs differs:

- ``prefill``: vLLM computes the prompt and hands its KV on; it holds the
  prompt's blocks and no answer (the one token it samples never gets KV). Its
  answer is its first token.
- ``decode``: vLLM loads the prompt's KV instead of computing it (all but the
  last, partial block), then generates the answer: it holds prompt and answer
  like a whole request, and its prefill is at most one block of compute.
- ``whole``: any other request (a unified pod, or one sent to a pool directly).

Pure: the admission core (core.py, reservations.py) and the exchange read it.
"""
from __future__ import annotations

from typing import Any, Literal

from gpufleet_engine.admission.context import InvalidRequest

KV_TRANSFER_PARAMS = "kv_transfer_params"

Phase = Literal["whole", "prefill", "decode"]
WHOLE: Phase = "whole"
PREFILL: Phase = "prefill"
DECODE: Phase = "decode"
HANDOFF_PHASES: tuple[Phase, ...] = (PREFILL, DECODE)


def phase_of(body: dict[str, Any]) -> Phase:
    """The request's part in the hand-off; InvalidRequest when ``kv_transfer_params`` is neither an
    object nor null (vLLM's protocol types it so)."""
    if KV_TRANSFER_PARAMS not in body:
        return WHOLE
    params = body[KV_TRANSFER_PARAMS]
    if params is None:
        return DECODE
    if not isinstance(params, dict):
        raise InvalidRequest(f"{KV_TRANSFER_PARAMS} must be an object or null, got {type(params).__name__}",
                             KV_TRANSFER_PARAMS)
    return PREFILL if params.get("do_remote_decode") is True else DECODE


def computed_prompt_tokens(phase: str, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens vLLM computes for one prompt: all of them, except after a hand-off, where the
    connector loads the full blocks before the last token and vLLM computes the rest, 1 to
    ``block_size + 1`` tokens. (The shared-storage connector loads ``(prompt - 2) // block_size``
    blocks, the most conservative of vLLM's connectors; NIXL loads as many or one more.)"""
    if phase != DECODE or prompt_tokens < 2:
        return prompt_tokens
    return prompt_tokens - (prompt_tokens - 2) // block_size * block_size
