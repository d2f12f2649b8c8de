"""What the policy needs to place one request, read from its body the same way by both front doors (pure): the
router's own HTTP server and the gateway's endpoint picker (epp/). ``place`` parses the body, finds the service
(or the LoRA adapter of one) its ``model`` names, and keys its prompt's prefix and estimates its KV blocks;
``ranked`` orders the replicas a request may go to, the first the one ``Picker.pick`` chooses, the rest the ones
a retry would get (the same revision first, as the router's own retries)."""
from __future__ import annotations

import dataclasses
from typing import Iterable

from . import adapters
from . import requests as rq
from .choice import Pick, Picker
from .prefixes import Prefix, prefix_of
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


class UnknownModel(rq.BadRequest):
    """``model`` names nothing served here (vLLM's 404, naming what is)."""


def place(body: bytes, route: str, table: Table, catalog: adapters.Catalog, prefix_blocks: int) -> Placement:
    """The request's placement; rq.BadRequest (UnknownModel for a name nothing serves) naming the field."""
    parsed = rq.parse(body, route)
    resolved = adapters.resolve(parsed.model, table, catalog)
    if resolved is None:
        # vLLM's 404 (OpenAI's shape, vLLM's type and numeric code), naming what is served here.
        raise UnknownModel(404, adapters.not_found_message(parsed.model, table, catalog), param="model", code=404,
                           kind="NotFoundError")
    target, adapter = resolved.route, resolved.adapter
    prefix = prefix_of(parsed.prompt, target.block_size * rq.CHARS_PER_TOKEN, prefix_blocks,
                       adapter=adapter.name if adapter else None)
    return Placement(route, parsed, target, adapter, prefix, parsed.cost_blocks(target.block_size, route))


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
