# The two commands of the quick start. Each makes its own virtual environment.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: the CPU wheel lies on local disk; an unpinned torch pulls CUDA.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tether demo

# bubblewrap isolates the local sandbox backend; install it when it is missing.
test: $(STAMP)
	@command -v bwrap >/dev/null || (apt-get update -qq && apt-get install -y -qq bubblewrap) \
		|| echo "warning: could not install bubblewrap; sandbox isolation tests will fail"
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .tether
