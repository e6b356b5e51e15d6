"""Shim: text pipelines of kv-budget's demo model, registered with vLLM-Omni.

Test support, not vLLM-Omni code and not part of kv-budget.

What it replaces: the pipeline a real model brings with it. A vLLM-Omni
deploy YAML can only name a pipeline vLLM-Omni knows (its ``pipeline:``
key, resolved against ``OMNI_PIPELINES``), and none of vLLM-Omni's runs the
demo architecture. vLLM-Omni's own ``register_pipeline`` registers
out-of-tree ones; both are built from vLLM-Omni's own ``PipelineConfig`` and
``StagePipelineConfig``.

Why these two: they are the smallest topologies issue 20 needs proved on
vLLM-Omni's real orchestrator, text in and text out through ``LLM_AR``
stages of the demo architecture (whose talker keeps model-local KV):

* :data:`ONE_STAGE` (``kv_budget_demo_text``): one stage.
* :data:`TWO_STAGES` (``kv_budget_demo_text_2stage``): stage 1 takes stage
  0's generated tokens as its prompt (vLLM-Omni's default stage input
  processing) and gives the final text; both stages declare.
"""

from __future__ import annotations

from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

ARCHITECTURE = "KvBudgetDemoForCausalLM"
"""kv_budget_demo.checkpoint.ARCHITECTURE (not imported: the demo imports vLLM models)."""

ONE_STAGE = PipelineConfig(
    model_type="kv_budget_demo_text",
    model_arch=ARCHITECTURE,
    stages=(
        StagePipelineConfig(
            stage_id=0,
            model_stage="demo",
            execution_type=StageExecutionType.LLM_AR,
            input_sources=(),
            final_output=True,
            final_output_type="text",
            owns_tokenizer=True,
            engine_output_type="text",
            sampling_constraints={"detokenize": True},
        ),
    ),
)

TWO_STAGES = PipelineConfig(
    model_type="kv_budget_demo_text_2stage",
    model_arch=ARCHITECTURE,
    stages=(
        StagePipelineConfig(
            stage_id=0,
            model_stage="demo_first",
            execution_type=StageExecutionType.LLM_AR,
            input_sources=(),
            owns_tokenizer=True,
            engine_output_type="text",
            sampling_constraints={"detokenize": True},
        ),
        StagePipelineConfig(
            stage_id=1,
            model_stage="demo_second",
            execution_type=StageExecutionType.LLM_AR,
            input_sources=(0,),
            final_output=True,
            final_output_type="text",
            engine_output_type="text",
            sampling_constraints={"detokenize": True},
        ),
    ),
)

PIPELINES = (ONE_STAGE, TWO_STAGES)


def register_pipelines() -> None:
    """Register both pipelines with vLLM-Omni (idempotent)."""
    for pipeline in PIPELINES:
        if OMNI_PIPELINES.get(pipeline.model_type) is not pipeline:
            register_pipeline(pipeline)
