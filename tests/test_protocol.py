"""The declaration protocol: validation, duck typing, HF configs, collection."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys
import types

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2Config, WhisperConfig

import kv_budget
from kv_budget import InvalidDeclarationError, ModelLocalKVSpec, RowDriver, collect_model_local_kv_specs, spec_from_hf_config
from kv_budget.declare.spec import Scope, normalize_spec

VALID = dict(
    name="kv",
    layers=2,
    kv_heads=2,
    head_dim=4,
    dtype=torch.float16,
    physical_capacity_positions=8,
    capacity_source="test bound",
    scope=Scope.REQUEST,
    rows=RowDriver.MAX_NUM_SEQS,
)


def make(**overrides):
    return ModelLocalKVSpec(**{**VALID, **overrides})


def test_bytes_per_row_is_k_and_v_times_geometry():
    spec = make()
    assert spec.bytes_per_row == 2 * 2 * 2 * 4 * 8 * 2
    assert spec.peak_bytes(max_num_seqs=7) == spec.bytes_per_row * 7
    fixed = make(rows=RowDriver.FIXED, rows_fixed=3, rows_reason="three buckets")
    assert fixed.peak_bytes(max_num_seqs=256) == fixed.bytes_per_row * 3


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", ""),
        ("name", 3),
        ("layers", 0),
        ("layers", -1),
        ("layers", 2.0),
        ("layers", True),
        ("kv_heads", 0),
        ("head_dim", "64"),
        ("physical_capacity_positions", 0),
        ("dtype", "bfloat16"),
        ("dtype", None),
        ("capacity_source", None),
        ("capacity_source", 7),
        ("scope", "global"),
        ("scope", "REQUEST"),
        ("scope", 1),
        ("rows", "per_request"),
        ("rows", None),
        ("allocation_note", 5),
    ],
)
def test_invalid_field_raises_naming_field_value_and_declaration(field, value):
    with pytest.raises(InvalidDeclarationError) as info:
        make(**{field: value})
    message = str(info.value)
    assert repr(field) in message
    assert repr(value) in message
    if field != "name":
        assert "'kv'" in message


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(rows=RowDriver.FIXED, rows_fixed=0, rows_reason="why"), "rows_fixed"),
        (dict(rows=RowDriver.FIXED, rows_fixed=True, rows_reason="why"), "rows_fixed"),
        (dict(rows=RowDriver.FIXED, rows_fixed=2), "rows_reason"),
        (dict(rows=RowDriver.FIXED, rows_fixed=2, rows_reason="  "), "rows_reason"),
    ],
)
def test_fixed_rows_need_a_count_and_a_reason(overrides, field):
    with pytest.raises(InvalidDeclarationError, match=repr(field)):
        make(**overrides)


def test_fixed_count_defaults_to_one_as_in_vllm_omni():
    spec = make(rows=RowDriver.FIXED, rows_reason="one session")
    assert spec.row_count(256) == 1


@pytest.mark.parametrize("rows_fixed", [1, 0, 7, None])
def test_rows_fixed_beside_max_num_seqs_is_ignored(rows_fixed):
    """vLLM-Omni documents ``rows_fixed`` as ignored unless rows are fixed,
    and every per-sequence declaration it makes carries its default 1."""
    spec = make(rows=RowDriver.MAX_NUM_SEQS, rows_fixed=rows_fixed, rows_reason="")
    assert spec.row_count(256) == 256
    assert spec.peak_bytes(256) == spec.bytes_per_row * 256


def test_positional_construction_in_vllm_omnis_field_order():
    spec = ModelLocalKVSpec("kv", 2, 2, 4, torch.float16, 8, "test bound", "request", "max_num_seqs")
    assert spec == make()


def test_string_and_foreign_enum_values_are_normalised():
    class ForeignScope(str, enum.Enum):
        SESSION = "session"

    spec = make(scope=ForeignScope.SESSION, rows="fixed", rows_fixed=1, rows_reason="one session")
    assert spec.scope is Scope.SESSION
    assert spec.rows is RowDriver.FIXED


def test_foreign_declaration_objects_are_normalised():
    """Any object with the contract's attribute names is read (vLLM-Omni's
    own class is tested in test_omni_declarations.py); absent optional
    fields take vLLM-Omni's defaults."""
    foreign = types.SimpleNamespace(**{**VALID, "scope": "request", "rows": "max_num_seqs"})
    spec = normalize_spec(foreign)
    assert isinstance(spec, ModelLocalKVSpec)
    assert spec.bytes_per_row == make().bytes_per_row
    assert (spec.rows_fixed, spec.rows_reason, spec.allocation_note) == (1, "", None)


