"""The InferenceServices the operator scale benchmarks create: one shape for the cluster bench
(operator_scale.py) and the in-process one (operator_inprocess.py)."""
from __future__ import annotations

API = "serving.gpufleet.dev/v1alpha1"


def service(i: int) -> dict:
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": f"svc-{i:04d}"},
            "spec": {"model": {"name": f"org/model-{i % 50}"}, "isolation": {"mode": "Shared"},
                     "autoscaling": {"minReplicas": 1, "maxReplicas": 2}}}
