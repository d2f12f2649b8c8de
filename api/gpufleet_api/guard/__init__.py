"""The contract between the operator and the guard, defined once.

Both sides import these modules: the operator renders ``guard.json`` with
``guard_config.to_document`` and validates ``extraArgs`` against
``engine_flags.MANAGED_FLAGS``; the guard reads ``guard.json`` with
``guard_config.parse`` and exports the metrics named in ``guard_metrics``,
which the operator's autoscaler reads. ``typed`` is the typed-model kit (msgspec) of
``guard.json`` and of the operator's API types. Pure: no I/O beyond reading one file.
"""
