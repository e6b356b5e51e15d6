"""``vllm serve MODEL --omni`` for the tests: vLLM-Omni's own CLI, with the test pipelines registered first.

Test support, not vLLM-Omni code. It runs vLLM-Omni 0.30.0's CLI entry
(``vllm_omni.entrypoints.cli.main.main``, what ``vllm-omni serve`` and
``vllm serve --omni`` run) unchanged. One thing comes first, at module
level: ``kv_budget_omni_cpu.register()``, the demo architecture and the
demo text pipelines in vLLM-Omni's registries. Why: with
``--api-server-count`` > 1 vLLM-Omni spawns its API-server processes, which
import this module again (as ``__mp_main__``) and resolve the deploy file's
``pipeline:`` before they load any plugin; a pipeline shipped with
vLLM-Omni is in its table already, a test pipeline is not. kv-budget is not
loaded here: it loads as users get it, through vLLM's general plugins.

Usage: ``python tests/omni_serve_run.py serve MODEL --omni --deploy-config FILE ...``
"""

from __future__ import annotations

import kv_budget_omni_cpu

kv_budget_omni_cpu.register()

if __name__ == "__main__":  # spawned API servers import this module without running the CLI
    from vllm_omni.entrypoints.cli.main import main

    main()
