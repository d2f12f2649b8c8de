"""The end of the demo's report: the slowest request of the surge and its trace, read back from the trace
store's query API (Jaeger's ``/api/traces``, then ``/api/traces/<id>``), not from the demo's own records:
which hops it took (each attempt at a guard, its admission, its exchange with vLLM and vLLM's own span) and
where its time went. The demo's client sends a sampled W3C ``traceparent`` with each request (one per
request, the same on each retry), so every request is traced and its attempts are one trace.

Pure apart from ``read``; ``render`` takes the API's JSON as it comes."""
from __future__ import annotations

import dataclasses

from gpufleet_api import tracing as names

from ..devcluster import traces

# Traces fetched for the window: the demo's surge sends a few hundred requests.
SEARCH_LIMIT = 5000


@dataclasses.dataclass(frozen=True)
class Hop:
    name: str
    service: str
    span_id: str
    parent_id: str
    start_us: int
    duration_us: int
    attributes: dict

    @property
    def end_us(self) -> int:
        return self.start_us + self.duration_us


def hops(trace: dict) -> list[Hop]:
    """A trace of the query API as its spans, in the order they began."""
    services = {key: p.get("serviceName", "") for key, p in (trace.get("processes") or {}).items()}
    out = [Hop(s["operationName"], services.get(s.get("processID", ""), ""), s["spanID"],
               next((r["spanID"] for r in s.get("references") or [] if r.get("refType") == "CHILD_OF"), ""),
               int(s["startTime"]), int(s["duration"]), {t["key"]: t["value"] for t in s.get("tags") or []})
           for s in trace.get("spans") or []]
    return sorted(out, key=lambda h: (h.start_us, -h.duration_us))


def _attempts(spans: list[Hop]) -> list[Hop]:
    return [h for h in spans if h.name == names.GUARD_REQUEST_SPAN]


def served(spans: list[Hop]) -> bool:
    """The request's last attempt was answered (HTTP 200)."""
    attempts = _attempts(spans)
    return bool(attempts) and attempts[-1].attributes.get(names.HTTP_STATUS) == 200


def duration_us(spans: list[Hop]) -> int:
    return max(h.end_us for h in spans) - min(h.start_us for h in spans) if spans else 0


def slowest(found: list[dict]) -> str | None:
    """The trace id of the slowest served request among the search's traces (of any request when none was
    served): from its first attempt's start to its last span's end."""
    candidates = [(served(spans), duration_us(spans), t["traceID"]) for t in found if (spans := hops(t))]
    if not candidates:
        return None
    pool = [c for c in candidates if c[0]] or candidates
    return max(pool, key=lambda c: c[1])[2]


def where_the_time_went(spans: list[Hop]) -> list[tuple[str, float]]:
    """Seconds of the request by where they went, largest first: attempts refused before the answering one
    (and the client's waits between them), the answering guard's queue, vLLM's own queue, prefill and decode
    (from vLLM's span; without it the exchange with vLLM as one part), and the rest (parse, relay)."""
    attempts = _attempts(spans)
    if not attempts:
        return []
    last = attempts[-1]
    total = duration_us(spans) / 1e6
    parts: dict[str, float] = {}
    before = (last.start_us - min(h.start_us for h in spans)) / 1e6
    if before > 0:
        parts[f"refused {len(attempts) - 1}x, then retried"] = before
    below = [h for h in spans if h.parent_id == last.span_id]
    admission = next((h for h in below if h.name == names.GUARD_ADMISSION_SPAN), None)
    exchange = next((h for h in below if h.name == names.GUARD_ENGINE_SPAN), None)
    if admission is not None:
        parts["the guard's queue"] = admission.duration_us / 1e6
    engine = next((h for h in spans if exchange is not None and h.parent_id == exchange.span_id
                   and h.name == names.ENGINE_REQUEST_SPAN), None)
    if engine is not None:
        a = engine.attributes
        parts["vLLM's queue"] = float(a.get(names.ENGINE_TIME_IN_QUEUE, 0.0))
        parts["vLLM's prefill"] = float(a.get(names.ENGINE_PREFILL_SECONDS, 0.0))
        parts["vLLM's decode"] = float(a.get(names.ENGINE_DECODE_SECONDS, 0.0))
    elif exchange is not None:
        parts["vLLM (its own spans off)"] = exchange.duration_us / 1e6
    parts["the rest (parse, relay, network)"] = max(0.0, total - sum(parts.values()))
    return sorted(parts.items(), key=lambda kv: -kv[1])


