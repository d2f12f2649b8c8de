"""The kit's exception root: every exception class the kit defines derives from ``KitError``, and the
components' own roots stay theirs (docs/operator-design.md)."""
from __future__ import annotations


class KitError(Exception):
    """An error the kit raises on purpose."""
