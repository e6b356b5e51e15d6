"""Plan a vLLM-Omni deployment from its deploy file, before starting it.

vLLM-Omni runs a model as several stages, each its own engine, and its
default deploy files put several stages on one GPU. Its admission check
(``engine/stage_admission.py``, only with ``parallel_stage_init``) proves per
device that the stages' budgets fit::

    sum int(capacity x gpu_memory_utilization) + 2 GiB per stage that
    captures CUDA graphs + 1 GiB external reserve + 1 GiB margin <= capacity

It counts no model-local KV: the caches a stage's model keeps outside the
paged pool (Qwen3-TTS's codec decoder, MiMo-Audio's local transformer,
MiniCPM-o's streaming encoder) come on top, per running sequence. This
module reproduces that ledger to the byte and then charges each stage's
declarations on every device the stage uses, so an operator sees before
starting whether the device fits and which ``max_num_seqs`` each stage can
keep.

Two separate steps, so each can be tested on its own:

* :func:`load_deploy` reads a deploy file as vLLM-Omni ships it:
  ``base_config:`` inheritance (resolved relative to the file), ``stages``
  in the flat or the nested (``engine_args:``, ``runtime:``) layout, and
  ``platforms:`` overrides only when a platform is named (vLLM-Omni applies
  the platform it runs on; a plan made on another machine must say which).
* :func:`plan_deploy` is pure integer arithmetic on what was read, the
  device sizes and each stage's declarations, like vLLM-Omni's
  ``evaluate()``.

Semantics (docs/deploy.md walks through them with the shipped files):

* **Requested**: ``int(capacity x gpu_memory_utilization)`` per stage and
  device, in floating point exactly as ``evaluate()`` computes it (a
  :class:`fractions.Fraction` would differ by a byte on some sizes, and the
  ledger must be vLLM-Omni's own). Attention-free stages (Qwen3-TTS's
  code2wav) allocate no paged pool but are still charged their whole share,
  as vLLM-Omni charges them: the share is the stage's memory budget, not its
  pool. A stage without ``gpu_memory_utilization`` gets vLLM 0.30's default,
  0.92.
* **kv_cache_memory_bytes** sizes only a stage's paged pool (vLLM skips
  profiling and ignores ``gpu_memory_utilization`` for the pool; weights and
  activations come on top), and vLLM-Omni's admission still charges the
  utilization share. So the share stays the requested term; where the pool
  alone is larger than the share, the difference is charged as
  ``kv_cache_excess_bytes`` (the stage cannot stay inside its share then).
* **Graph reserve**: 2 GiB per stage and device unless ``enforce_eager`` is
  true or ``compilation_config.cudagraph_mode`` is ``NONE``, as vLLM-Omni's
  ``graph_reserve_bytes``. From the file alone every stage is taken to be
  an LLM stage; a diffusion stage (no graph reserve in vLLM-Omni) would be
  over-reserved by 2 GiB here.
* **Already-charged** model-local KV (scope ``model``) is reported and never
  subtracted: it is allocated while the model loads, profiles or captures
  graphs, so it sits inside the stage's requested share (the pool shrinks to
  make room) or in its graph reserve. Subtracting it again would double count
  it, as in :mod:`kv_budget.plan.planner`.
* **Left for per-sequence KV** on a device = capacity - required (vLLM-Omni's
  terms) - kv_cache excess - every stage's uncharged fixed model-local KV.
  A stage's declarations count on *every* device it lists (each
  tensor-parallel worker runs every sequence).
* **Split rule, "proportional to configured demand"**: the declaring stages
  on a device need ``per_seq x max_num_seqs`` each. If their sum fits what
  is left, each keeps its configured value. Otherwise each gets a share of
  what is left in proportion to its configured demand, and its safe value is
  ``floor(share / per_seq)``; a stage on several devices takes its minimum.
  Proportional shares keep the ratio the deploy file chose between stages,
  rather than letting whichever stage is planned first take everything.
* **fits** (per device) is false when vLLM-Omni's own test fails (required >
  capacity), when the uncharged fixed model-local KV does not fit, or when a
  declaring stage's safe ``max_num_seqs`` there is 0.

Every figure is integer bytes. Nothing here imports vLLM or vLLM-Omni.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from kv_budget.collect import Collection
from kv_budget.plan.planner import (
    Constraint,
    Decision,
    DeclarationLine,
    Policy,
    WorkerBudget,
    budget_worker,
    headroom_override,
    make_plan,
)
from kv_budget.units import GiB

__all__ = [
    "DeployError",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "GRAPH_RESERVE_BYTES",
    "EXTERNAL_RESERVE_BYTES",
    "SAFETY_MARGIN_BYTES",
    "SPLIT_RULE",
    "StageDeploy",
    "DeployFile",
    "StageDeclarations",
    "StageOnDevice",
    "DeviceLedger",
    "StagePlan",
    "DeployPlan",
    "load_deploy",
    "plan_deploy",
    "requested_bytes",
]

DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
"""vLLM 0.30's ``CacheConfig`` default, which a stage gets when its deploy
entry sets no ``gpu_memory_utilization`` (vLLM-Omni sets none of its own)."""

GRAPH_RESERVE_BYTES = 2 * GiB
"""vLLM-Omni's admission reserve per stage that captures CUDA graphs."""