def _depth(hop: Hop, by_id: dict[str, Hop]) -> int:
    depth, parent = 0, by_id.get(hop.parent_id)
    while parent is not None:
        depth, parent = depth + 1, by_id.get(parent.parent_id)
    return depth


def _detail(hop: Hop) -> str:
    a = hop.attributes
    if hop.name == names.GUARD_REQUEST_SPAN:
        reason = a.get(names.REFUSAL_REASON)
        return f"HTTP {a.get(names.HTTP_STATUS, '?')}" + (f" ({reason})" if reason else "")
    if hop.name == names.GUARD_ADMISSION_SPAN and names.QUEUE_WAIT_SECONDS in a:
        return f"queued {float(a[names.QUEUE_WAIT_SECONDS]):.2f} s"
    if hop.name == names.ENGINE_REQUEST_SPAN:
        return (f"queue {float(a.get(names.ENGINE_TIME_IN_QUEUE, 0)):.2f} s, "
                f"prefill {float(a.get(names.ENGINE_PREFILL_SECONDS, 0)):.2f} s, "
                f"decode {float(a.get(names.ENGINE_DECODE_SECONDS, 0)):.2f} s, "
                f"{a.get(names.ENGINE_COMPLETION_TOKENS, '?')} tokens")
    return ""


def render(trace: dict, query: str) -> list[str]:
    """The report's lines for one trace of the query API."""
    spans = hops(trace)
    by_id = {h.span_id: h for h in spans}
    start, total = min(h.start_us for h in spans), duration_us(spans)
    outcome = "answered" if served(spans) else "not answered"
    lines = [f"The slowest request of the surge ({outcome}), from the trace store: {total / 1e6:.2f} s",
             f"  trace {trace['traceID']}: {query}/trace/{trace['traceID']}", "  hops:"]
    for h in spans:
        indent = "  " * _depth(h, by_id)
        lines.append(f"  {(h.start_us - start) / 1e6:+8.3f} s  {indent}{h.name:<{24 - len(indent)}} "
                     f"{h.service:<15} {h.duration_us / 1e6:7.3f} s  {_detail(h)}".rstrip())
    went = where_the_time_went(spans)
    if went:
        lines.append("  where the time went: " + ", ".join(
            f"{part} {seconds:.2f} s ({seconds / (total / 1e6) if total else 0:.0%})" for part, seconds in went))
    return lines


def no_store_lines() -> list[str]:
    return ["No trace store ran, so the slowest request's trace is not shown. `scripts/setup.sh` without",
            "--no-traces builds Jaeger (about 9 minutes on 2 cores); then `gpufleet dev down` and `make demo`",
            "again: the demo traces every request, and its report ends with the slowest one's hops."]


def read(query: str, window: tuple[float, float]) -> list[str]:
    """The report's lines for the slowest request that began in ``window`` (unix times), read from the
    query API at ``query``."""
    found = traces.find_traces(query, names.GUARD_SERVICE_NAME, limit=SEARCH_LIMIT,
                               operation=names.GUARD_REQUEST_SPAN, window=window)
    trace_id = slowest(found)
    if trace_id is None:
        return [f"No trace of the surge in the trace store ({query}): were the guards' spans exported?"]
    trace = traces.read_trace(query, trace_id)   # the whole trace: vLLM's spans too
    return render(trace, query) if trace else [f"Trace {trace_id} could not be read back from {query}"]
