"""kopf as the operator configures it: watches filtered by the API server with the labels the
handlers filter on, and no per-event diff-base (there is no change handler to read it)."""
from __future__ import annotations

import copy

import kopf

from gpufleet.settings import OperatorSettings
from gpufleet.wiring import handlers


def test_every_label_filtered_watch_has_the_same_selector_on_the_server_and_the_others_none():
    settings = kopf.OperatorSettings()
    handlers.watch_selectors(settings)
    registered = kopf.get_default_registry()._watching.get_all_handlers()
    filtered = 0
    for handler in registered:
        sel = handler.selector
        resource = kopf.Resource(sel.group or "", sel.version or "v1", sel.any_name)
        expected = [",".join(f"{k}={v}" for k, v in handler.labels.items())] if handler.labels else []
        assert settings.watching.label_selectors.collect(resource) == expected, sel
        filtered += bool(handler.labels)
    assert filtered == 5   # Deployments, Services, ConfigMaps, budgets, engine pods


def test_the_operator_has_event_handlers_only_so_kopf_needs_no_diff_base():
    """NoDiffBase is right only while no handler reads kopf's diffs: a change handler, a daemon or a
    timer added here needs kopf's own diff-base storage back (handlers.configure)."""
    registry = kopf.get_default_registry()
    assert registry._watching.get_all_handlers()
    assert not registry._changing.get_all_handlers() and not registry._spawning.get_all_handlers()


async def test_kopf_builds_no_copy_of_a_body_for_each_event(monkeypatch):
    class Runtime:
        settings = OperatorSettings()

        async def start(self):
            pass

    settings = kopf.OperatorSettings()
    await handlers.configure(settings=settings, memo=kopf.Memo(runtime=Runtime()))

    def deepcopy(_obj, _memo=None):
        raise AssertionError("an event's body deep-copied")
    body = kopf.Body({"metadata": {"name": "a", "managedFields": [{"manager": "m"}]}, "spec": {"x": 1}})
    monkeypatch.setattr(copy, "deepcopy", deepcopy)
    assert settings.persistence.diffbase_storage.build(body=body) == {}
    assert settings.persistence.diffbase_storage.fetch(body=body) is None


def test_kopfs_default_diff_base_copies_the_body(monkeypatch):
    """What NoDiffBase saves: kopf's own storage deep-copies every event's body."""
    copies = []
    real = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda obj, memo=None: copies.append(1) or real(obj, memo))
    body = kopf.Body({"metadata": {"name": "a", "managedFields": [{"manager": "m"}]}, "spec": {"x": 1}})
    kopf.OperatorSettings().persistence.diffbase_storage.build(body=body)
    assert copies
