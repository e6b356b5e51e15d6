"""Which vLLM this plugin can patch, checked before any patch is applied.

Every patch kv-budget makes relies on a hook point of vLLM: a method it
wraps, with the signature the wrapper calls, a field it writes, and an order
of events (the Scheduler is built from ``scheduler_config`` after
``_initialize_kv_caches`` returns, and copies ``max_num_seqs`` when built).
If an upgrade breaks one of these, installing kv-budget must not leave a
server silently unprotected: startup fails, naming the version found, what
is missing, and the versions kv-budget supports.

Checking only that names exist is not enough: a hook point can keep its
name and change its meaning. So each :data:`HOOK_POINTS` entry checks what
the patch assumes, through a :class:`VllmSource` that reads either the
imported vLLM (:class:`InstalledVllm`, at startup) or a tree of vLLM's
Python files (:class:`VllmSourceTree`: a published wheel, for a version with
no CPU build to run). Both read the same definitions, so a test can hold
them to the same answer on an installed vLLM.

Where versions differ, the difference is a :class:`VllmFeatures` field read
from the same source, and the patches branch on that field, never on a
version string.

The jobs, one module each: :mod:`.support` (the support table),
:mod:`.source` (reading vLLM: installed or a tree of files),
:mod:`.hook_points` (what each patch assumes, and the features),
:mod:`.check` (the installed vLLM, checked once), :mod:`.model_runner_v2`
(where a V2 worker keeps its model), :mod:`.runtime` (what is checked while
an engine starts). The names the patches and tests use are re-exported here.
"""

from vllm_patches.compat.support import HOW_CHECKED, SUPPORTED_VLLM, SupportedVllm, UnsupportedVllmError, support_of
from vllm_patches.compat.source import InstalledVllm, VllmSource, VllmSourceTree
from vllm_patches.compat.hook_points import HOOK_POINTS, VllmFeatures, detect_features, hook_point_problems
from vllm_patches.compat.check import CheckedVllm, check_vllm, checked_vllm, vllm_distribution, vllm_version
from vllm_patches.compat.model_runner_v2 import model_runner_v2_problem, model_runner_v2_problems, runs_model_runner_v2
from vllm_patches.compat.runtime import require_no_scheduler_yet, scheduler_cap_problem, scheduler_class_problem

__all__ = [
    "HOOK_POINTS", "HOW_CHECKED", "SUPPORTED_VLLM", "CheckedVllm", "InstalledVllm", "SupportedVllm",
    "UnsupportedVllmError", "VllmFeatures", "VllmSource", "VllmSourceTree", "check_vllm", "checked_vllm",
    "detect_features", "hook_point_problems", "model_runner_v2_problem", "model_runner_v2_problems",
    "require_no_scheduler_yet", "runs_model_runner_v2", "scheduler_cap_problem", "scheduler_class_problem",
    "support_of", "vllm_distribution", "vllm_version",
]
