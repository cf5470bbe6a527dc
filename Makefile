# The two entry points README.md documents: `make run` and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: install run test test-fast lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned and installed first so pip takes the local CPU wheel, not a CUDA build.
# xgrammar (response_format, the `structured` extra) goes in without its declared deps: its
# wheel metadata pulls in the triton GPU stack on Linux, which nothing on the CPU path imports.
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py pdserve/_blockhash.c router/_score.c kvxfer/_listen_host.c
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps 'xgrammar>=0.2.8,<1' 'apache-tvm-ffi>=0.1.15,<0.2'
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/pdserve model pull
	$(BIN)/pdserve cluster up --demo "$(PROMPT)"

test: install
	$(BIN)/pdserve model pull
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The fast loop: every test that starts no process and takes well under a few seconds
# (tests/conftest.py marks the rest `slow`). `make test` runs everything.
test-fast: install
	$(BIN)/pdserve model pull
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow"

lint: install
	$(BIN)/ruff check .
	$(MAKE) typecheck

# The runtime packages, strictly (pyproject.toml [tool.mypy]); tests/test_typecheck.py runs
# the same check in the test suite.
typecheck: install
	$(BIN)/mypy pdserve router prefill_svc decode_svc kvxfer

clean:
	rm -rf $(VENV) build *.egg-info
