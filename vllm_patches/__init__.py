"""The only place kv-budget touches vLLM: the general-plugin entry point.

``register`` is named in ``vllm.general_plugins``; vLLM calls it in every
process, several times.
"""


def register() -> None:
    """Plugin entry point. The engine hook arrives with the vLLM integration."""
