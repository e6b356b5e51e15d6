"""Other projects' code, read by kv-budget's tests and audits; not part of
the installed product. Run from a checkout's root, where ``kv-budget
audit peers.vllm_omni.<model>:<factory>`` imports these modules."""
