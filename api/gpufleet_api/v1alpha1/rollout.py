"""spec.rollout: how a new revision replaces the old one (rolling, or a canary by steps with an analysis)."""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from gpufleet_api.typed import Model

from ..schema import rule


class RolloutStep(Model, frozen=True, kw_only=True):
    """One step of a canary: the share of new requests the router sends to the new revision, held
    this long while its SLIs stay inside the SLO."""
    weight_percent: Annotated[int, Meta(
        description="Share of new requests sent to the canary revision, percent; the canary Deployment "
                    "runs ceil(weightPercent x the stable replicas / 100) replicas (at least 1).",
        ge=1, le=100)]
    hold_seconds: Annotated[int, Meta(
        description="How long the step holds, once every canary replica is ready, before the next one.",
        ge=0, le=86400)] = 120


DEFAULT_ROLLOUT_STEPS = [RolloutStep(weight_percent=10, hold_seconds=120),
                         RolloutStep(weight_percent=50, hold_seconds=120),
                         RolloutStep(weight_percent=100, hold_seconds=60)]
STEPS_INCREASING_MESSAGE = ("spec.rollout.steps: weightPercent must increase from step to step (e.g. 10, 50, "
                            "100); reorder or remove the steps that do not")
STEPS_LAST_MESSAGE = ("spec.rollout.steps: the last step's weightPercent must be 100 (the canary carries all "
                      "the traffic before the stable is promoted); add a step {weightPercent: 100}")
ROLLOUT_DISAGGREGATION_MESSAGE = ("spec.rollout cannot be combined with spec.disaggregation: a disaggregated "
                                  "service's pools keep rolling updates; remove spec.rollout")


class RolloutAnalysis(Model, frozen=True, kw_only=True):
    """How a canary step is judged: the canary replicas' SLI counters over the step (the same SLIs as the
    burn-rate alerts: availability, ttft, itl, latency) against the error budget 1 - slo.availabilityPercent/100."""
    min_requests: Annotated[int, Meta(
        description="Events an SLI needs over a step before it is judged (fewer: not judged; the step still "
                    "advances after its hold).",
        ge=1, le=1000000)] = 20
    max_burn_rate: Annotated[str, Meta(
        description="Roll back when an SLI's error ratio over the step exceeds this many times the error "
                    "budget (a decimal, e.g. \"14.4\", the fast-burn alert's rate).",
        pattern=r"^[0-9]{1,6}(\.[0-9]{1,3})?$")] = "14.4"
    progress_deadline_seconds: Annotated[int, Meta(
        description="Roll back when the canary's replicas are not all ready this long after its step began.",
        ge=30, le=86400)] = 600


class RolloutSpec(Model, frozen=True, kw_only=True):
    """How a change of what a replica serves (model, engine image or arguments, anything in the pod
    template) reaches the replicas (docs/rollouts.md). Admission-only changes reload live in both cases."""
    __schema__ = {"x_kubernetes_validations": [
        # Indices spelled out (CEL has no range); steps has at most 10 items.
        rule("[1, 2, 3, 4, 5, 6, 7, 8, 9].all(i, i >= self.steps.size() || "
             "self.steps[i].weightPercent > self.steps[i - 1].weightPercent)",
             STEPS_INCREASING_MESSAGE, field_path=".steps"),
        rule("self.steps.size() == 0 || self.steps[self.steps.size() - 1].weightPercent == 100",
             STEPS_LAST_MESSAGE, field_path=".steps"),
    ]}
    strategy: Annotated[Literal["Rolling", "Canary"], Meta(
        description="Rolling: the Deployment's rolling update replaces every replica (one surge pod at a "
                    "time). Canary: the new revision starts beside the old one as <service>-canary, the router "
                    "shifts traffic to it in steps while its SLIs stay inside the SLO, and rolls back by itself "
                    "when they do not.")] = "Rolling"
    steps: Annotated[list[RolloutStep], Meta(
        description="Canary steps, weightPercent increasing, the last 100.",
        min_length=1, max_length=10)] = msgspec.field(default_factory=lambda: list(DEFAULT_ROLLOUT_STEPS))
    paused: Annotated[bool, Meta(
        description="Hold the canary at its current step (its SLIs are still judged).")] = False
    promote: Annotated[bool, Meta(
        description="Skip the remaining steps: the canary goes to 100% and, once its replicas are ready, the "
                    "stable is promoted.")] = False
    abort: Annotated[bool, Meta(
        description="Roll the canary back and start none while true; setting it back to false tries the "
                    "spec's revision again.")] = False
    analysis: Annotated[RolloutAnalysis, Meta(
        description="How each step is judged.")] = msgspec.field(default_factory=RolloutAnalysis)
