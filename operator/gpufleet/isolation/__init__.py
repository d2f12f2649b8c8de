"""Isolation: whether nodes reserved for a service hold foreign pods (verify). Pure.

Placement rules live with the pod builders (manifests.placement)."""
