"""Policy ``reserve``: model-local KV carved out of the paged pool.

``cap`` protects the device by lowering concurrency. ``reserve`` keeps
``max_num_seqs`` and pays with pool blocks instead: at the point where vLLM
turns its memory figure into the paged pool (``determine_available_memory``,
one figure per worker: the profiled free memory inside
``gpu_memory_utilization``, or ``kv_cache_memory_bytes`` when set), every
worker's model-local KV at the configured ``max_num_seqs`` comes off that
figure. Model-local KV then lives inside the memory vLLM was asked to use,
so no headroom outside it is needed.

On one worker::

    reserved_bytes  = uncharged_fixed + per_sequence x max_num_seqs
    pool_after      = pool_before - reserved_bytes

Charged declarations (scope ``model``) exist before the profile, which
already paid for them, so they are not reserved a second time (as in
:mod:`kv_budget.plan.planner`).

vLLM gives every rank the smallest rank's block count, so the worker with
the smallest pool after the reservation binds. A pool left too small for
one ``max_model_len`` sequence is refused (:attr:`ReservePlan.feasible`),
naming both figures; nothing falls back to another policy.

Blocks: ``num_blocks = pool_bytes // block_bytes``, where ``block_bytes`` is
one block across every KV layer of the worker (the layers' page sizes
summed), vLLM's own division for uniform attention models. What the
reservation costs is therefore exactly
``pool_before // block_bytes - pool_after // block_bytes`` whole blocks.
"""

from __future__ import annotations

from pydantic import BaseModel

from kv_budget.plan.planner import Headroom, Plan, WorkerBudget, make_plan, safe_max_num_seqs
from kv_budget.settings import Policy
from kv_budget.units import per_each

__all__ = ["PoolReservation", "ReservePlan", "POOL_SOURCE", "reserve_out_of_pool", "plan_reserve", "watch_plan"]


class PoolReservation(BaseModel):
    """One worker's pool before and after the reservation."""

    rank: int
    reserved_bytes: int
    """uncharged fixed + per sequence x max_num_seqs on this worker."""
    pool_bytes_before: int
    """vLLM's figure for the pool (``determine_available_memory``)."""
    pool_bytes_after: int
    """What is handed back to vLLM to size the pool from. Negative when the
    reservation exceeds the pool (then the plan is infeasible)."""
    block_bytes: int
    """One block across every KV layer of this worker (sum of page sizes)."""
    sequence_bytes: int
    """Pool bytes one ``max_model_len`` sequence needs on this worker (vLLM's
    ``max_memory_usage_bytes`` summed over its KV layers)."""

    @property
    def needed_bytes(self) -> int:
        """One ``max_model_len`` sequence plus the null block vLLM's block
        pool always holds back: less than this and no request can run."""
        return self.sequence_bytes + self.block_bytes

    @property
    def num_blocks_before(self) -> int:
        return self.pool_bytes_before // self.block_bytes

    @property
    def num_blocks_after(self) -> int:
        return max(self.pool_bytes_after, 0) // self.block_bytes


POOL_SOURCE = "vLLM's determine_available_memory"
"""Where an engine's pool figure comes from: the executor's answer (the glue adds how vLLM sized it where
it did not profile: a pinned pool)."""


