# The two commands of the README (demo, test), and what they are made of.
.PHONY: demo test test-realnode test-repeat setup unit lint generate images images-cuda

setup:
	scripts/setup.sh

# The demo needs the CPU engine image only (its operator runs as a local process); setup builds
# it while the Go builds still run. No trace store: Jaeger's build would lengthen a fresh demo by minutes.
demo:
	scripts/setup.sh --images engine-cpu --no-traces
	.venv/bin/gpufleet demo

# The operator and CPU engine images (docs/dev-cluster.md): built offline, cached
# by a content hash of their inputs (seconds when nothing changed).
images: setup
	.venv/bin/gpufleet dev images

# The production engine image (engine_image/Dockerfile.cuda: PyPI's CUDA vLLM), built offline
# like the others and only on request: several GiB of wheels and a long build that no node here
# runs; `make test` checks its vLLM without it (docs/dev-cluster.md).
images-cuda: setup
	.venv/bin/gpufleet dev images --only engine-cuda

# Setup with the images (cached by content; built while the Go builds run); the linters and type
# checks and the unit tests (no control plane: they run while the Go builds finish); then the
# tests that need the control plane, the chart's Helm, engines; then the real-node tests
# (tests/realnode: the chart's operator as a pod, engines as pods on a real kubelet with
# containerd) as their own session: an in-cluster operator owns their namespaces.
test:
	scripts/setup.sh --images all --meanwhile '$(MAKE) --no-print-directory lint unit'
	.venv/bin/python -m pytest -q --ignore=tests/realnode --ignore=tests/unit
	.venv/bin/python -m pytest -q tests/realnode

test-realnode: setup images
	.venv/bin/python -m pytest -q tests/realnode

# The fault-injection tests 20 times in a row, then 20 more with one core kept busy (docs/dev-cluster.md).
test-repeat: setup
	scripts/repeat-fault-tests.sh --count 20

unit:
	.venv/bin/python -m pytest -q tests/unit

# ruff (style, imports, bugbear, blocking calls in async code), mypy on the pure
# packages, and import-linter's layer contracts (pyproject.toml's [tool.importlinter]).
lint:
	.venv/bin/ruff check .
	.venv/bin/mypy
	.venv/bin/lint-imports

# Every generated file: the CRD and its field reference from the API types, the
# dashboards from dashboards/build.py, and the chart's copies. Tests fail when
# any is stale.
generate:
	.venv/bin/gpufleet crd -o crds/inferenceservices.serving.gpufleet.dev.yaml
	.venv/bin/gpufleet crd --kind InferenceAdapter -o crds/inferenceadapters.serving.gpufleet.dev.yaml
	.venv/bin/gpufleet crd --kind InferenceTenants -o crds/inferencetenants.serving.gpufleet.dev.yaml
	.venv/bin/gpufleet crd --markdown -o docs/api.md
	.venv/bin/python dashboards/build.py
	.venv/bin/python scripts/sync_chart.py
	.venv/bin/python scripts/gie_crd.py
