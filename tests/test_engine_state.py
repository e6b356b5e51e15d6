"""kv-budget keeps its state on a vLLM object as one typed attribute."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest

from vllm_patches.engine import STATE_ATTRIBUTE, attached_state, existing_state


@dataclass
class Counter:
    count: int = 0


@dataclass
class Other:
    pass


class Core:
    """Stands for a vLLM engine core: any object kv-budget attaches state to."""


def test_the_state_is_made_once_and_kept_on_its_owner():
    core = Core()
    attached_state(core, Counter).count += 1
    attached_state(core, Counter).count += 1
    assert attached_state(core, Counter).count == 2 and vars(core) == {STATE_ATTRIBUTE: Counter(2)}
    assert attached_state(Core(), Counter).count == 0  # per object


def test_a_state_of_another_kind_is_refused_naming_both():
    core = Core()
    attached_state(core, Counter)
    with pytest.raises(TypeError, match=r"Core\._kv_budget holds a Counter, not kv-budget's Other"):
        attached_state(core, Other)


def test_reading_a_state_that_was_never_attached_leaves_the_owner_untouched():
    core = Core()
    assert existing_state(core, Counter) is None and vars(core) == {}
    attached_state(core, Counter).count = 3
    assert existing_state(core, Counter) == Counter(3)
    with pytest.raises(TypeError, match="holds a Counter, not kv-budget's Other"):
        existing_state(core, Other)


def test_a_copy_of_the_owner_carries_its_state():
    """Why state on the object and not keyed by id(): a copy (vLLM deep-copies
    configs) is found as what it was copied from."""
    core = Core()
    attached_state(core, Counter).count = 5
    assert existing_state(copy.deepcopy(core), Counter) == Counter(5)


@pytest.mark.vllm
def test_state_on_vllms_scheduler_config_survives_a_deep_copy_and_leaves_its_hash():
    from vllm.config import SchedulerConfig

    from vllm_patches.startup_hook import CapAwaitingScheduler

    config = SchedulerConfig(max_model_len=1024, is_encoder_decoder=False)
    before = config.compute_hash()
    attached_state(config, CapAwaitingScheduler).cap = 90
    assert config.compute_hash() == before
    assert existing_state(copy.deepcopy(config), CapAwaitingScheduler).cap == 90