def reserve_out_of_pool(
    worker: WorkerBudget, max_num_seqs: int, pool_bytes: int, block_bytes: int, sequence_bytes: int,
) -> PoolReservation:
    """The reservation for one worker: its uncharged model-local KV at the
    configured ``max_num_seqs``, taken off ``pool_bytes``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
    if block_bytes < 1 or sequence_bytes < 1:
        raise ValueError(
            f"block_bytes={block_bytes}, sequence_bytes={sequence_bytes}: reserve needs a model with a paged "
            "KV cache (an attention-free model has no pool to reserve from)"
        )
    reserved = worker.uncharged_fixed_bytes + worker.per_seq_bytes * max_num_seqs
    return PoolReservation(
        rank=worker.rank,
        reserved_bytes=reserved,
        pool_bytes_before=pool_bytes,
        pool_bytes_after=pool_bytes - reserved,
        block_bytes=block_bytes,
        sequence_bytes=sequence_bytes,
    )


class ReservePlan(BaseModel):
    """The engine's reservation: every worker's, and the binding one's figures."""

    max_num_seqs: int
    """Configured, and kept."""
    max_model_len: int
    pool_source: str
    """Where ``kv_pool_bytes_before`` came from, for the log."""
    reservations: list[PoolReservation]
    binding_rank: int
    """The worker with the fewest blocks left: vLLM gives every rank its count."""
    reserved_bytes: int
    kv_pool_bytes_before: int
    kv_pool_bytes_after: int
    num_blocks_before: int
    num_blocks_after: int
    blocks_per_sequence: int
    """Blocks one ``max_model_len`` sequence takes: ceil(sequence_bytes / block_bytes)."""
    max_concurrency_at_max_model_len: float
    """How many ``max_model_len`` sequences the reduced pool holds at once:
    blocks after / blocks per sequence, vLLM's own formula (its startup log
    prints it as "Maximum concurrency for N tokens per request")."""
    feasible: bool
    """False when some worker's pool left cannot hold one ``max_model_len``
    sequence (and the null block)."""

    @property
    def binding(self) -> PoolReservation:
        return next(r for r in self.reservations if r.rank == self.binding_rank)


def plan_reserve(
    reservations: list[PoolReservation], max_num_seqs: int, max_model_len: int,
    pool_source: str = POOL_SOURCE,
) -> ReservePlan:
    """Combine the workers' reservations: the one with the fewest blocks left binds."""
    if not reservations:
        raise ValueError("plan_reserve needs at least one worker's reservation")
    binding = min(reservations, key=lambda r: (r.num_blocks_after, r.pool_bytes_after, r.rank))
    blocks_per_sequence = per_each(binding.sequence_bytes, binding.block_bytes)
    return ReservePlan(
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        pool_source=pool_source,
        reservations=reservations,
        binding_rank=binding.rank,
        reserved_bytes=binding.reserved_bytes,
        kv_pool_bytes_before=binding.pool_bytes_before,
        kv_pool_bytes_after=binding.pool_bytes_after,
        num_blocks_before=min(r.num_blocks_before for r in reservations),
        num_blocks_after=binding.num_blocks_after,
        blocks_per_sequence=blocks_per_sequence,
        max_concurrency_at_max_model_len=binding.num_blocks_after / blocks_per_sequence,
        feasible=all(r.pool_bytes_after >= r.needed_bytes for r in reservations),
    )


def watch_plan(plan: ReservePlan, workers: list[WorkerBudget]) -> Plan:
    """What live monitoring (:mod:`kv_budget.watch.live`) checks a
    ``reserve`` engine against: each worker's reservation in place of a
    headroom, so a measurement that shows the reservation short lowers the
    live limit to what fits the reserved bytes. At the configured
    ``max_num_seqs`` the declarations fit it by construction (the plan
    says ``ok``); the pool stays as allocated."""
    reserved = {r.rank: r.reserved_bytes for r in plan.reservations}
    watched = []
    for worker in workers:
        room = reserved[worker.rank]
        source = (f"reserved out of the paged pool: uncharged fixed {worker.uncharged_fixed_bytes:,} B + per-sequence "
                  f"{worker.per_seq_bytes:,} B x max_num_seqs {plan.max_num_seqs}")
        watched.append(worker.model_copy(update={
            "headroom": Headroom(bytes=room, source=source),
            "safe_max_num_seqs": safe_max_num_seqs(room, worker.uncharged_fixed_bytes, worker.per_seq_bytes),
        }))
    return make_plan(watched, plan.max_num_seqs, Policy.WARN).model_copy(update={"policy": Policy.RESERVE})
