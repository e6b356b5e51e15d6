"""A real vLLM setting for building vLLM-Omni's model classes on the CPU.

vLLM-Omni's stage models are vLLM models: their constructors read a
``VllmConfig``, build vLLM's tensor-parallel linear layers (which need a
model-parallel group) and leave weight post-processing to vLLM's loader.
These three steps give them exactly that, in one process, without an
engine: :func:`vllm_cpu_config`, :func:`built_under`, :func:`finish_loading`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["vllm_cpu_config", "built_under", "finish_loading"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_cpu_config(config: dict[str, Any], dtype: torch.dtype, **model_config: Any) -> Any:
    """A real ``VllmConfig`` whose ``ModelConfig`` reads ``config`` as a
    ``config.json`` from a temporary model directory (no tokenizer, eager).
    Why real: the model classes read their geometry, dtype and multimodal
    limits from it, and a stand-in would be ours, not theirs."""
    from vllm.config import ModelConfig, VllmConfig

    with tempfile.TemporaryDirectory(prefix="kv-budget-omni-") as directory:
        (Path(directory) / "config.json").write_text(json.dumps(config))
        settings = {"skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 256}
        settings.update(model_config)
        model = ModelConfig(model=directory, dtype=str(dtype).removeprefix("torch."), **settings)
        return VllmConfig(model_config=model)


@contextlib.contextmanager
def built_under(vllm_config: Any) -> Iterator[None]:
    """What vLLM's loader provides while it builds a model: the current
    config, the model dtype as default, and a tensor-parallel group (one
    process, gloo on the loopback address, made once per process) for the
    parallel linear layers vLLM-Omni's classes use. Build inside, then call
    :func:`finish_loading` as the loader does after the weights."""
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config), set_default_torch_dtype(vllm_config.model_config.dtype):
        if not dist.is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                backend="gloo",
            )
        ensure_model_parallel_initialized(1, 1)
        yield


def finish_loading(model: torch.nn.Module, vllm_config: Any) -> torch.nn.Module:
    """vLLM's own post-load step (``process_weights_after_loading``): on the
    CPU it is what gives each vLLM linear layer its GEMM, so a model that
    skipped it could not run a forward. Returns the model in eval mode."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(vllm_config):
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    return model.eval()
