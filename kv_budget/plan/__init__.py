"""The plan step: one engine's plan from its workers' budgets
(:mod:`.planner`), the same bytes taken out of the paged pool instead
(:mod:`.reserve`), and every stage of a vLLM-Omni deploy file on its
devices (:mod:`.deploy_file` reads the file, :mod:`.deploy` plans it)."""
