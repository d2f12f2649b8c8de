"""Pure builders: spec → child objects (dicts) and the guard's guard.json."""
