"""Tenants (issue 45): who is asking, how much each may use, and the label each is counted under.

Pure building blocks, not wired into the router or the guard yet: ``declaration`` (the types a platform
declares), ``keys`` (API keys: their stored form and the constant-time check of a Bearer header),
``trusted`` (the tenant a trusted gateway names in a header) and ``labels`` (the bounded metric label of
a caller). docs/tenants.md has the design."""
