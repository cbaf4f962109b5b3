# specdec's everyday commands. `make test` and `make serve` work on a fresh machine.
PYTHON ?= python3
PORT ?= 18080
SPEC ?= {"num_speculative_tokens":1,"method":"ngram","prompt_lookup_min":1,"prompt_lookup_max":8}
PYTEST_ARGS ?=

.PHONY: install install-test test test-fast lint serve bench protos compose-config

# pip takes torch==2.13.0 from the CPU wheel on disk (see pyproject.toml). Serving needs the
# project alone; the tests add their extras. pip shows its progress: a first install takes
# minutes.
install:
	$(PYTHON) -m pip install -e .

install-test:
	$(PYTHON) -m pip install -q -e '.[test]'

# Every tier: tests/unit, tests/service and tests/stack (docs/development.md).
test: install-test
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

# The unit tier alone, the loop to run on every change: no socket, no child process, no real
# model. It installs nothing: `make install-test` once first.
test-fast:
	$(PYTHON) -m pytest -q tests/unit $(PYTEST_ARGS)

# Static checks, as CI runs them: ruff (unused code and imports, bugbear, style) and mypy on
# the four packages (configuration in pyproject.toml; the linters' versions are pinned there).
lint:
	$(PYTHON) -m pip install -q -e '.[lint]'
	$(PYTHON) -m ruff check specdec gateway drafter_svc verifier_svc tests
	$(PYTHON) -m mypy

serve: install
	$(PYTHON) -m specdec serve --port $(PORT) --speculative-config '$(SPEC)'

bench: install
	$(PYTHON) -m specdec bench

# Regenerates the committed gRPC stubs; tests/service/test_protos.py fails when they are stale.
protos:
	$(PYTHON) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. \
		protos/specdec/v1/specdec.proto

compose-config:
	docker compose config -q
