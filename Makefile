# The two commands of this project: `make run` (the main job) and `make test`.
# Each one creates .venv (Python 3.12) and installs what it needs on first use.
.PHONY: run test lint install bench plugin patch recipe-check

VENV_PY := .venv/bin/python

install:
	@bash tools/ensure_venv.sh test

run: install
	@bash tools/run_main_job.sh

bench: install
	.venv/bin/python scripts/performance/bench_overlap.py --steps 6
	.venv/bin/python scripts/performance/bench_overlap.py --steps 6 --delay_wgrad_compute

test: install
	$(VENV_PY) -m pytest -q tests/

lint: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

plugin: install
	.venv/bin/python tools/upstream.py plugin

patch: install
	.venv/bin/python tools/upstream.py patch

# Megatron-Bridge 0.6.2's recipes against the overlap on CPU: RECIPES="name ..." or RECIPES=--all (not in CI).
recipe-check: install
	$(VENV_PY) tools/recipe_check.py $(RECIPES)
