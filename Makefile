# The two entry points README.md documents: `make run` and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: install run test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned and installed first so pip takes the local CPU wheel, not a CUDA build.
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/pdserve model pull
	$(BIN)/pdserve cluster up --demo "$(PROMPT)"

test: install
	$(BIN)/pdserve model pull
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
