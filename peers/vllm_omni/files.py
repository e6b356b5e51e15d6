"""vLLM-Omni's own files, fetched from its wheel and imported one by one.

kv-budget is checked against the code it meets, never a copy written to look
like it: a hand-written look-alike of vLLM-Omni's ``ModelLocalKVSpec`` is how
a refusal of every per-sequence declaration it makes passed every test.

Why not ``pip install vllm-omni``: the wheel requires a serving stack
(diffusers, cache-dit, onnxruntime, a CUDA flash-attention build, ...) that
neither the tests nor an audit need, and its ``vllm_omni/__init__.py``
patches vLLM on import. So the wheel is downloaded with
``pip download --no-deps``, unpacked into a cache that survives across runs,
and its modules are imported *by file* under their real dotted names. The
packages on the way (``vllm_omni``, ``vllm_omni.model_executor``, ...) are
created empty with their real directory as ``__path__``: their
``__init__.py`` files are not run (except the two small ones that model
files import names from, see ``_PACKAGES_WITH_INIT``), every module file
that is imported runs unchanged, and relative and absolute imports between
vLLM-Omni modules resolve to vLLM-Omni's own files.

Entry points: :func:`omni_root` (the unpacked files, fetched on first use)
and :func:`import_omni_module`. :func:`exec_omni_source` runs a vLLM-Omni
file's source with edits (the drop-in test rewrites one import line).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path

from peers.wheels import WheelUnavailable, unpacked_wheel

__all__ = [
    "OMNI_VERSION",
    "OMNI_PACKAGE",
    "DECLARATION_MODULE",
    "OmniFilesUnavailable",
    "omni_root",
    "import_omni_module",
    "exec_omni_source",
]

OMNI_VERSION = "0.30.0"
"""The vLLM-Omni release kv-budget is checked against (it pairs with vLLM 0.30)."""

OMNI_PACKAGE = "vllm_omni"

DECLARATION_MODULE = "vllm_omni.model_executor.models.model_local_kv"
"""vLLM-Omni's declaration module: ``ModelLocalKVSpec`` and friends."""

ROOT_ENV = "KV_BUDGET_OMNI_DIR"
"""An unpacked vLLM-Omni wheel to use instead of the cache (a directory
holding ``vllm_omni/``): for machines that cannot reach the registry."""

_PACKAGES_WITH_INIT = frozenset({f"{OMNI_PACKAGE}.platforms", f"{OMNI_PACKAGE}.plugins"})
"""Packages whose ``__init__.py`` *is* run: model files import names defined
there (``from vllm_omni.platforms import current_omni_platform``), and both
files only define constants and a lazy platform lookup (no vLLM patching, no
model imports). Every other package stays empty."""


class OmniFilesUnavailable(WheelUnavailable):
    """vLLM-Omni's files could not be had (no registry, no cache). Tests skip
    on it, naming this message; nothing else may quietly continue."""


def omni_root(version: str = OMNI_VERSION) -> Path:
    """The directory that holds ``vllm_omni/`` from the wheel of ``version``.

    ``$KV_BUDGET_OMNI_DIR`` wins when set. Otherwise the wheel is fetched
    once into kv-budget's cache (:func:`peers.wheels.unpacked_wheel`).
    Raises :class:`OmniFilesUnavailable` with pip's own last lines when the
    download fails.
    """
    explicit = os.environ.get(ROOT_ENV)
    if explicit:
        root = Path(explicit)
        if not (root / OMNI_PACKAGE).is_dir():
            raise OmniFilesUnavailable(f"${ROOT_ENV}={explicit} has no {OMNI_PACKAGE}/ directory")
        return root
    try:
        return unpacked_wheel("vllm-omni", version)
    except WheelUnavailable as exc:
        raise OmniFilesUnavailable(str(exc)) from exc


class _OmniFinder(importlib.abc.MetaPathFinder):
    """Finds ``vllm_omni`` modules in one unpacked wheel: directories become
    empty packages (their ``__init__.py`` is not run), files load as they are."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib's signature
        if fullname != OMNI_PACKAGE and not fullname.startswith(OMNI_PACKAGE + "."):
            return None
        location = self.root.joinpath(*fullname.split("."))
        init = location / "__init__.py"
        if fullname in _PACKAGES_WITH_INIT and init.is_file():
            return importlib.util.spec_from_file_location(
                fullname, init, submodule_search_locations=[str(location)]
            )
        if location.is_dir():
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(location)]
            return spec
        source = location.with_suffix(".py")
        if source.is_file():
            return importlib.util.spec_from_file_location(fullname, source)
        return None


def _install_finder(root: Path) -> None:
    for finder in sys.meta_path:
        if isinstance(finder, _OmniFinder):
            if finder.root != root:
                raise OmniFilesUnavailable(
                    f"vLLM-Omni files from {finder.root} are already imported in this process; "
                    f"cannot also import them from {root}"
                )
            return
    loaded = sys.modules.get(OMNI_PACKAGE)
    if loaded is not None and getattr(loaded, "__file__", None):
        raise OmniFilesUnavailable(
            f"an installed vllm_omni ({loaded.__file__}) is already imported; import its modules directly"
        )
    sys.meta_path.insert(0, _OmniFinder(root))


def import_omni_module(name: str, version: str = OMNI_VERSION) -> types.ModuleType:
    """Import vLLM-Omni module ``name`` (e.g. :data:`DECLARATION_MODULE`)
    from the wheel's files, as it is. Its own imports of vLLM, torch and
    transformers are real: a missing one raises ImportError naming it."""
    _install_finder(omni_root(version))
    return importlib.import_module(name)


def exec_omni_source(
    name: str, replacements: dict[str, str], as_name: str, version: str = OMNI_VERSION
) -> types.ModuleType:
    """Run the source of vLLM-Omni module ``name`` with each key of
    ``replacements`` replaced by its value, as a new module ``as_name`` in
    the same package (so its relative imports still reach vLLM-Omni's
    files). Each key must occur in the source: an edit that silently
    matches nothing would test the unedited file."""
    _install_finder(omni_root(version))
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ImportError(f"{name} is not in the vLLM-Omni {version} wheel")
    source = Path(spec.origin).read_text()
    for old, new in replacements.items():
        if old not in source:
            raise ValueError(f"{name}: {old!r} does not occur in its source")
        source = source.replace(old, new)
    package = name.rpartition(".")[0]
    module = types.ModuleType(f"{package}.{as_name}")
    module.__file__ = spec.origin
    module.__package__ = package
    sys.modules[module.__name__] = module
    try:
        exec(compile(source, f"{spec.origin} (edited)", "exec"), module.__dict__)
    except BaseException:
        del sys.modules[module.__name__]
        raise
    return module
