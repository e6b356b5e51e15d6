"""Shims: vLLM-Omni's stage workers and model runners, on vLLM's CPU worker.

Test support, not vLLM-Omni code and not part of kv-budget. Every class
here only combines vLLM-Omni's own classes with vLLM's own CPU classes;
none re-implements a method of either.

What they replace: vLLM-Omni's ``GPUARWorker`` and ``GPUGenerationWorker``
(the workers its CUDA platform names for ``LLM_AR`` and
``LLM_GENERATION`` stages), whose ``init_device`` refuses any device type
but CUDA and MUSA.

Why they are shaped like this:

* :class:`CpuARModelRunner` is vLLM-Omni's ``GPUARModelRunner`` over vLLM's
  ``CPUModelRunner``, :class:`CpuGenerationModelRunner` vLLM-Omni's
  ``GPUGenerationModelRunner`` over it: the stage's model runs under
  vLLM-Omni's runner (the AR runner's two-phase execute/sample flow and its
  extra ``forward`` keyword arguments, the generation runner's
  no-sampling path that returns tensors as ``pooler_output``, both runners'
  connector mixin, through which async-chunk stages exchange codec chunks),
  while everything device-bound comes from vLLM's CPU runner. vLLM's CPU
  runner aliases the device half of each host/device buffer to the host
  half once, in its ``__init__``; vLLM-Omni's runners create buffers of
  their own after that, so the same vLLM method runs again at the end.
* :class:`CpuARWorker` and :class:`CpuGenerationWorker` are vLLM's
  ``CPUWorker`` (device, memory, threads) with vLLM-Omni's
  ``OmniWorkerMixin`` (vLLM-Omni's general plugins in the worker, as in its
  own workers). ``CPUWorker.init_device`` builds a ``CPUModelRunner`` by its
  module-level name; each worker builds its runner in its place by
  substituting that one name while ``CPUWorker.init_device`` runs.
* Each worker names its runner in ``model_runner_cls``, as vLLM-Omni's own
  workers do: vLLM-Omni's engine arguments
  (``worker/omni_connector_validation.py``, called from
  ``engine/arg_utils.py``) refuse a stage with a connector whose worker
  class has no ``model_runner_cls`` deriving from its
  ``OmniConnectorModelRunnerMixin`` ("does not provide an Omni connector
  model runner").
"""

from __future__ import annotations

from unittest import mock

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class CpuARModelRunner(GPUARModelRunner, CPUModelRunner):
    """vLLM-Omni's AR model runner over vLLM's CPU model runner."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._postprocess_tensors()  # vLLM's CPU aliasing, now over the AR runner's buffers too


class CpuGenerationModelRunner(GPUGenerationModelRunner, CPUModelRunner):
    """vLLM-Omni's generation (non-autoregressive) model runner over vLLM's CPU model runner."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._postprocess_tensors()  # vLLM's CPU aliasing, now over the generation runner's buffers too


class _CpuOmniWorker(OmniWorkerMixin, CPUWorker):
    """vLLM's CPU worker running the vLLM-Omni runner its subclass names in
    ``model_runner_cls``."""

    model_runner_cls: type

    def init_device(self):
        with mock.patch.object(cpu_worker, "CPUModelRunner", self.model_runner_cls):
            super().init_device()
        if not isinstance(self.model_runner, self.model_runner_cls):
            raise RuntimeError(
                f"kv_budget_omni_cpu: vLLM's CPUWorker built {type(self.model_runner).__qualname__}, "
                f"not {self.model_runner_cls.__qualname__} (this vLLM builds its CPU runner differently)"
            )


class CpuARWorker(_CpuOmniWorker):
    """vLLM's CPU worker running :class:`CpuARModelRunner`."""

    model_runner_cls = CpuARModelRunner


class CpuGenerationWorker(_CpuOmniWorker):
    """vLLM's CPU worker running :class:`CpuGenerationModelRunner`."""

    model_runner_cls = CpuGenerationModelRunner
