# The two commands of the README:
#   make demo   set up, fetch the demo model pair, start the local stack (target, draft,
#               orchestrator; embedded session store) and send one request
#   make test   set up and run the test suite (what .ci/run calls)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# The venv's bin first: torch finds ninja there to build the CPU kernels.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: demo test lint install kernels slow proto bench clean

# The CPU kernels this machine runs are built at install time, so no server builds them
# at its first start (a one-off compile of well under a minute). A failed build does not
# fail the install: the engine then runs on torch ops, and says so when it starts.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,bench,tp]"
	$(PY) -m specserve.engine.kernel_prebuild --this-cpu || echo "CPU kernels not built (see above)"
	touch $@

install: $(VENV)/.installed

# Again after the kernels' sources changed (a pull): found in the cache when up to date.
kernels: install
	$(PY) -m specserve.engine.kernel_prebuild --this-cpu || echo "CPU kernels not built (see above)"

demo: kernels
	$(VENV)/bin/specserve models fetch demo
	$(VENV)/bin/specserve up --once

# Built at install; after a change to their sources the CPU kernels (one ~17 s compile)
# rebuild in the background while Redis starts, ruff runs and pytest collects; the first
# test that needs them waits on the build's lock.
# The suite on TEST_WORKERS processes (pytest-xdist; a file's tests stay on one worker, so
# its fixtures start once), then the tensor-parallel tests alone: each starts a group of
# ranks with rendezvous and heartbeat deadlines that a second worker's load can break.
TEST_WORKERS ?= 2

test: install
	$(PY) -m specserve.engine.kernel_prebuild --this-cpu >/dev/null 2>&1 &
	bash scripts/ensure-redis.sh
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not slow and not tp" -q -n $(TEST_WORKERS) --dist loadfile
	$(PY) -m pytest -m "tp and not slow" -q

slow: install
	$(PY) -m pytest -m slow -q -s

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

proto: install
	bash scripts/gen-proto.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
