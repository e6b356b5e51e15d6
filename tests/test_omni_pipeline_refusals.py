"""What stops a vLLM-Omni deployment, on vLLM-Omni 0.30.0's real orchestrator.

As tests/test_omni_pipeline.py (``kv_budget_omni_cpu`` is test support, not
vLLM-Omni code). Two one-stage pipelines that must not start, each with the
one line that says why and what to do:

* an override that matches a declaration in no stage: the driver's check
  across stages stops the deployment once every stage is up, naming every
  stage's declarations (a stage that lacks an unqualified override's
  declaration starts: tests/test_omni_pipeline_two_stages.py); this driver
  does not load the plugins before ``Omni(...)``, and the warning that
  follows is checked too;
* ``reserve`` on a stage with no paged KV pool (the demo model with no
  base-LM layer: no attention layer, so vLLM sizes no pool, as for
  vLLM-Omni's Qwen3-TTS code2wav), whose talker declares model-local KV:
  refused in the stage, naming it and suggesting ``cap``.
"""

from __future__ import annotations

import pytest
from omni_pipeline_support import run_pipeline, stage

pytestmark = pytest.mark.omni_pipeline

MAX_TOKENS = 4
UNMATCHED = "talker/no_such_cache:physical_capacity_positions=64"


@pytest.fixture(scope="module")
def unmatched(tmp_path_factory):
    work = tmp_path_factory.mktemp("omni-unmatched")
    # No headroom and no device size: on vLLM's CPU build nothing can be split (said in one line).
    settings = {"model_local_kv": {"policy": "cap", "ledger_dir": "off", "overrides": [UNMATCHED]}}
    # Plugins not loaded first: the first Omni() of the process is resolved
    # before kv-budget loads, which it says as soon as it does.
    return run_pipeline(work, "kv_budget_demo_text", [stage(0, MAX_TOKENS)], {"additional_config": settings}, 2,
                        MAX_TOKENS, load_plugins_first=False)


@pytest.fixture(scope="module")
def poolless(tmp_path_factory):
    from kv_budget_demo.checkpoint import write_demo_checkpoint

    work = tmp_path_factory.mktemp("omni-poolless")
    checkpoint = write_demo_checkpoint(work / "checkpoint", base_layers=0)
    # vLLM-Omni's prefix cache wants one attention KV group; a pool-less stage has none
    return run_pipeline(work, "kv_budget_demo_text", [stage(0, MAX_TOKENS, enable_prefix_caching=False)],
                        {"model_local_kv_policy": "reserve", "model_local_kv_ledger_dir": "off"}, 2, MAX_TOKENS,
                        checkpoint=checkpoint)


def test_an_override_no_stage_matches_stops_the_deployment_naming_every_stages_declarations(unmatched):
    assert unmatched.returncode != 0 and unmatched.result is None, unmatched.failure()
    expected = (f"kv-budget: model-local KV override(s) '{UNMATCHED}' match no declaration in any stage; "
                "declarations: stage 0 replica 0: talker/postnet_step_kv, talker/talker_step_kv")
    assert unmatched.refused is not None and expected in unmatched.refused["message"], unmatched.failure()
    # the stage itself started, logging that the override is the deployment's to judge
    assert "match no declaration in stage 0 replica 0" in unmatched.output


def test_a_deployment_resolved_before_the_plugin_loaded_is_named_in_a_warning(unmatched):
    """The global additional_config still reached the stage (vLLM-Omni's own
    merge), and the check across stages still ran (it is looked up when
    called); what kv-budget could not do is said once."""
    warnings = [line for line in unmatched.output.splitlines()
                if "vLLM-Omni resolved this deployment before it loaded vLLM's general plugins" in line]
    assert len(warnings) == 1, unmatched.failure()
    assert "load_general_plugins()" in warnings[0] and "stage(s) [0]" in warnings[0]


def test_a_device_of_no_measurable_size_and_no_headroom_is_not_split_and_the_driver_says_so(unmatched):
    lines = [line for line in unmatched.output.splitlines() if "cannot be measured on this platform" in line]
    assert len(lines) == 1, unmatched.failure()
    assert ("kv-budget: the size of device(s) [0] cannot be measured on this platform (cpu) and no headroom is "
            "given: the deployment is not split") in lines[0]
    assert "--model-local-kv-device-memory SIZE" in lines[0]
    assert "model-local KV deployment split" not in unmatched.output


def test_reserve_on_a_stage_without_a_paged_pool_refuses_in_one_line(poolless):
    assert poolless.returncode != 0 and poolless.result is None, poolless.failure()
    lines = [line for line in poolless.output.splitlines()
             if "policy reserve cannot protect stage 0 replica 0" in line]
    assert lines, poolless.failure()
    assert "it has no paged KV pool to take its model-local KV (talker/talker_step_kv, talker/postnet_step_kv)" \
        in lines[0]
    assert "use policy cap for it" in lines[0]
    assert not poolless.reports and not poolless.status
