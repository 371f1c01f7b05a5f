# `make test` is the one command a newcomer (and CI, through .ci/run) runs on a CPU-only machine:
# it installs everything with install.sh (the same script the Docker image runs), then lints
# and tests. GPU tests are deselected here; run them on a GPU host with `make test-gpu`.
VENV ?= .venv
BIN := $(VENV)/bin
# pytest-xdist workers: CI's machine has two cores, and one pytest process left the second idle
# while the suite grew toward CI's 90-minute limit. TEST_JOBS=0 runs in one process.
TEST_JOBS ?= 2

.PHONY: test test-gpu install tools lint docs

test: install tools lint
	$(BIN)/pytest -n $(TEST_JOBS)

test-gpu: install
	$(BIN)/pytest -m gpu

install:
	bash install.sh $(VENV) --with-test --editable

# Debian's docker-compose validates docker-compose.yml in the tests (no Docker engine needed).
tools:
	@command -v docker-compose >/dev/null || { \
	  [ "$$(id -u)" = 0 ] || { echo "install docker-compose (Debian package) or run as root"; exit 1; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; }

lint:
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

docs:
	$(BIN)/hyperqwen settings --write-docs .
