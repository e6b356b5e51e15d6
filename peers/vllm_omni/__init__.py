"""vLLM-Omni's own code, for checking kv-budget against it.

``files`` fetches vLLM-Omni's wheel and imports its modules by file;
``targets`` builds its real models on the CPU and drives their decode paths,
as ``kv-budget audit`` targets. Nothing here is imported by the planner or
the plugin.
"""
