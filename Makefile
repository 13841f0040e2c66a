# The two commands a new user needs (see README.md). CI runs `make test` (via .ci/run).
PY ?= python3
PYTEST_ARGS ?=

.PHONY: install install-dev test test-fast demo

install:
	$(PY) -m pip install -q -e .

install-dev:
	$(PY) -m pip install -q -e ".[test,ref]"

## Install everything (incl. torch CPU + transformers for parity tests) and run the whole test suite.
## (--max-worker-restart=0: a crashed worker fails the run at once, naming its test, instead of restarting workers;
##  --durations=40: the CI log lists the slowest tests, to keep the run under its 30-minute budget;
##  --no-loadscope-reorder: xdist hands out files in tests/conftest.py's longest-first order instead of re-sorting
##  them by test count, which ran the slowest files -- one to three tests each -- last, one worker idle)
test: install-dev
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0 --durations=40 $(PYTEST_ARGS)

## Skip the slow / real-model tests (a quick local loop).
test-fast: install-dev
	KVQ_SKIP_MODEL=1 $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

## The main job: a small real sweep on SmolLM2 (fetched on first use) + the available corpus.
demo: install
	kvq sweep configs/sweeps/demo.yaml --out runs/demo