def test_foreign_declaration_missing_a_field_is_refused():
    partial = types.SimpleNamespace(**{k: v for k, v in VALID.items() if k != "capacity_source"})
    with pytest.raises(InvalidDeclarationError, match="capacity_source.*missing"):
        normalize_spec(partial)


def test_spec_from_qwen2_config_reads_gqa_geometry():
    config = Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    spec = spec_from_hf_config(
        config, name="kv", dtype=torch.bfloat16, physical_capacity_positions=10,
        capacity_source="test", scope="request", rows="max_num_seqs",
    )
    assert (spec.layers, spec.kv_heads, spec.head_dim) == (3, 2, 64)


def test_spec_from_config_prefers_an_explicit_head_dim():
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=32)
    spec = spec_from_hf_config(
        config, name="kv", dtype=torch.float32, physical_capacity_positions=1,
        capacity_source="t", scope="request", rows="max_num_seqs",
    )
    assert (spec.kv_heads, spec.head_dim) == (1, 32)


def test_spec_from_gpt2_config_uses_gpt2_names_and_mha():
    config = GPT2Config(n_embd=128, n_head=4, n_layer=5)
    spec = spec_from_hf_config(
        config, name="kv", dtype=torch.float32, physical_capacity_positions=1,
        capacity_source="t", scope="request", rows="max_num_seqs",
    )
    assert (spec.layers, spec.kv_heads, spec.head_dim) == (5, 4, 32)


def test_spec_from_whisper_config_distinguishes_encoder_and_decoder():
    config = WhisperConfig(d_model=128, encoder_layers=3, decoder_layers=2,
                           encoder_attention_heads=8, decoder_attention_heads=4)
    common = dict(dtype=torch.float16, physical_capacity_positions=1500,
                  capacity_source="embed_positions", scope="session", rows="fixed",
                  rows_fixed=1, rows_reason="one session")
    encoder = spec_from_hf_config(config, name="enc", stack="encoder", **common)
    decoder = spec_from_hf_config(config, name="dec", stack="decoder", **common)
    assert (encoder.layers, encoder.kv_heads, encoder.head_dim) == (3, 8, 16)
    assert (decoder.layers, decoder.kv_heads, decoder.head_dim) == (2, 4, 32)


def test_spec_from_config_requires_rows_keyword():
    config = Qwen2Config()
    with pytest.raises(TypeError, match="rows"):
        spec_from_hf_config(  # type: ignore[call-arg]
            config, name="kv", dtype=torch.float32, physical_capacity_positions=1,
            capacity_source="t", scope="request",
        )


def test_spec_from_config_raises_naming_what_it_tried():
    config = types.SimpleNamespace(hidden_size=64)
    with pytest.raises(ValueError) as info:
        spec_from_hf_config(
            config, name="kv", dtype=torch.float32, physical_capacity_positions=1,
            capacity_source="t", scope="request", rows="max_num_seqs",
        )
    assert "num_hidden_layers" in str(info.value) and "n_layer" in str(info.value)


def test_spec_from_config_refuses_indivisible_hidden_size():
    config = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=3, hidden_size=64)
    with pytest.raises(ValueError, match="not divisible"):
        spec_from_hf_config(
            config, name="kv", dtype=torch.float32, physical_capacity_positions=1,
            capacity_source="t", scope="request", rows="max_num_seqs",
        )


class Owner(torch.nn.Module):
    def __init__(self, specs):
        super().__init__()
        self.specs = specs
        self.proj = torch.nn.Linear(2, 2)

    def model_local_kv_specs(self):
        return self.specs


class Raises(torch.nn.Module):
    def model_local_kv_specs(self):
        raise RuntimeError("config not loaded")


class Wrapper:
    """A runner wrapper (CUDA-graph or compile) exposing unwrap()."""

    def __init__(self, inner):
        self.inner = inner

    def unwrap(self):
        return self.inner


def test_collector_walks_modules_counts_shared_owner_once_and_includes_root():
    shared = Owner([make(name="shared")])

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = shared
            self.b = shared  # the same module registered twice
            self.deep = torch.nn.Sequential(torch.nn.Identity(), Owner([make(name="deep")]))

        def model_local_kv_specs(self):
            return [make(name="root")]

    collection = collect_model_local_kv_specs(Wrapper(Wrapper(Root())))
    found = sorted((o.owner, o.spec.name) for o in collection.specs)
    assert found == [("", "root"), ("a", "shared"), ("deep.1", "deep")]
    assert collection.failures == ()


