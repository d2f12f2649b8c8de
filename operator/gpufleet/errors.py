"""The operator's exception root. The operator's own errors derive from ``OperatorError``; the kit's
``KubeError`` (the API server's answers) and the API's ``ContractError`` (a spec that does not fit) are
caught where the operator calls them and become status conditions, Events or a usage error."""
from __future__ import annotations


class OperatorError(Exception):
    """An error the operator raises on purpose."""
