# The README's two commands: `make run` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench venv

venv: $(STAMP)

# torch first and pinned: unpinned, a dependency would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ragblend up

test: $(STAMP)
	$(BIN)/pytest

# The checks CI runs before the tests: lint, formatting, and types of engine/, kvstore/, common/.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/engine_ttft.py

# Slow (minutes; apt packages, a debootstrapped base image and the wheels are cached after the
# first run): builds the image with podman and answers a query through the compose stack.
.PHONY: test-deploy
test-deploy: $(STAMP)
	deploy/podman/smoke-test.sh
