"""Prints the routes the installed vLLM's API server registers, as JSON: [[path, [methods]], ...].

Run in a process of its own by test_route_table.py (importing vLLM takes seconds and sets up
logging and torch). Every optional router is switched on: all tasks, dev mode, runtime LoRA,
scale-out, profiling, the tokenizer info endpoint, fault tolerance, and a model that pools
and scores, so the table is checked against everything vLLM can serve.
"""
from __future__ import annotations

import json
import os
import sys
import typing

os.environ.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
                   "VLLM_ENABLE_COHERE_API": "1"})

from vllm import tasks  # noqa: E402
from vllm.config import ProfilerConfig  # noqa: E402
from vllm.entrypoints.launchers.app import build_app  # noqa: E402
from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


class PoolingAndScoringModel:
    """What build_app asks of a model config to register the pooling and scoring routers."""

    class hf_config:
        num_labels = 1

    def get_pooling_task(self, supported_tasks):
        return "embed"


def main() -> None:
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    args.enable_fault_tolerance = True
    args.enable_scale_out = True
    args.enable_tokenizer_info_endpoint = True
    args.profiler_config = ProfilerConfig(profiler="torch", torch_profiler_dir="/tmp")
    app = build_app(args, typing.get_args(tasks.SupportedTask), PoolingAndScoringModel())
    routes: dict[str, set[str]] = {}
    for route in app.routes:
        methods = getattr(route, "methods", None)
        if type(route).__name__ == "APIWebSocketRoute":
            methods = {"WEBSOCKET"}
        if not methods:
            continue  # mounts: /metrics' sub-paths are the metrics route's
        routes.setdefault(route.path, set()).update(methods)
    json.dump(sorted([p, sorted(m)] for p, m in routes.items()), sys.stdout)


if __name__ == "__main__":
    main()
