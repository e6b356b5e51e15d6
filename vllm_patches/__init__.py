"""The vLLM and vLLM-Omni glue: the only code that imports either.

In layers, each importing only those before it (``tests/test_layout.py``):
``patching`` and ``compat``; ``engine`` (what an engine knows about
itself); ``workers``, ``cache_updates``, ``flags``, ``omni_chunks``; the
hooks (``frontend``, ``pool_hook``, ``live_hook``, ``startup_hook``); the
vLLM-Omni driver (``omni_deployment``, ``omni``); ``plugin`` last, whose
``register`` is the ``kv_budget`` entry point of ``vllm.general_plugins``.
This package itself imports nothing, so the layers below ``plugin`` load
without vLLM where they import none of it.
"""
