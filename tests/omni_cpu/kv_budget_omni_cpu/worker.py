"""Shim: vLLM-Omni's AR stage worker and model runner, on vLLM's CPU worker.

Test support, not vLLM-Omni code and not part of kv-budget. Both classes
only combine vLLM-Omni's own classes with vLLM's own CPU classes; neither
re-implements a method of either.

What it replaces: vLLM-Omni's ``GPUARWorker`` (the worker its CUDA
platform names for ``LLM_AR`` stages), whose ``init_device`` refuses any
device type but CUDA and MUSA.

Why it is shaped like this:

* :class:`CpuARModelRunner` is vLLM-Omni's ``GPUARModelRunner`` over vLLM's
  ``CPUModelRunner``: the stage's model runs under vLLM-Omni's AR runner
  (its two-phase execute/sample flow, its extra ``forward`` keyword
  arguments ``sampling_metadata``, ``logits_index`` and ``sampler``, its
  output type), while everything device-bound comes from vLLM's CPU runner.
  vLLM's CPU runner aliases the device half of each host/device buffer to
  the host half once, in its ``__init__``; the AR runner creates buffers of
  its own after that, so the same vLLM method runs again at the end.
* :class:`CpuARWorker` is vLLM's ``CPUWorker`` (device, memory, threads)
  with vLLM-Omni's ``OmniWorkerMixin`` (vLLM-Omni's general plugins in the
  worker, as in its own workers). ``CPUWorker.init_device`` builds a
  ``CPUModelRunner`` by its module-level name; the worker builds the AR
  runner in its place by substituting that one name while
  ``CPUWorker.init_device`` runs.
"""

from __future__ import annotations

from unittest import mock

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class CpuARModelRunner(GPUARModelRunner, CPUModelRunner):
    """vLLM-Omni's AR model runner over vLLM's CPU model runner."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._postprocess_tensors()  # vLLM's CPU aliasing, now over the AR runner's buffers too


class CpuARWorker(OmniWorkerMixin, CPUWorker):
    """vLLM's CPU worker running :class:`CpuARModelRunner`."""

    def init_device(self):
        with mock.patch.object(cpu_worker, "CPUModelRunner", CpuARModelRunner):
            super().init_device()
        if not isinstance(self.model_runner, CpuARModelRunner):
            raise RuntimeError(
                f"kv_budget_omni_cpu: vLLM's CPUWorker built {type(self.model_runner).__qualname__}, "
                "not vLLM-Omni's AR runner (this vLLM builds its CPU runner differently)"
            )