EXTERNAL_RESERVE_BYTES = 1 * GiB
"""vLLM-Omni's admission reserve for consumers outside every stage."""

SAFETY_MARGIN_BYTES = 1 * GiB
"""vLLM-Omni's admission margin for fragmentation and allocator slack."""

SPLIT_RULE = "proportional to configured demand"
"""Name of the rule that splits what is left on a device between the stages
declaring per-sequence KV there (see the module docstring)."""


class DeployError(ValueError):
    """A deploy file, or an option about it, that cannot be planned; the
    message names the file, the key and the value."""


# ---- reading a deploy file ---------------------------------------------------


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, also reading ``1e9`` as a float as vLLM-Omni's
    loader (OmegaConf) does; plain YAML 1.1 wants a dot there."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

_STAGE_FIELDS = frozenset({"gpu_memory_utilization", "max_num_seqs", "enforce_eager", "compilation_config",
                           "tensor_parallel_size"})
"""The stage settings read here that are vLLM-Omni ``StageDeployConfig``
fields. Its loader lets an explicit ``engine_extras`` entry win over them
(the extras are applied last), while other keys (``kv_cache_memory_bytes``)
collect into the extras, where a flat or ``engine_args`` value wins."""

_DEEP_MERGED = ("engine_args", "engine_extras")
"""Stage keys an inheriting file merges into its base key by key; any other
stage key is replaced whole (``runtime:`` included), as vLLM-Omni merges."""


@dataclass(frozen=True)
class _Source:
    """The file being read and its ``base_config`` chain, for messages."""

    path: Path
    chain: tuple[Path, ...]

    def where(self) -> str:
        if not self.chain:
            return f"deploy file {self.path}"
        return f"deploy file {self.path} (base_config {' -> '.join(str(p) for p in self.chain)})"


