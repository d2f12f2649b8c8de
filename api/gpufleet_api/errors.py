"""The API's exception root: a document of the API (an InferenceService spec, guard.json, a demand prior,
a GPU memory report) that does not fit its type. Every component reads these documents, so each catches
``ContractError`` where it reads one and turns it into its own answer (a status condition, a refused
reload, a skipped report)."""
from __future__ import annotations


class ContractError(ValueError):
    """A document of the API does not fit its type; the message names the field and the fix."""
