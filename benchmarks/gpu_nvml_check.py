"""GPU check without vLLM: NVML sampling and declared == measured on CUDA.

Runs on a CUDA machine (called by ``benchmarks/gpu_check.sh``). The CPU test
suite can only test the NVML path against a fake of the NVML calls; this
checks the real one:

1. ``NvmlSampler`` reads the device torch calls ``cuda:0``, by index and,
   with ``CUDA_VISIBLE_DEVICES`` set to the device's UUID, by UUID.
2. A real ``StaticCache`` with the ming talker geometry (24 layers, 2 kv
   heads, head_dim 64, bf16, 2048 positions), filled by a forward pass of a
   tiny Qwen2 on the GPU: the declaration, the audit's storage count, and
   the CUDA allocator's growth must agree (25,165,824 B), and NVML's free
   memory must drop by at least that much.
3. The collector asks declarers from a helper thread (its time limit): a
   declarer there sees the caller's CUDA device, the last one visible, not
   device 0.

Prints each figure with its source and writes JSON to ``$OUT`` (or the
directory given). Exit 1 on any mismatch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    import pynvml
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, StaticCache

    from kv_budget.declare.hf_config import spec_from_hf_config
    from kv_budget.sample.caches import measure_cache_bytes
    from kv_budget.sample.device import NvmlSampler

    out = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "gpu-check-out"))
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("[gpu-nvml] no CUDA device visible to torch", file=sys.stderr)
        return 1
    results: dict = {"device": torch.cuda.get_device_name(0)}
    checks: list[tuple[str, bool]] = []

    by_index = NvmlSampler(0).sample()
    print(f"[gpu-nvml] {by_index.source}: total {by_index.total_bytes:,} B, free {by_index.free_bytes:,} B, "
          f"this process {by_index.process_bytes}")
    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()))
    pynvml.nvmlShutdown()
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = uuid  # NVML mapping only; torch already initialised
    try:
        by_uuid = NvmlSampler(0).sample()
    finally:
        if previous is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous
    print(f"[gpu-nvml] {by_uuid.source}: total {by_uuid.total_bytes:,} B")
    checks.append(("UUID maps to the same device as the index", by_uuid.total_bytes == by_index.total_bytes))

    config = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24,
                         intermediate_size=128, vocab_size=128)
    spec = spec_from_hf_config(
        config, name="talker_static_kv", dtype=torch.bfloat16, physical_capacity_positions=2048,
        capacity_source="hard-coded static cache length", scope="invocation", rows="fixed", rows_fixed=1,
        rows_reason="talker calls are serialized",
    )
    model = Qwen2ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    free_before = NvmlSampler(0).sample().free_bytes
    cache = StaticCache(config=config, max_cache_len=2048)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]], device="cuda"), past_key_values=cache, use_cache=True)
    del model  # weights stay allocated until gc; cache bytes are measured directly
    torch.cuda.synchronize()
    measured = measure_cache_bytes(cache)
    grown = torch.cuda.memory_allocated() - allocated_before
    free_drop = free_before - NvmlSampler(0).sample().free_bytes
    results.update(declared_bytes=spec.bytes_per_row, measured_bytes=measured,
                   allocator_growth_bytes=grown, nvml_free_drop_bytes=free_drop,
                   nvml_total_bytes=by_index.total_bytes, nvml_free_bytes=by_index.free_bytes)
    print(f"[gpu-nvml] declared {spec.bytes_per_row:,} B; audit storage count {measured:,} B; "
          f"torch allocator grew {grown:,} B (cache + activations); NVML free dropped {free_drop:,} B")
    checks.append(("declared == measured (ming talker StaticCache on CUDA)", spec.bytes_per_row == measured == 25_165_824))
    checks.append(("allocator grew by at least the cache", grown >= measured))
    checks.append(("NVML free dropped by at least the cache", free_drop >= measured))
    from kv_budget.collect.model import collect_model_local_kv_specs

    class DeviceDeclarer(torch.nn.Module):
        seen: list[int] = []

        def model_local_kv_specs(self):
            self.seen.append(torch.cuda.current_device())
            return [spec]

    caller_device = torch.cuda.device_count() - 1
    torch.cuda.set_device(caller_device)
    collection = collect_model_local_kv_specs(DeviceDeclarer())
    results.update(collector_caller_device=caller_device, collector_declarer_device=DeviceDeclarer.seen)
    print(f"[gpu-nvml] collector thread: caller on cuda:{caller_device}, declarer saw {DeviceDeclarer.seen}")
    checks.append(("a declarer in the collector's thread sees the caller's CUDA device",
                   DeviceDeclarer.seen == [caller_device] and len(collection.specs) == 1))
    results["checks"] = {name: ok for name, ok in checks}
    (out / "gpu_nvml_check.json").write_text(json.dumps(results, indent=2))
    for name, ok in checks:
        print(f"[gpu-nvml] {'PASS' if ok else 'FAIL'}: {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
