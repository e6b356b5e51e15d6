"""kv-budget keeps its state on a vLLM object as one typed attribute."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_patches.engine import STATE_ATTRIBUTE, attached_state


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