def _read_yaml(path: Path, source: _Source, key: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise DeployError(f"{source.where()}: {key} = {str(path)!r}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        which = "" if path == source.path else f"{path} "
        # PyYAML's messages span lines (the problem, then where it is): one line.
        raise DeployError(f"{source.where()}: {which}is not YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        which = "" if path == source.path else f"{path} "
        raise DeployError(f"{source.where()}: {which}holds a {type(data).__name__}, not a mapping")
    return data


def _stage_id(entry: Any, where: str, key: str) -> int:
    if not isinstance(entry, dict):
        raise DeployError(f"{where}: {key} = {entry!r}: expected a mapping with a stage_id")
    sid = entry.get("stage_id")
    if isinstance(sid, bool) or not isinstance(sid, int):
        raise DeployError(f"{where}: {key}.stage_id = {sid!r}: expected an integer")
    return sid


def _stage_list(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise DeployError(f"{where}: {key} = {value!r}: expected a list of stages")
    for index, entry in enumerate(value):
        _stage_id(entry, where, f"{key}[{index}]")
    return value


def _merge_dicts(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = _merge_dicts(merged[key], value)
        else:
            merged[key] = value
    return merged


def _merge_stages(base: list[dict[str, Any]], overlay: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stages by ``stage_id``: an overlay entry's keys replace the base's,
    except :data:`_DEEP_MERGED` ones, merged key by key."""
    by_id = {stage["stage_id"]: stage for stage in base}
    for stage in overlay:
        old = by_id.get(stage["stage_id"])
        if old is None:
            by_id[stage["stage_id"]] = stage
            continue
        merged = {**old, **stage}
        for key in _DEEP_MERGED:
            if isinstance(old.get(key), dict) and isinstance(stage.get(key), dict):
                merged[key] = _merge_dicts(old[key], stage[key])
        by_id[stage["stage_id"]] = merged
    return list(by_id.values())


def _merge_platforms(base: Any, overlay: Any) -> dict[str, Any] | None:
    """``platforms:`` of a base and an inheriting file, merged per platform
    and, within one, per stage."""
    if not base and not overlay:
        return None
    base, overlay = base or {}, overlay or {}
    merged = {}
    for name in {**base, **overlay}:
        old, new = base.get(name) or {}, overlay.get(name) or {}
        section = {**old, **{k: v for k, v in new.items() if k != "stages"}}
        section["stages"] = _merge_stages(old.get("stages") or [], new.get("stages") or [])
        merged[name] = section
    return merged


def _resolve(path: Path, source: _Source, seen: tuple[Path, ...]) -> tuple[dict[str, Any], tuple[Path, ...]]:
    """The file's mapping with its ``base_config`` chain merged in (an
    inheriting file's top-level keys win; ``stages`` and ``platforms`` merge
    by stage), and the chain of base files."""
    data = _read_yaml(path, source, "base_config" if seen else "path")
    where = source.where() if path == source.path else f"{source.where()}: in {path}"
    data["stages"] = _stage_list(data.get("stages"), where, "stages")
    platforms = data.get("platforms")
    if platforms is not None and not isinstance(platforms, dict):
        raise DeployError(f"{where}: platforms = {platforms!r}: expected a mapping of platform names")
    for name, section in (platforms or {}).items():
        if section is not None and not isinstance(section, dict):
            raise DeployError(f"{where}: platforms.{name} = {section!r}: expected a mapping")
        _stage_list((section or {}).get("stages"), where, f"platforms.{name}.stages")
    base_name = data.pop("base_config", None)
    if base_name is None:
        return data, ()
    if not isinstance(base_name, str) or not base_name:
        raise DeployError(f"{where}: base_config = {base_name!r}: expected a file name")
    base_path = (path.parent / base_name).resolve()
    if base_path in seen or base_path == path.resolve():
        raise DeployError(f"{where}: base_config = {base_name!r}: inheritance loops back to {base_path}")
    if not base_path.is_file():
        raise DeployError(f"{where}: base_config = {base_name!r}: no such file {base_path}")
    base, chain = _resolve(base_path, _Source(source.path, source.chain + (base_path,)),
                           seen + (path.resolve(),))
    merged = {**base, **{k: v for k, v in data.items() if k not in ("stages", "platforms")}}
    merged["stages"] = _merge_stages(base.get("stages") or [], data["stages"])
    platforms = _merge_platforms(base.get("platforms"), data.get("platforms"))
    if platforms is not None:
        merged["platforms"] = platforms
    return merged, (base_path,) + chain


class StageDeploy(BaseModel):
    """One stage as its deploy file (after inheritance and any platform
    overrides) places and sizes it, each setting with where it came from, so
    the plan's inputs can be checked against the file by hand."""

    model_config = ConfigDict(frozen=True)

    stage_id: int
    replicas: list[list[int]]
    """Devices of each replica (logical indices, as the file writes them);
    one entry unless ``num_replicas`` > 1."""

    devices_source: str
    gpu_memory_utilization: float
    gpu_memory_utilization_source: str
    max_num_seqs: int | None
    """None when the file sets none (vLLM then picks a default that depends
    on the device)."""

    max_num_seqs_source: str
    enforce_eager: bool
    cudagraph_mode: str | None
    captures_cuda_graphs: bool
    """Whether vLLM-Omni charges this stage a graph reserve."""

    graph_reserve_source: str
    kv_cache_memory_bytes: int | None
    """The paged pool's fixed size when the stage sets one (0 counts as unset,
    as in vLLM-Omni's worker)."""

    kv_cache_memory_bytes_source: str | None = None

    @property
    def devices(self) -> list[int]:
        """Every device some replica of the stage uses, in order."""
        return sorted({device for replica in self.replicas for device in replica})

    @property
    def graph_reserve_bytes(self) -> int:
        """vLLM-Omni's reserve for this stage on each of its devices."""
        return GRAPH_RESERVE_BYTES if self.captures_cuda_graphs else 0


class DeployFile(BaseModel):
    """A deploy file read for planning: its stages and what was applied."""

    model_config = ConfigDict(frozen=True)

    path: str
    base_files: list[str]
    """The ``base_config`` chain, nearest first."""

    platform: str | None
    platform_note: str
    """What ``--platform`` changed, or why it changed nothing."""

    stages: list[StageDeploy]

    def where(self) -> str:
        """The file (and its base chain) as error messages name it."""
        if not self.base_files:
            return f"deploy file {self.path}"
        return f"deploy file {self.path} (base_config {' -> '.join(self.base_files)})"


@dataclass
class _Stage:
    """A stage entry split the way vLLM-Omni's loader splits it."""

    stage_id: int
    fields: dict[str, tuple[Any, str]]
    extras: dict[str, tuple[Any, str]]
    """Key -> (value, where it was written)."""

    devices: tuple[Any, str] | None
    num_replicas: tuple[Any, str]

    def get(self, key: str) -> tuple[Any, str] | None:
        if key in _STAGE_FIELDS and key not in self.extras:
            return self.fields.get(key)
        return self.extras.get(key)


def _mapping(entry: dict[str, Any], name: str, where: str, key: str) -> dict[str, Any]:
    value = entry.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DeployError(f"{where}: {key}.{name} = {value!r}: expected a mapping")
    return value


def _split_stage(entry: dict[str, Any], key: str, where: str) -> _Stage:
    """Settings from the flat keys, ``engine_args:`` (wins over flat),
    ``engine_extras:`` and ``runtime:`` (wins for devices and replicas)."""
    sid = entry["stage_id"]
    runtime = _mapping(entry, "runtime", where, key)
    fields: dict[str, tuple[Any, str]] = {}
    extras: dict[str, tuple[Any, str]] = {}
    for name, value in _mapping(entry, "engine_extras", where, key).items():
        extras[name] = (value, f"{key}.engine_extras.{name}")
    flat = {k: (v, f"{key}.{k}") for k, v in entry.items()
            if k not in ("stage_id", "devices", "num_replicas", "env", "runtime", "engine_args", "engine_extras")}
    for name, value in _mapping(entry, "engine_args", where, key).items():
        flat[name] = (value, f"{key}.engine_args.{name}")
    for name, pair in flat.items():
        (fields if name in _STAGE_FIELDS else extras)[name] = pair
    if "devices" in runtime:
        devices = (runtime["devices"], f"{key}.runtime.devices")
    elif "devices" in entry:
        devices = (entry["devices"], f"{key}.devices")
    else:
        devices = None
    if "num_replicas" in runtime:
        replicas = (runtime["num_replicas"], f"{key}.runtime.num_replicas")
    else:
        replicas = (entry.get("num_replicas", 1), f"{key}.num_replicas")
    return _Stage(sid, fields, extras, devices, replicas)


def _apply_platform(stages: dict[int, _Stage], platforms: Any, platform: str, where: str) -> str:
    """Apply ``platforms.<platform>`` to the stages (a field is replaced; any
    other key goes to the extras, where it wins); return what it changed."""
    if not isinstance(platforms, dict) or not platforms:
        return f"platform {platform}: the file has no platforms: section; nothing overridden"
    section = platforms.get(platform)
    if section is None:
        return (f"platform {platform}: the file has no platforms.{platform} section "
                f"(sections: {', '.join(sorted(platforms))}); nothing overridden")
    if not isinstance(section, dict):
        raise DeployError(f"{where}: platforms.{platform} = {section!r}: expected a mapping")
    changed = []
    for entry in _stage_list(section.get("stages"), where, f"platforms.{platform}.stages"):
        stage = stages.get(entry["stage_id"])
        if stage is None:
            continue
        key = f"platforms.{platform}.stages[stage_id={entry['stage_id']}]"
        if "engine_args" in entry:
            overrides = {k: (v, f"{key}.engine_args.{k}")
                         for k, v in _mapping(entry, "engine_args", where, key).items()}
            runtime = _mapping(entry, "runtime", where, key)
            if "num_replicas" in runtime:
                stage.num_replicas = (runtime["num_replicas"], f"{key}.runtime.num_replicas")
            if runtime.get("devices") is not None:
                stage.devices = (runtime["devices"], f"{key}.runtime.devices")
        else:
            overrides = {k: (v, f"{key}.{k}") for k, v in entry.items() if k not in ("stage_id", "devices", "env")}
            if entry.get("devices") is not None:
                stage.devices = (entry["devices"], f"{key}.devices")
        for name, pair in overrides.items():
            if name in _STAGE_FIELDS:
                stage.fields[name] = pair
            elif name == "num_replicas":
                stage.num_replicas = pair
            else:
                stage.extras[name] = pair
            changed.append(f"stage {stage.stage_id} {name}={pair[0]!r}")
    if not changed:
        return f"platform {platform}: platforms.{platform} changes no stage setting"
    return f"platform {platform}: applied platforms.{platform}: " + ", ".join(changed)


def _int_setting(pair: tuple[Any, str], where: str, minimum: int) -> int:
    value, key = pair
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DeployError(f"{where}: {key} = {value!r}: expected an integer >= {minimum}")
    return value


def _device_ids(pair: tuple[Any, str], where: str) -> list[int]:
    value, key = pair
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return [value]
    tokens = [t.strip() for t in value.split(",")] if isinstance(value, str) else None
    if not tokens or not all(t.isdigit() for t in tokens):
        raise DeployError(
            f"{where}: {key} = {value!r}: expected comma-separated device indices such as \"0\" or \"0,1\" "
            "(a per-device ledger cannot be made for 'cpu', UUIDs or MIG names)"
        )
    return [int(t) for t in tokens]


def _parallel_size(stage: _Stage, top: dict[str, Any], name: str, where: str) -> int:
    pair = stage.get(name)
    if pair is None and top.get(name) is not None:
        pair = (top[name], name)
    return 1 if pair is None or pair[0] is None else _int_setting(pair, where, 1)


def _replica_devices(stage: _Stage, top: dict[str, Any], where: str) -> tuple[list[list[int]], str]:
    """Each replica's devices, split the two ways vLLM-Omni accepts for
    ``num_replicas`` > 1: the whole pool (replica r takes the r-th run of
    devices_per_replica ids) or a one-replica template shifted by r."""
    tp = _parallel_size(stage, top, "tensor_parallel_size", where)
    pp = _parallel_size(stage, top, "pipeline_parallel_size", where)
    dp_pair = stage.get("data_parallel_size_local")
    dp = _int_setting(dp_pair, where, 1) if dp_pair is not None and dp_pair[0] is not None else \
        _parallel_size(stage, top, "data_parallel_size", where)
    per_replica = tp * pp * dp
    replicas = _int_setting(stage.num_replicas, where, 1)
    if stage.devices is None or stage.devices[0] is None:
        ids = list(range(per_replica))
        return [ids] * replicas, (
            f"not set: the stage inherits the launcher's visible devices and uses the first {per_replica} "
            f"(logical {ids})"
        )
    ids = _device_ids(stage.devices, where)
    key = stage.devices[1]
    if replicas == 1:
        return [ids], key
    if len(ids) == replicas * per_replica:
        pool = [ids[r * per_replica:(r + 1) * per_replica] for r in range(replicas)]
        return pool, f"{key} (pool of {replicas} replicas)"
    if len(ids) == per_replica and all(0 <= i < per_replica for i in ids):
        shifted = [[r * per_replica + i for i in ids] for r in range(replicas)]
        return shifted, f"{key} (template for {replicas} replicas)"
    raise DeployError(
        f"{where}: {key} = {stage.devices[0]!r}: {len(ids)} device(s) for num_replicas={replicas} x "
        f"{per_replica} device(s) per replica; give {per_replica} (a template) or {replicas * per_replica} (the pool)"
    )


def _stage_deploy(stage: _Stage, top: dict[str, Any], where: str) -> StageDeploy:
    replicas, devices_source = _replica_devices(stage, top, where)

    util_pair = stage.get("gpu_memory_utilization")
    if util_pair is None or util_pair[0] is None:
        util, util_source = DEFAULT_GPU_MEMORY_UTILIZATION, "not set: vLLM 0.30's default"
    else:
        util, util_source = util_pair
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise DeployError(f"{where}: {util_source} = {util!r}: expected a number in (0, 1]")
        util = float(util)

    seqs_pair = stage.get("max_num_seqs")
    if seqs_pair is None or seqs_pair[0] is None:
        max_num_seqs, seqs_source = None, "not set: vLLM picks a default that depends on the device"
    else:
        max_num_seqs, seqs_source = _int_setting(seqs_pair, where, 1), seqs_pair[1]

    eager_pair = stage.get("enforce_eager")
    enforce_eager = False
    eager_source = "enforce_eager not set (vLLM's default false)"
    if eager_pair is not None and eager_pair[0] is not None:
        if not isinstance(eager_pair[0], bool):
            raise DeployError(f"{where}: {eager_pair[1]} = {eager_pair[0]!r}: expected true or false")
        enforce_eager, eager_source = eager_pair[0], f"{eager_pair[1]} = {str(eager_pair[0]).lower()}"

    mode, mode_source = None, ""
    compilation = stage.get("compilation_config")
    if compilation is not None and isinstance(compilation[0], dict) and compilation[0].get("cudagraph_mode"):
        mode = str(compilation[0]["cudagraph_mode"])
        mode_source = f"{compilation[1]}.cudagraph_mode = {mode}"
    if enforce_eager:
        captures, graph_source = False, eager_source
    elif mode is not None and mode.upper().endswith("NONE"):
        captures, graph_source = False, mode_source
    else:
        captures = True
        graph_source = eager_source + (f", {mode_source}" if mode is not None else "")

    kv_pair = stage.get("kv_cache_memory_bytes")
    kv_bytes = kv_source = None
    if kv_pair is not None and kv_pair[0] is not None:
        kv_bytes = _int_setting(kv_pair, where, 0) or None
        kv_source = kv_pair[1]

    return StageDeploy(
        stage_id=stage.stage_id,
        replicas=replicas,
        devices_source=devices_source,
        gpu_memory_utilization=util,
        gpu_memory_utilization_source=util_source,
        max_num_seqs=max_num_seqs,
        max_num_seqs_source=seqs_source,
        enforce_eager=enforce_eager,
        cudagraph_mode=mode,
        captures_cuda_graphs=captures,
        graph_reserve_source=graph_source,
        kv_cache_memory_bytes=kv_bytes,
        kv_cache_memory_bytes_source=kv_source,
    )


def load_deploy(path: str | Path, platform: str | None = None) -> DeployFile:
    """Read a vLLM-Omni deploy file for planning.

    ``base_config:`` is resolved relative to the file that names it, as
    vLLM-Omni does. ``platforms:`` overrides apply only when ``platform`` is
    given (``cuda``, ``rocm``, ``npu``, ...): vLLM-Omni applies the one it
    runs on, which a plan made elsewhere cannot know. A platform the file has
    no section for changes nothing (as in vLLM-Omni) and the note says so.
    Raises :class:`DeployError` naming the file, the key and the value.
    """
    path = Path(path)
    source = _Source(path, ())
    data, chain = _resolve(path, source, ())
    where = _Source(path, chain).where()
    if "stage_args" in data:
        raise DeployError(f"{where}: stage_args: the removed legacy schema; vLLM-Omni 0.30 reads stages:")
    if not data["stages"]:
        raise DeployError(f"{where}: stages = {data.get('stages')!r}: no stages to plan")
    stages: dict[int, _Stage] = {}
    for index, entry in enumerate(data["stages"]):
        sid = entry["stage_id"]
        if sid in stages:
            raise DeployError(f"{where}: stages[{index}].stage_id = {sid}: stage {sid} appears twice")
        stages[sid] = _split_stage(entry, f"stages[stage_id={sid}]", where)
    if platform is None:
        note = "no --platform: platforms: overrides not applied"
    else:
        note = _apply_platform(stages, data.get("platforms"), platform, where)
    return DeployFile(
        path=str(path),
        base_files=[str(p) for p in chain],
        platform=platform,
        platform_note=note,
        stages=[_stage_deploy(stage, data, where) for stage in stages.values()],
    )


# ---- the plan ------------------------------------------------------------------


@dataclass(frozen=True)
class StageDeclarations:
    """What one stage's model declares, and where the declarations came from
    (a preset name or a spec file), for the plan's inputs."""

    stage_id: int
    source: str
    collection: Collection


class StageOnDevice(BaseModel):
    """One replica of a stage on one device: its admission terms and its
    model-local KV there."""

    stage_id: int
    replica: int
    gpu_memory_utilization: float
    requested_bytes: int
    """``int(capacity x gpu_memory_utilization)``, as vLLM-Omni computes it."""

    graph_reserve_bytes: int
    kv_cache_memory_bytes: int | None
    kv_cache_excess_bytes: int
    """Pool size beyond the utilization share (0 unless the fixed pool is
    larger than the share)."""

    charged_bytes: int
    uncharged_fixed_bytes: int
    per_seq_bytes: int
    configured_max_num_seqs: int | None
    per_seq_demand_bytes: int
    """per_seq x configured max_num_seqs: its claim in the split."""

    share_bytes: int | None
    """Its part of what is left for per-sequence KV; None when it declares
    nothing per sequence."""

    headroom_source: str | None
    safe_max_num_seqs: int | None
    """min(configured, floor(share / per_seq)) on this device; None when
    model-local KV puts no bound on it here."""


class DeviceLedger(BaseModel):
    """One device: vLLM-Omni's admission terms, then model-local KV."""

    device: int
    capacity_bytes: int
    capacity_source: str
    stages: list[StageOnDevice]
    requested_bytes: int
    """Sum of the stages' ``int(capacity x gpu_memory_utilization)``."""

    graph_reserve_bytes: int
    external_reserve_bytes: int
    margin_bytes: int
    required_bytes: int
    """requested + graph reserve + external reserve + margin: vLLM-Omni's
    left-hand side."""

    admission_fits: bool
    """vLLM-Omni's own test, ``required <= capacity``."""

    kv_cache_excess_bytes: int
    charged_bytes: int
    """Already-charged model-local KV, inside the requested shares or graph
    reserves; reported, not subtracted."""

    uncharged_fixed_bytes: int
    left_for_per_seq_bytes: int
    """capacity - required - kv_cache excess - uncharged fixed: what the
    per-sequence KV of the declaring stages must fit. Negative when even the
    fixed part does not fit."""

    per_seq_demand_bytes: int
    """Sum of per_seq x configured max_num_seqs of the stages here."""

    model_local_bytes: int
    """Uncharged model-local KV at each stage's effective max_num_seqs:
    fixed + per_seq x effective."""

    free_bytes: int
    """capacity - required - kv_cache excess - model_local_bytes: what
    stays unclaimed with the plan applied (negative: over-committed, as under
    ``warn`` when the configured values do not fit)."""

    fits: bool


class StagePlan(BaseModel):
    """One stage's figures and its ``max_num_seqs`` under the plan."""

    stage_id: int
    devices: list[int]
    settings: StageDeploy
    """What the deploy file set for the stage, with where each came from."""

    declarations_source: str | None
    """Preset name or spec file; None when nothing was declared for it."""

    configured_max_num_seqs: int | None
    safe_max_num_seqs: int | None
    """min(configured, the smallest per-device bound); None when model-local
    KV puts no bound on the stage (it declares nothing per sequence and its
    fixed part fits)."""

    effective_max_num_seqs: int | None
    decision: Decision
    per_seq_bytes: int
    uncharged_fixed_bytes: int
    charged_bytes: int
    constraints: list[Constraint]
    declarations: list[DeclarationLine]


class DeployPlan(BaseModel):
    """The per-device ledger and each stage's ``max_num_seqs``."""

    deploy_file: str
    base_files: list[str]
    platform: str | None
    platform_note: str
    policy: Policy
    split_rule: str
    devices: list[DeviceLedger]
    stages: list[StagePlan]
    fits: bool
    """Every device fits."""

    @property
    def infeasible(self) -> bool:
        """Under ``cap``, some device cannot host its stages: start nothing."""
        return self.policy is Policy.CAP and not self.fits


def requested_bytes(capacity_bytes: int, gpu_memory_utilization: float) -> int:
    """A stage's requested term on a device, in floating point exactly as
    vLLM-Omni's ``evaluate()`` computes it, so the ledger matches to the byte."""
    return int(capacity_bytes * gpu_memory_utilization)


def plan_deploy(
    deploy: DeployFile,
    capacities: Mapping[int, int],
    declarations: Mapping[int, StageDeclarations] | None = None,
    policy: Policy | str = Policy.CAP,
    capacity_sources: Mapping[int, str] | None = None,
) -> DeployPlan:
    """The per-device ledger of ``deploy`` on devices of ``capacities``
    bytes, with each stage's ``declarations`` charged on its devices.

    Pure arithmetic on integers (no file, no device), like vLLM-Omni's
    ``evaluate()``. Raises :class:`DeployError` when a device has no size,
    declarations name a stage the file lacks, or a declaring stage has no
    ``max_num_seqs``.
    """
    policy = Policy(policy)
    declarations = dict(declarations or {})
    used = _check_inputs(deploy, capacities, declarations)
    by_id = {stage.stage_id: stage for stage in deploy.stages}
    # Each stage's declarations split once (charged / fixed / per sequence):
    # those figures do not depend on any headroom.
    splits = {sid: budget_worker(decl.collection, headroom_override(0), max_num_seqs=by_id[sid].max_num_seqs or 1)
              for sid, decl in declarations.items()}

    entries: dict[int, list[StageOnDevice]] = {device: [] for device in used}
    for stage in deploy.stages:
        for replica, replica_devices in enumerate(stage.replicas):
            for device in replica_devices:
                entries[device].append(_stage_on_device(stage, replica, capacities[device],
                                                        splits.get(stage.stage_id)))

    workers: dict[int, list[WorkerBudget]] = {sid: [] for sid in splits}
    terms = {}
    for device, here in entries.items():
        terms[device] = _Terms.of(capacities[device], here)
        for index, entry in enumerate(here):
            if entry.stage_id in splits and (entry.uncharged_fixed_bytes or entry.per_seq_bytes):
                here[index], worker = _bound(entry, device, terms[device], declarations[entry.stage_id])
                workers[entry.stage_id].append(worker)

    stages = [_stage_plan(stage, declarations.get(stage.stage_id), splits.get(stage.stage_id),
                          workers.get(stage.stage_id, []), policy) for stage in deploy.stages]
    effective = {stage.stage_id: stage.effective_max_num_seqs or 0 for stage in stages}
    sources = capacity_sources or {}
    devices = [_device_ledger(device, here, terms[device], effective, sources.get(device, "given"))
               for device, here in entries.items()]
    return DeployPlan(
        deploy_file=deploy.path,
        base_files=deploy.base_files,
        platform=deploy.platform,
        platform_note=deploy.platform_note,
        policy=policy,
        split_rule=SPLIT_RULE,
        devices=devices,
        stages=stages,
        fits=all(device.fits for device in devices),
    )


def _check_inputs(deploy: DeployFile, capacities: Mapping[int, int],
                  declarations: Mapping[int, StageDeclarations]) -> list[int]:
    """The devices the stages use, once every input the plan needs is there."""
    where = deploy.where()
    by_id = {stage.stage_id: stage for stage in deploy.stages}
    for sid, decl in declarations.items():
        if sid not in by_id:
            raise DeployError(f"{where}: declarations for stage {sid} ({decl.source}): the file has stages "
                              f"{sorted(by_id)}")
        if decl.collection.specs and by_id[sid].max_num_seqs is None:
            raise DeployError(
                f"{where}: stages[stage_id={sid}].max_num_seqs = None: stage {sid} declares model-local KV "
                f"({decl.source}), which needs its max_num_seqs; vLLM's default depends on the device"
            )
    used = sorted({device for stage in deploy.stages for device in stage.devices})
    missing = [device for device in used if device not in capacities]
    if missing:
        raise DeployError(f"{where}: no size for device(s) {missing}; the stages use devices {used}")
    return used


def _stage_on_device(stage: StageDeploy, replica: int, capacity: int, split: WorkerBudget | None) -> StageOnDevice:
    requested = requested_bytes(capacity, stage.gpu_memory_utilization)
    per_seq = split.per_seq_bytes if split else 0
    return StageOnDevice(
        stage_id=stage.stage_id,
        replica=replica,
        gpu_memory_utilization=stage.gpu_memory_utilization,
        requested_bytes=requested,
        graph_reserve_bytes=stage.graph_reserve_bytes,
        kv_cache_memory_bytes=stage.kv_cache_memory_bytes,
        kv_cache_excess_bytes=max(0, (stage.kv_cache_memory_bytes or 0) - requested),
        charged_bytes=split.charged_bytes if split else 0,
        uncharged_fixed_bytes=split.uncharged_fixed_bytes if split else 0,
        per_seq_bytes=per_seq,
        configured_max_num_seqs=stage.max_num_seqs,
        per_seq_demand_bytes=per_seq * (stage.max_num_seqs or 0),
        share_bytes=None,
        headroom_source=None,
        safe_max_num_seqs=None,
    )


@dataclass(frozen=True)
class _Terms:
    """One device's sums: vLLM-Omni's terms, then what they leave."""

    capacity: int
    requested: int
    graph: int
    required: int
    excess: int
    fixed: int
    left: int
    demand: int

    @classmethod
    def of(cls, capacity: int, entries: list[StageOnDevice]) -> _Terms:
        requested = sum(e.requested_bytes for e in entries)
        graph = sum(e.graph_reserve_bytes for e in entries)
        required = requested + graph + EXTERNAL_RESERVE_BYTES + SAFETY_MARGIN_BYTES
        excess = sum(e.kv_cache_excess_bytes for e in entries)
        fixed = sum(e.uncharged_fixed_bytes for e in entries)
        return cls(capacity, requested, graph, required, excess, fixed,
                   left=capacity - required - excess - fixed,
                   demand=sum(e.per_seq_demand_bytes for e in entries))


def _bound(entry: StageOnDevice, device: int, terms: _Terms,
           decl: StageDeclarations) -> tuple[StageOnDevice, WorkerBudget]:
    """The stage's share of what is left on the device (the split rule) and
    the planner's bound on it there: the share plus the stage's own fixed
    part is its headroom, so :func:`kv_budget.plan.planner.budget_worker` gives
    ``floor(share / per_seq)``. When even the fixed parts do not fit, every
    declaring stage on the device gets less than its fixed part: 0."""
    if terms.left < 0:
        share = 0
        headroom = max(entry.uncharged_fixed_bytes + terms.left, 0)
        source = (f"device {device}: uncharged fixed {terms.fixed:,} B of all stages exceeds what vLLM-Omni's "
                  f"terms leave ({terms.left + terms.fixed:,} B) by {-terms.left:,} B")
    else:
        share = terms.left * entry.per_seq_demand_bytes // terms.demand if terms.demand else 0
        headroom = entry.uncharged_fixed_bytes + share
        source = (f"device {device}: own uncharged fixed {entry.uncharged_fixed_bytes:,} B + share "
                  f"{share:,} B = left {terms.left:,} B x demand {entry.per_seq_demand_bytes:,} B / "
                  f"total demand {terms.demand:,} B")
    worker = budget_worker(decl.collection, headroom_override(headroom, source), rank=device,
                           max_num_seqs=entry.configured_max_num_seqs or 1)
    safe = worker.safe_max_num_seqs
    if safe is not None and entry.configured_max_num_seqs is not None:
        safe = min(safe, entry.configured_max_num_seqs)
    updated = entry.model_copy(update={
        "share_bytes": share if entry.per_seq_bytes else None,
        "headroom_source": source,
        "safe_max_num_seqs": safe,
    })
    return updated, worker


def _device_ledger(device: int, entries: list[StageOnDevice], terms: _Terms, effective: Mapping[int, int],
                   capacity_source: str) -> DeviceLedger:
    model_local = sum(e.uncharged_fixed_bytes + e.per_seq_bytes * effective[e.stage_id] for e in entries)
    admission_fits = terms.required <= terms.capacity
    starved = any(e.safe_max_num_seqs == 0 for e in entries)
    return DeviceLedger(
        device=device,
        capacity_bytes=terms.capacity,
        capacity_source=capacity_source,
        stages=entries,
        requested_bytes=terms.requested,
        graph_reserve_bytes=terms.graph,
        external_reserve_bytes=EXTERNAL_RESERVE_BYTES,
        margin_bytes=SAFETY_MARGIN_BYTES,
        required_bytes=terms.required,
        admission_fits=admission_fits,
        kv_cache_excess_bytes=terms.excess,
        charged_bytes=sum(e.charged_bytes for e in entries),
        uncharged_fixed_bytes=terms.fixed,
        left_for_per_seq_bytes=terms.left,
        per_seq_demand_bytes=terms.demand,
        model_local_bytes=model_local,
        free_bytes=terms.capacity - terms.required - terms.excess - model_local,
        fits=admission_fits and terms.left >= 0 and not starved,
    )


def _stage_plan(stage: StageDeploy, decl: StageDeclarations | None, split: WorkerBudget | None,
                workers: list[WorkerBudget], policy: Policy) -> StagePlan:
    """A stage's bound: the minimum over its devices, decided by
    :func:`kv_budget.plan.planner.make_plan` under ``policy``."""
    configured = stage.max_num_seqs
    constraints = []
    if configured is not None:
        constraints.append(Constraint(name="configured max_num_seqs", value=configured,
                                      detail=f"deploy file {stage.max_num_seqs_source}"))
    safe, effective, decision = None, configured, Decision.OK
    lines: list[DeclarationLine] = []
    if split is not None:
        lines = split.declarations
    if workers:
        plan = make_plan(workers, configured, policy)
        lines = plan.declarations
        for worker in workers:
            if worker.safe_max_num_seqs is None:
                continue
            constraints.append(Constraint(
                name=f"model-local KV share on device {worker.rank}",
                value=worker.safe_max_num_seqs,
                detail=(f"floor((headroom {worker.headroom.bytes:,} B - uncharged fixed "
                        f"{worker.uncharged_fixed_bytes:,} B) / per-sequence {worker.per_seq_bytes:,} B); "
                        f"{worker.headroom.source}"),
            ))
        safe = None if plan.safe_max_num_seqs is None else min(plan.safe_max_num_seqs, configured)
        effective, decision = plan.effective_max_num_seqs, plan.decision
    return StagePlan(
        stage_id=stage.stage_id,
        devices=stage.devices,
        settings=stage,
        declarations_source=decl.source if decl else None,
        configured_max_num_seqs=configured,
        safe_max_num_seqs=safe,
        effective_max_num_seqs=effective,
        decision=decision,
        per_seq_bytes=split.per_seq_bytes if split else 0,
        uncharged_fixed_bytes=split.uncharged_fixed_bytes if split else 0,
        charged_bytes=split.charged_bytes if split else 0,
        constraints=constraints,
        declarations=lines,
    )
