# The two commands of the README (demo, test), and what they are made of.
.PHONY: demo test test-realnode setup unit lint generate images

setup:
	scripts/setup.sh

demo: setup
	.venv/bin/gpufleet demo

# The operator and CPU engine images (docs/dev-cluster.md): built offline, cached
# by a content hash of their inputs (seconds when nothing changed).
images: setup
	.venv/bin/gpufleet dev images

# Linters and type checks first: they take seconds and fail fast.
test: setup lint
	.venv/bin/python -m pytest -q --ignore=tests/realnode

# The real-node tests (tests/realnode: the chart's operator as a pod, engines as
# pods on a real kubelet with containerd) run as their own session: the other
# tests' host-process operator watches every namespace and would fight the
# in-cluster one. Not yet part of `make test`: on 2 cores a second vLLM pod
# beside a serving one took 7-8 min to become Ready and four of the six tests
# timed out in their one full run (docs/dev-cluster.md).
test-realnode: setup images
	.venv/bin/python -m pytest -q tests/realnode

unit:
	.venv/bin/python -m pytest -q tests/unit

# ruff (style, imports, bugbear, blocking calls in async code), mypy on the pure
# packages, and import-linter's layer contracts (.importlinter).
lint:
	.venv/bin/ruff check .
	.venv/bin/mypy
	.venv/bin/lint-imports

# Every generated file: the CRD and its field reference from the API types, the
# dashboards from dashboards/build.py, and the chart's copies. Tests fail when
# any is stale.
generate:
	.venv/bin/gpufleet crd -o crds/inferenceservices.serving.gpufleet.dev.yaml
	.venv/bin/gpufleet crd --markdown -o docs/api.md
	.venv/bin/python dashboards/build.py
	.venv/bin/python scripts/sync_chart.py