def test_collector_records_a_raising_declarer_and_keeps_the_others(caplog):
    root = torch.nn.Sequential(Raises(), Owner([make(name="ok")]))
    with caplog.at_level(logging.WARNING):
        collection = collect_model_local_kv_specs(root)
    assert [o.spec.name for o in collection.specs] == ["ok"]
    assert len(collection.failures) == 1
    assert collection.failures[0].owner == "0"
    assert "RuntimeError: config not loaded" in collection.failures[0].error
    assert "raised" in caplog.text


@pytest.mark.parametrize("returned", [None, "kv", 42])
def test_collector_records_a_declarer_returning_a_non_sequence(returned):
    collection = collect_model_local_kv_specs(Owner(returned))
    assert collection.specs == ()
    assert "expected a sequence" in collection.failures[0].error


def test_collector_records_an_invalid_declaration_and_keeps_valid_siblings():
    bad = types.SimpleNamespace(**{**VALID, "layers": 0})
    collection = collect_model_local_kv_specs(Owner([make(name="good"), bad]))
    assert [o.spec.name for o in collection.specs] == ["good"]
    assert "'layers'" in collection.failures[0].error


def test_declaring_nothing_is_valid():
    collection = collect_model_local_kv_specs(Owner([]))
    assert collection.specs == () and collection.failures == ()


def test_non_module_owner_is_asked_directly():
    class Plain:
        def model_local_kv_specs(self):
            return [make(name="plain")]

    collection = collect_model_local_kv_specs(Plain())
    assert [(o.owner, o.spec.name) for o in collection.specs] == [("", "plain")]


def test_the_package_exports_the_declaring_surface_and_nothing_heavier():
    declaring = {"ModelLocalKVSpec", "ModelLocalKVScope", "RowDriver", "HasModelLocalKV", "spec_from_hf_config",
                 "collect_model_local_kv_specs", "InvalidDeclarationError"}
    assert set(kv_budget.__all__) == declaring and all(hasattr(kv_budget, name) for name in declaring)
    # One name per thing: the collector's and the planner's types are imported from their modules.
    for name in ("Scope", "Collection", "OwnedSpec", "normalize_spec"):
        assert not hasattr(kv_budget, name)
    # The planner and the samplers are imported from their own modules.
    for name in ("make_plan", "sample_memory", "render_plan_table"):
        assert name not in kv_budget.__all__ and not hasattr(kv_budget, name)


def test_collector_finds_declarers_set_on_an_instance_or_served_by_getattr():
    """The fast path asks the class first; an instance attribute and a
    module whose own __getattr__ serves the method must still be found."""
    plain = torch.nn.Linear(2, 2)
    plain.model_local_kv_specs = lambda: [make(name="instance")]

    class Delegating(torch.nn.Module):
        def __getattr__(self, name):
            if name == "model_local_kv_specs":
                return lambda: [make(name="delegated")]
            return super().__getattr__(name)

    collection = collect_model_local_kv_specs(torch.nn.Sequential(plain, Delegating(), torch.nn.ReLU()))
    assert sorted((o.owner, o.spec.name) for o in collection.specs) == [("0", "instance"), ("1", "delegated")]


def test_fast_owner_walk_keeps_named_modules_paths_order_and_dedup():
    """The collector's walk must find exactly the declaring modules that
    named_modules() plus getattr would, at the same paths, in the same order."""
    from transformers import Qwen2ForCausalLM

    from kv_budget.collect.model import _declaring_modules

    shared = Owner([make(name="shared")])
    tree = torch.nn.ModuleDict({
        "a": torch.nn.Sequential(torch.nn.ReLU(), shared),
        "b": shared,
        "c": torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Identity(), Owner([make(name="deep")]))]),
    })
    tree.register_module("empty", None)
    lm = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=64, vocab_size=64))
    lm.model.layers[1].self_attn.model_local_kv_specs = lambda: []
    for root in (tree, lm):
        slow = [(p, id(m)) for p, m in root.named_modules() if callable(getattr(m, "model_local_kv_specs", None))]
        assert [(p, id(m)) for p, m in _declaring_modules(root)] == slow
        assert slow  # the comparison is not vacuous


