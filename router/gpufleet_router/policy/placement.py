"""What the policy needs to place one request, read from its body the same way by both front doors (pure): the
router's own HTTP server and the gateway's endpoint picker (epp/). ``place`` parses the body, finds the service
(or the LoRA adapter of one) its ``model`` names, and keys its prompt's prefix and estimates its KV blocks;
``ranked`` orders the replicas a request may go to, the first the one ``Picker.pick`` chooses, the rest the ones
a retry would get (the same revision first, as the router's own retries)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

from gpufleet_api.guard import kv_blocks

from . import adapters
from . import requests as rq
from .choice import Pick, Picker
from .prefixes import MATCH_BLOCKS, Prefix, prefix_of
from .table import Route, Table


@dataclasses.dataclass(frozen=True)
class Placement:
    """One request as the policy sees it."""
    route: str                  # the OpenAI path
    parsed: rq.Parsed
    target: Route
    adapter: adapters.Adapter | None   # the LoRA adapter ``model`` names; None: the base model
    prefix: Prefix | None       # the prompt's leading blocks, for prefix affinity
    cost: int                   # KV blocks it will hold at most (estimated)

    @property
    def adapter_name(self) -> str | None:
        return self.adapter.name if self.adapter is not None else None


# The prompt's token ids as vLLM will see them (the body, its route, the service), or None where the router
# cannot tokenize it as vLLM does (no tokenizer from the service's guards yet, a multimodal prompt).
Tokenize = Callable[[dict, str, Route], Sequence[int] | None]


class UnknownModel(rq.BadRequest):
    """``model`` names nothing served here (vLLM's 404, naming what is)."""


def place(body: bytes, route: str, table: Table, catalog: adapters.Catalog, prefix_blocks: int,
          tokenize: Tokenize | None = None) -> Placement:
    """The request's placement; rq.BadRequest (UnknownModel for a name nothing serves) naming the field.
    ``tokenize``: the prefix also carries its token blocks' chain, which the guards' feeds are looked up by."""
    parsed = rq.parse(body, route)
    resolved = adapters.resolve(parsed.model, table, catalog)
    if resolved is None:
        # vLLM's 404 (OpenAI's shape, vLLM's type and numeric code), naming what is served here.
        raise UnknownModel(404, adapters.not_found_message(parsed.model, table, catalog), param="model", code=404,
                           kind="NotFoundError")
    target, adapter = resolved.route, resolved.adapter
    adapter_name = adapter.name if adapter else None
    prefix = prefix_of(parsed.prompt, target.block_size * rq.CHARS_PER_TOKEN, prefix_blocks, adapter=adapter_name)
    ids = tokenize(parsed.doc, route, target) if tokenize is not None and prefix is not None else None
    if prefix is not None and ids:
        tokens = kv_blocks.chain(ids, target.block_size, adapter_name, limit=max(MATCH_BLOCKS, prefix_blocks))
        if tokens:
            prefix = dataclasses.replace(prefix, tokens=tokens, block_size=target.block_size)
    # Counted where tokenized: the characters' estimate runs up to 1.5x over, and a replica holding the prompt's
    # blocks needs room for the rest only (choice.py), which the estimate would overstate by as much.
    cost = parsed.cost_blocks(target.block_size, route, len(ids) if ids else None)
    return Placement(route, parsed, target, adapter, prefix, cost)


def ranked(picker: Picker, placement: Placement, limit: int, exclude: Iterable[str] = (),
           prefix: Prefix | None = None) -> list[Pick]:
    """Up to ``limit`` replicas in the order the request should try them: the policy's pick, then each next pick
    with the ones before excluded and the first one's revision kept where a replica of it is eligible (a retry
    stays with what the request was placed on, as Forwarder._send's retries do). ``prefix``: the one to place by
    (None for a pool the policy places by room alone, as a disaggregated service's decode)."""
    tried = list(exclude)
    out: list[Pick] = []
    revision: str | None = None
    while len(out) < limit:
        pick = picker.pick(placement.cost, prefix, exclude=tried, adapter=placement.adapter_name, revision=revision)
        if pick is None:
            break
        out.append(pick)
        tried.append(pick.replica.pod)
        revision = revision if revision is not None else pick.replica.revision
    return out


def all_refuse(picker: Picker, picks: Iterable[Pick], cost: int) -> bool:
    """Every replica's last reading says it has no room for ``cost`` blocks (net of the sends since): its guard
    would answer 429. A replica not read yet may have room."""
    rooms = [picker.room(p.replica.pod) for p in picks]
    return bool(rooms) and all(room is not None and room < cost for room in rooms)
