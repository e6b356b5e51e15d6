"""The collect step: the declarations a plan is made from, as a
:class:`~kv_budget.collect.model.Collection` of declarations with their
owners and named failures.

:mod:`.model` asks a loaded model (what the engine does at startup);
:mod:`.specfile` reads them from a JSON file and :mod:`.presets` holds the
published ones of served models (what ``kv-budget plan`` does before a
deployment starts).
"""
