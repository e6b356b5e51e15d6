"""Read a vLLM-Omni deploy file for planning (:func:`load_deploy`).

vLLM-Omni runs a model as several stages, each its own engine, and a deploy
file says where each stage runs and how it is sized. This module reads one
as vLLM-Omni ships it, so that :mod:`kv_budget.plan.deploy` can plan it
without vLLM-Omni installed:

* ``base_config:`` inheritance, resolved relative to the file that names
  it; an inheriting file's top-level keys win, its ``stages`` and
  ``platforms`` merge by stage (``engine_args:`` and ``engine_extras:`` key
  by key, any other stage key replaced whole), as vLLM-Omni merges.
* ``stages`` in the flat or the nested (``engine_args:``, ``runtime:``)
  layout, split as vLLM-Omni's loader splits them: an explicit
  ``engine_extras`` entry wins over a ``StageDeployConfig`` field.
* ``platforms:`` overrides only when a platform is named: vLLM-Omni applies
  the platform it runs on, and a plan made on another machine must say
  which.
* replicas: ``num_replicas`` > 1 with ``devices`` given as the whole pool or
  as a one-replica template.

Each setting keeps where it came from (the key, or why it is unset), so the
plan's inputs can be checked against the file by hand. A stage without
``gpu_memory_utilization`` gets vLLM 0.30's default, 0.92. A stage is
charged vLLM-Omni's 2 GiB graph reserve unless ``enforce_eager`` is true or
``compilation_config.cudagraph_mode`` is ``NONE``. Anything that cannot be
planned raises :class:`DeployError` naming the file, the key and the value.
Nothing here imports vLLM or vLLM-Omni.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from kv_budget.errors import KvBudgetError
from kv_budget.units import GiB

__all__ = [
    "DeployError",
    "settings_a_platform_replaces",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "GRAPH_RESERVE_BYTES",
    "StageDeploy",
    "DeployFile",
    "load_deploy",
]

DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
"""vLLM 0.30's ``CacheConfig`` default, which a stage gets when its deploy
entry sets no ``gpu_memory_utilization`` (vLLM-Omni sets none of its own)."""

GRAPH_RESERVE_BYTES = 2 * GiB
"""vLLM-Omni's admission reserve per stage that captures CUDA graphs."""


class DeployError(KvBudgetError, ValueError):
    """A deploy file, or an option about it, that cannot be planned; the
    message names the file, the key and the value."""


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
        return _where(self.path, self.chain)


def _where(path: Path | str, chain: Sequence[Path | str]) -> str:
    """A deploy file and its ``base_config`` chain, as every message names them."""
    if not chain:
        return f"deploy file {path}"
    return f"deploy file {path} (base_config {' -> '.join(str(p) for p in chain)})"


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
        return _where(self.path, self.base_files)


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


def settings_a_platform_replaces(path: str | Path, platform: str, key: str) -> dict[int, list[str]]:
    """Stage id -> the ``additional_config[key]`` settings of the stage's own
    entry that its ``platforms.<platform>`` entry drops: vLLM-Omni replaces
    a stage's whole ``additional_config`` with the platform's, so settings
    the platform's lacks are gone on that platform. Empty when nothing is
    lost."""
    data, chain = _resolve(Path(path), _Source(Path(path), ()), ())
    where = _Source(Path(path), chain).where()
    section = (data.get("platforms") or {}).get(platform) or {}
    base = {entry["stage_id"]: entry for entry in data["stages"]}
    lost: dict[int, list[str]] = {}
    for index, overlay in enumerate(section.get("stages") or []):
        sid = overlay.get("stage_id")
        if sid not in base:
            continue
        replaced = _split_stage(overlay, f"platforms.{platform}.stages[{index}]", where).get("additional_config")
        if replaced is None:
            continue
        own = _split_stage(base[sid], f"stages[stage_id={sid}]", where).get("additional_config")
        mine = ((own[0] if own else None) or {}).get(key) or {}
        theirs = (replaced[0] or {}).get(key) or {}
        gone = sorted(k for k in mine if k not in theirs)
        if gone:
            lost[sid] = gone
    return lost
