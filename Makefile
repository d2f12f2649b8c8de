# The two commands of the README.
.PHONY: demo test setup unit

setup:
	scripts/setup.sh

demo: setup
	.venv/bin/gpufleet demo

test: setup
	.venv/bin/python -m pytest -q

unit:
	.venv/bin/python -m pytest -q tests/unit
