"""Reading vLLM: the imported package, or a tree of its files (a published wheel), through one interface."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Member", "VllmSource", "InstalledVllm", "VllmSourceTree"]


@dataclass(frozen=True)
class Member:
    """A method as the patches see it."""

    kind: str
    """``function``, ``staticmethod`` or ``classmethod``: a wrapper must be
    put back as the same kind, or vLLM calls it with the wrong first argument."""
    parameters: tuple[str, ...]
    """Every parameter name in order, ``self``/``cls`` included."""
    body: ast.FunctionDef
    """Its source, for the checks of what it does."""


class VllmSource(Protocol):
    """Where the hook-point checks read vLLM's definitions from."""

    def member(self, module: str, cls: str, name: str) -> Member | None: ...

    def has_field(self, module: str, cls: str, name: str) -> bool: ...


def _kind_from_decorators(node: ast.FunctionDef) -> str:
    names = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
    if "staticmethod" in names:
        return "staticmethod"
    if "classmethod" in names:
        return "classmethod"
    return "function"


def _parameter_names(arguments: ast.arguments) -> tuple[str, ...]:
    """In ``inspect.signature`` order: positional-only, positional, *args,
    keyword-only, **kwargs."""
    names = [a.arg for a in arguments.posonlyargs + arguments.args]
    if arguments.vararg:
        names.append(arguments.vararg.arg)
    names += [a.arg for a in arguments.kwonlyargs]
    if arguments.kwarg:
        names.append(arguments.kwarg.arg)
    return tuple(names)


class InstalledVllm:
    """The vLLM this process imports. Reads past kv-budget's own wrappers
    (``__wrapped__``), so the check means the same before and after
    :func:`vllm_patches.plugin.register` has run."""

    def _class(self, module: str, cls: str) -> Any:
        try:
            return getattr(importlib.import_module(module), cls, None)
        except ImportError:
            return None

    def member(self, module: str, cls: str, name: str) -> Member | None:
        owner = self._class(module, cls)
        if owner is None:
            return None
        try:
            raw = inspect.getattr_static(owner, name)
        except AttributeError:
            return None
        if isinstance(raw, staticmethod):
            kind, function = "staticmethod", raw.__func__
        elif isinstance(raw, classmethod):
            kind, function = "classmethod", raw.__func__
        elif inspect.isfunction(raw):
            kind, function = "function", raw
        else:
            return None
        function = inspect.unwrap(function)
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
        except (OSError, TypeError, SyntaxError):
            return None
        if not isinstance(body, ast.FunctionDef):
            return None
        parameters = tuple(inspect.signature(function, follow_wrapped=False).parameters)
        return Member(kind=kind, parameters=parameters, body=body)

    def has_field(self, module: str, cls: str, name: str) -> bool:
        owner = self._class(module, cls)
        if owner is None:
            return False
        # dataclasses (vLLM's configs) and msgspec Structs (its engine messages)
        return name in getattr(owner, "__dataclass_fields__", {}) or name in getattr(owner, "__struct_fields__", ())


class VllmSourceTree:
    """vLLM's Python files under ``root`` (the directory that holds the
    ``vllm`` package), read without importing them: a published wheel of a
    version that cannot run here."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._classes: dict[tuple[str, str], ast.ClassDef | None] = {}

    def _class(self, module: str, cls: str) -> ast.ClassDef | None:
        key = (module, cls)
        if key not in self._classes:
            path = self.root.joinpath(*module.split(".")).with_suffix(".py")
            if not path.is_file():  # a package: its classes are in __init__.py
                path = self.root.joinpath(*module.split("."), "__init__.py")
            found = None
            if path.is_file():
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
                found = next(
                    (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None
                )
            self._classes[key] = found
        return self._classes[key]

    def member(self, module: str, cls: str, name: str) -> Member | None:
        owner = self._class(module, cls)
        if owner is None:
            return None
        for node in owner.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return Member(_kind_from_decorators(node), _parameter_names(node.args), node)
        return None

    def has_field(self, module: str, cls: str, name: str) -> bool:
        owner = self._class(module, cls)
        return owner is not None and any(
            isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name
            for node in owner.body
        )
