"""The planner's exceptions. Each message names what is wrong and how to fix it;
``gpufleet plan`` prints it as is, so no traceback is needed to act on it."""
from __future__ import annotations

from ..errors import OperatorError


class PlanningError(OperatorError):
    """A plan cannot be made from these inputs."""


class RequestLogError(PlanningError):
    """A request log line cannot be read (the message names the line and the field)."""


class ProfileError(PlanningError):
    """A GPU or model profile is unknown or malformed."""


class PrometheusError(PlanningError):
    """Prometheus could not be reached, refused a query, or has no data for the service."""


class SizingError(PlanningError):
    """The model cannot be served at all with these settings (e.g. weights do not fit)."""