class DeclarerBehindAProperty(torch.nn.Module):
    """Reading the declarer itself raises something other than AttributeError."""

    @property
    def model_local_kv_specs(self):
        raise KeyError("stage config not loaded")


def test_a_declarer_that_cannot_even_be_read_is_that_owners_failure():
    root = torch.nn.Sequential(DeclarerBehindAProperty(), Owner([make(name="ok")]))
    collection = collect_model_local_kv_specs(root)
    assert [o.spec.name for o in collection.specs] == ["ok"]
    (failure,) = collection.failures
    assert failure.owner == "0"
    assert failure.error == "reading model_local_kv_specs raised KeyError: 'stage config not loaded'"


class Blocks(torch.nn.Module):
    """A declarer that waits on something that does not come (a lock, a
    remote call) until the test releases it."""

    def __init__(self, release):
        super().__init__()
        self.release = release

    def model_local_kv_specs(self):
        self.release.wait(30)
        return [make(name="late")]


def test_a_slow_declarer_is_named_and_the_collection_ends_at_its_time_limit(caplog):
    import threading
    import time

    release = threading.Event()
    root = torch.nn.Sequential(Owner([make(name="first")]), Blocks(release), Owner([make(name="after")]))
    began = time.monotonic()
    with caplog.at_level(logging.WARNING):
        collection = collect_model_local_kv_specs(root, time_limit_s=0.2)
    assert time.monotonic() - began < 5
    release.set()
    assert [o.spec.name for o in collection.specs] == ["first"]
    slow, skipped = collection.failures
    assert (slow.owner, slow.error) == ("1", "did not return within the collection's time limit of 0.2 s")
    assert (skipped.owner, skipped.error) == ("2", "not asked: the collection's time limit of 0.2 s was spent "
                                                   "waiting for 1")
    assert "model_local_kv_specs() of 1 did not return within 0.2 s" in caplog.text


def test_declarers_within_the_time_limit_are_all_asked():
    root = torch.nn.Sequential(*(Owner([make(name=f"kv{i}")]) for i in range(50)))
    collection = collect_model_local_kv_specs(root, time_limit_s=30)
    assert [o.spec.name for o in collection.specs] == [f"kv{i}" for i in range(50)]
    assert collection.failures == ()


def test_a_name_declared_twice_by_one_owner_is_made_distinct_and_both_are_kept(caplog):
    owner = Owner([make(name="kv"), make(name="kv", layers=3), make(name="kv#2")])
    root = torch.nn.Sequential(owner, Owner([make(name="kv")]))
    with caplog.at_level(logging.WARNING):
        collection = collect_model_local_kv_specs(root)
    assert [(o.owner, o.spec.name) for o in collection.specs] == [
        ("0", "kv"), ("0", "kv#3"), ("0", "kv#2"), ("1", "kv")]
    # The renamed one is the second declaration, bytes unchanged.
    assert collection.specs[1].spec.layers == 3
    assert "0 declares 'kv' more than once; this one is planned and reported as 'kv#3'" in caplog.text


def test_a_declarer_whose_sequence_raises_part_way_keeps_what_came_before():
    def declarations():
        yield make(name="before")
        raise RuntimeError("stage not ready")

    collection = collect_model_local_kv_specs(Owner(declarations()))
    assert [o.spec.name for o in collection.specs] == ["before"]
    (failure,) = collection.failures
    assert failure.error == "iterating its declarations raised RuntimeError: stage not ready"


def test_a_renamed_duplicate_is_what_an_override_names():
    from kv_budget.override import apply_overrides, parse_overrides

    collection = collect_model_local_kv_specs(Owner([make(name="kv"), make(name="kv")]))
    corrected, unmatched = apply_overrides(collection, parse_overrides(["<root>/kv#2:physical_capacity_positions=16"]))
    assert unmatched == []
    assert [o.spec.physical_capacity_positions for o in corrected.specs] == [8, 16]


def test_declaring_imports_torch_and_the_standard_library_only():
    """What a model file imports to declare must not drag the planner's,
    samplers' or deploy reader's dependencies (or vLLM) into the model's
    process; checked in a fresh interpreter, where nothing is loaded yet."""
    code = (
        "import sys\n"
        "from kv_budget import (spec_from_hf_config, ModelLocalKVSpec, RowDriver, ModelLocalKVScope,\n"
        "                       HasModelLocalKV, collect_model_local_kv_specs)\n"
        "print(sorted({name.split('.')[0] for name in sys.modules} & {'vllm', 'psutil', 'yaml', 'pydantic'}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]", result.stdout
