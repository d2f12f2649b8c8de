"""Each namespace's tenants as the router enforces them (pure; docs/tenants.md): who is asking, and whether
their limits have room.

Built from the namespace's InferenceTenants named ``tenants`` (``declaration.parse``) and the Secrets its
tenants' ``keys`` name (the router sees only those labelled ``gpufleet.dev/tenant-keys=true``). Rebuilt
after any change of either; the rules:

- A Secret or key that is missing, or holds a line that is no key record: that tenant has no valid key
  (its callers get 401) until it is fixed; the others are served. Said once in the log.
- A declaration that does not parse keeps the namespace's last good tenancy (nothing already accepted is
  lost). With none before it, the namespace is closed: every request gets 503 naming the problem and its
  fix, never served anonymously, since its platform asked for identities.
- A namespace without a declaration has no tenants: its requests are anonymous, as before issue 45.
- Each namespace's Limiter is kept across rebuilds (``Limiter.configure`` keeps budgets, debts and
  requests in flight), so a rotation or a reload never refills a budget.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
from typing import Iterable, Mapping

from gpufleet_api.tenants import declaration, keys, trusted, usage
from gpufleet_api.tenants.declaration import TenantsSpec
from gpufleet_api.tenants.identity import Identified, Refused
from gpufleet_api.typed import Invalid
from gpufleet_kit.tenant_limits import Limiter

# The usage.py reason of each way identifying a caller fails (the refusal's code, the metric's label).
REFUSAL_REASON = {"missing": usage.KEY_MISSING, "malformed": usage.KEY_MALFORMED, "unknown": usage.KEY_UNKNOWN}
# The names of the client's headers the guard never gets from it: only the router says who the tenant is
# (and with tenancy, it replaces them by the identified tenant and its weight).
GUARD_TENANCY_HEADERS = frozenset({usage.GUARD_TENANT_HEADER, usage.GUARD_WEIGHT_HEADER})
KEYS_SELECTOR = f"{usage.KEYS_SECRET_LABEL}=true"


@dataclasses.dataclass(frozen=True)
class Tenancy:
    """One namespace's tenants."""
    namespace: str
    spec: TenantsSpec
    keys: keys.KeyTable
    limiter: Limiter

    @functools.cached_property
    def declared(self) -> frozenset[str]:
        return frozenset(t.name for t in self.spec.tenants)

    @functools.cached_property
    def weights(self) -> dict[str, str]:
        """Each tenant's weight as the guard's header carries it."""
        return {t.name: str(t.weight) for t in self.spec.tenants}

    def identify(self, headers: Mapping[str, str]) -> Identified | Refused:
        """The caller's tenant from the request's headers (names in any case: aiohttp's are
        case-insensitive), or why not."""
        if self.spec.identity == "Trusted":
            return trusted.identify(headers, self.spec.trusted, self.declared)
        return self.keys.identify(headers.get("Authorization"))

    @functools.cached_property
    def dropped_headers(self) -> frozenset[str]:
        """The client's headers that never reach a guard: its key, and the names the tenant travels in."""
        return GUARD_TENANCY_HEADERS | {"authorization", self.spec.trusted.tenant_header}


@dataclasses.dataclass(frozen=True)
class Closed:
    """A namespace whose declaration never parsed: 503 with ``message`` until it is fixed."""
    namespace: str
    message: str


@dataclasses.dataclass(frozen=True)
class Built:
    namespaces: dict[str, Tenancy | Closed]
    problems: tuple[str, ...]


def build(declarations: Iterable[dict], secrets: Iterable[dict], previous: Mapping[str, Tenancy | Closed],
          now: float) -> Built:
    """Every namespace's tenancy from its InferenceTenants objects and the labelled Secrets in scope;
    ``previous`` (the last build) gives the last good tenancies and the limiters that are kept."""
    problems: list[str] = []
    data = {(s["metadata"].get("namespace", ""), s["metadata"]["name"]): s.get("data") or {} for s in secrets}
    out: dict[str, Tenancy | Closed] = {}
    for obj in sorted(declarations, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])):
        ns, name = obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
        if name != usage.TENANTS_NAME:
            problems.append(f"{ns}/{name}: only the {usage.TENANTS_KIND} named {usage.TENANTS_NAME!r} declares a "
                            f"namespace's tenants; this one is ignored (rename it, or merge it into that one)")
            continue
        old = previous.get(ns)
        try:
            spec = declaration.parse(obj.get("spec") or {})
        except Invalid as e:
            where = f"{ns}/{name}"
            if isinstance(old, Tenancy):
                problems.append(f"{where}: invalid ({e}); its last valid declaration is still enforced")
                # Its keys as its Secrets say now: a rotation still takes effect.
                out[ns] = Tenancy(ns, old.spec, key_table(ns, old.spec, data, problems), old.limiter) \
                    if old.spec.identity == "Keys" else old
            else:
                problems.append(f"{where}: invalid ({e}); the namespace's requests are refused until it is fixed")
                out[ns] = Closed(ns, f"The tenants of namespace {ns} are declared wrongly, so its requests are "
                                     f"refused until that is fixed: {e}. Fix the {usage.TENANTS_KIND} {name} "
                                     f"(kubectl -n {ns} edit {usage.TENANTS_PLURAL} {name}), or delete it to "
                                     f"serve the namespace without tenants.")
            continue
        limits = {t.name: t.limits for t in spec.tenants}
        if isinstance(old, Tenancy):
            old.limiter.configure(limits, now)
            limiter = old.limiter
        else:
            limiter = Limiter(limits, now)
        table = key_table(ns, spec, data, problems) if spec.identity == "Keys" else keys.KeyTable([])
        out[ns] = Tenancy(ns, spec, table, limiter)
    return Built(out, tuple(problems))


def key_table(ns: str, spec: TenantsSpec, data: Mapping[tuple[str, str], Mapping[str, str]],
              problems: list[str]) -> keys.KeyTable:
    """The key records of every tenant whose Secret key is there and readable; a tenant whose is not has
    no valid key (said in ``problems``), the others are unaffected."""
    texts: dict[str, str] = {}
    for tenant in spec.tenants:
        ref = tenant.keys
        if ref is None:
            continue
        where = f"Secret {ns}/{ref.name}, key {ref.key}"
        secret = data.get((ns, ref.name))
        encoded = None if secret is None else secret.get(ref.key)
        if encoded is None:
            unseen = "" if secret is not None else (f" (or the Secret lacks the label {KEYS_SELECTOR}, without "
                                                    f"which the router does not see it)")
            problems.append(f"{ns}: tenant {tenant.name!r} has no valid key: {where} is not there{unseen}")
            continue
        try:
            text = base64.b64decode(encoded, validate=True).decode()
            keys.KeyTable.parse({tenant.name: text}, {tenant.name: where})
        except (binascii.Error, UnicodeDecodeError):
            problems.append(f"{ns}: tenant {tenant.name!r} has no valid key: {where} is not base64 text")
            continue
        except Invalid as e:
            problems.append(f"{ns}: tenant {tenant.name!r} has no valid key until its Secret is fixed: {e}")
            continue
        texts[tenant.name] = text
    return keys.KeyTable.parse(texts)
