"""Which stage of a vLLM-Omni deployment an engine is.

A vLLM-Omni deployment runs one engine per stage and replica, often several
of one model on one device. Everything an engine writes or logs must say
which one it is, or two stages of one model overwrite each other's status
file and report, and the ledger and the log cannot tell them apart. A plain
vLLM engine has no stage (``None`` wherever a :class:`Stage` is taken).

Entry point: :class:`Stage`; the glue reads it from the stage's config
(``vllm_patches.engine.stage_of``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

__all__ = ["Stage", "stage_file_name"]


class Stage(BaseModel):
    """A vLLM-Omni stage id and replica, as vLLM-Omni numbers them (its
    ``/metrics`` labels ``stage`` and ``replica`` carry the same numbers)."""

    model_config = ConfigDict(frozen=True)

    stage_id: int
    replica: int

    def label(self) -> str:
        """For log lines and the ledger: ``stage 1 replica 0``."""
        return f"stage {self.stage_id} replica {self.replica}"

    def tag(self) -> str:
        """For file names: ``stage1-replica0``."""
        return f"stage{self.stage_id}-replica{self.replica}"


def stage_file_name(path: str | Path, stage: Stage | None) -> Path:
    """``path`` with the stage's tag before its suffix (``plan.json`` ->
    ``plan.stage1-replica0.json``); ``path`` unchanged outside vLLM-Omni.
    Always, not only when stages collide: one path given to the whole
    deployment reaches every stage and replica, and a stage cannot see
    the others' paths."""
    path = Path(path)
    if stage is None:
        return path
    return path.with_name(f"{path.stem}.{stage.tag()}{path.suffix}")
