"""What the router, the dashboards, the alerts and ``gpufleet usage`` agree on about tenants: the kind that
declares them, the label of the Secrets holding their keys, the header a tenant travels to the guard in,
and the usage metrics with their labels and refusal reasons. One source: each reader imports these names.
"""
from __future__ import annotations

from .declaration import TENANT_HEADER

# The declaration: one object of this kind per namespace, named TENANTS_NAME (docs/tenants.md).
TENANTS_KIND = "InferenceTenants"
TENANTS_PLURAL = "inferencetenants"
TENANTS_SINGULAR = "inferencetenants"
TENANTS_NAME = "tenants"
# The router watches only Secrets carrying this label (value "true"): the ones a declaration names.
KEYS_SECRET_LABEL = "gpufleet.dev/tenant-keys"

# The router sets this header to the request's tenant on its way to the guard (the guard keys its fair
# lane on it), after dropping whatever a client sent under that name.
GUARD_TENANT_HEADER = TENANT_HEADER
# ... and the tenant's declared weight (1..1000) in this one: the guard has no declaration of its own.
GUARD_WEIGHT_HEADER = "x-gpufleet-tenant-weight"

# Usage, counted by the router per namespace, service, model and tenant (labels.tenant_label: declared
# tenants, else "unknown").
PREFIX = "gpufleet_tenant_"
REQUESTS = PREFIX + "requests_total"                    # requests forwarded to a replica
REFUSALS = PREFIX + "refusals_total"                    # + label reason (REFUSAL_REASONS or the guard's)
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
CACHED_PROMPT_TOKENS = PREFIX + "cached_prompt_tokens_total"
ANSWER_TOKENS = PREFIX + "answer_tokens_total"
# Per namespace and tenant: the share of each limit in use now (0..1; a token bucket in debt reads over 1),
# label limit in LIMITS.
LIMIT_USED = PREFIX + "limit_used_ratio"
USAGE_LABELS = ("namespace", "service", "model", "tenant")

# Why the router refused a tenant's request before any guard (the guard's own refusals keep their reason).
KEY_MISSING = "key_missing"
KEY_MALFORMED = "key_malformed"
KEY_UNKNOWN = "key_unknown"
RATE_LIMIT = "requests_per_second"
TOKEN_LIMIT = "tokens_per_minute"
CONCURRENCY_LIMIT = "concurrent_requests"
AUTH_REASONS = (KEY_MISSING, KEY_MALFORMED, KEY_UNKNOWN)
LIMITS = (RATE_LIMIT, TOKEN_LIMIT, CONCURRENCY_LIMIT)
REFUSAL_REASONS = AUTH_REASONS + LIMITS
# The 503 codes of a namespace the router cannot judge: its declaration never parsed, or the router could not
# read whether it declares tenants (it refuses rather than serve anonymously a namespace that may need keys).
TENANTS_INVALID = "tenants_invalid"
TENANTS_UNREAD = "tenants_unread"
