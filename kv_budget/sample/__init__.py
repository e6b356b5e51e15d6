"""The sample step: what the device has free after vLLM's startup
(:mod:`.device`) and what a model's caches really hold (:mod:`.caches`)."""
