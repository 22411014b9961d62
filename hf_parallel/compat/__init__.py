"""The one place hf_parallel touches its dependencies' internals, each use checked when first needed.

A dependency's private names move between releases; a use that fails quietly trains wrong. So every
internal hf_parallel relies on is declared here as a ``Seam`` (one module per dependency: ``transformers``,
``peft``, ``accelerate``, ``torch``, ``trl``, ``triton``) and resolved through ``Seam.get()``: the name must
exist, take the parameters we pass, and (for a flag we set for the dependency to read) be read by the code
that is meant to read it. Anything else raises ``DependencyChanged`` naming the dependency, its installed
version and the one tested, before anything is computed. ``check_all()`` runs every check (the pure
test tier does, in well under a second), and ``when_imported`` installs a seam only once its
dependency is imported: an inference load imports no Trainer and no peft.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

# the minors tested, which pyproject.toml pins
TESTED = {"transformers": "5.23", "peft": "0.21", "accelerate": "1.15", "torch": "2.13", "trl": "1.16", "triton": "3.9"}


class DependencyChanged(RuntimeError):
    """A dependency no longer has an internal hf_parallel relies on (or it changed shape)."""


def installed_version(dependency: str) -> str:
    try:
        return version(dependency)
    except PackageNotFoundError:
        return "not installed"


def _code_names(code: types.CodeType) -> set[str]:
    """Every global and attribute name ``code`` (and the functions nested in it) refers to, and its
    string constants (``getattr(model, "flag", False)`` reads a flag by a string)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
        elif isinstance(const, str):
            names.add(const)
    return names


def _names_read(found) -> set[str]:
    """The names a function, a property or (every method of) a class reads."""
    if isinstance(found, type):
        return set().union(*(_names_read(member) for member in vars(found).values()
                             if isinstance(member, (property, types.FunctionType))))  # fmt: skip
    if isinstance(found, property):
        return set().union(*(_names_read(f) for f in (found.fget, found.fset) if f is not None))
    code = getattr(inspect.unwrap(found), "__code__", None)
    return _code_names(code) if code is not None else set()


@dataclass(frozen=True)
class Seam:
    """One internal of a dependency: ``where`` is ``"module:attr.attr"``. ``parameters``: names its
    signature must have (the ones we pass); ``reads``: names its code must use (a flag or attribute we
    set for it to read: if it stops reading it, setting it would do nothing, silently)."""

    dependency: str
    where: str
    why: str
    parameters: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()

    def fail(self, what: str) -> DependencyChanged:
        return DependencyChanged(
            f"{self.dependency} {installed_version(self.dependency)}: {self.where} {what} (hf_parallel uses it "
            f"{self.why}; hf_parallel is tested with {self.dependency} {TESTED[self.dependency]}.*: install that)"
        )

    def get(self):
        """The object, checked (once per process)."""
        found = _RESOLVED.get(self)
        if found is None:
            found = _RESOLVED[self] = self._resolve()
        return found

    def _resolve(self):
        module_name, _, attrs = self.where.partition(":")
        try:
            found = importlib.import_module(module_name)
        except ImportError as error:
            raise self.fail(f"cannot be imported ({error})") from None
        for attr in attrs.split(".") if attrs else ():
            if not hasattr(found, attr):
                raise self.fail(f"is gone (no {attr!r})")
            found = getattr(found, attr)
        if self.parameters:
            try:
                names = set(inspect.signature(found).parameters)
            except (TypeError, ValueError):
                names = set()
            missing = [name for name in self.parameters if name not in names]
            if missing:
                raise self.fail(f"no longer takes {', '.join(missing)}")
        if self.reads:
            names = _names_read(found)
            missing = [name for name in self.reads if name not in names]
            if missing:
                raise self.fail(f"no longer reads {', '.join(missing)}")
        return found


_RESOLVED: dict[Seam, object] = {}


def seams() -> list[Seam]:
    """Every declared seam, of every dependency."""
    from . import accelerate, peft, torch, transformers, transformers_serving, triton, trl

    found = []  # a module's seams, and those it keeps in tables (one per replaced step, trainer, ...)
    modules = (transformers, transformers_serving, peft, accelerate, torch, trl, triton)
    for value in (value for module in modules for value in vars(module).values()):
        found += [seam for seam in (value.values() if isinstance(value, dict) else [value]) if isinstance(seam, Seam)]
    return list(dict.fromkeys(found))


def check_all(dependencies=None) -> list[Seam]:
    """Resolve every seam (of ``dependencies``, default all installed): raises on the first that
    fails; returns those checked."""
    checked = []
    for seam in seams():
        if dependencies is not None and seam.dependency not in dependencies:
            continue
        if dependencies is None and installed_version(seam.dependency) == "not installed":
            continue
        seam.get()
        checked.append(seam)
    return checked


class _AfterImport:
    """A meta path finder that runs callbacks once a watched module has been executed (the seams of
    a dependency go in when a program first imports it, whatever the order of its imports). Finding
    a spec changes nothing (``importlib.util.find_spec`` only asks whether a library is installed):
    the callbacks leave the waiting list when the module has been executed and every one has run, and
    go back on it if one fails, so the next import fails the same way."""

    def __init__(self):
        self.waiting: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRun(spec.loader, fullname, self.waiting)
        return spec


class _ThenRun:
    """A module's own loader, and after it has executed the module, the callbacks waiting for it."""

    def __init__(self, loader, name: str, waiting: dict):
        self.loader, self.name, self.waiting = loader, name, waiting

    def __getattr__(self, attr):  # every other method of the module's own loader
        return getattr(self.loader, attr)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        callbacks = self.waiting.pop(self.name, [])
        try:
            for callback in callbacks:
                callback()
        except BaseException:
            self.waiting[self.name] = callbacks
            raise


_AFTER_IMPORT = _AfterImport()


def when_imported(module: str, callback: Callable[[], None]) -> None:
    """``callback()`` now if ``module`` is imported, else right after a program first imports it."""
    if module in sys.modules:
        callback()
        return
    _AFTER_IMPORT.waiting.setdefault(module, []).append(callback)
    if _AFTER_IMPORT not in sys.meta_path:
        sys.meta_path.insert(0, _AFTER_IMPORT)
