"""The declare step: what a model says it keeps.

:mod:`.spec` is the declaration (vLLM-Omni's names and rules) and
:mod:`.hf_config` declares from a Hugging Face config.
"""
