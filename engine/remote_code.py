"""Remote code a trusted model runs, checked in the form transformers imports it.

transformers never imports a local model's code from its folder: ``get_cached_module_file``
copies each file into its modules cache (``HF_MODULES_CACHE/transformers_modules/<folder
name>/<hash of the sources>/``) and ``get_class_in_module`` imports the copy. It copies again
only when a shallow comparison (size and mtime) says the files differ, so a copy edited in
place, same size and mtime, would be imported while every file of the install passes its pin.

Invariant: for a model folder ``guard`` was given, nothing is imported from the modules cache
unless the module file and every file it imports relatively (transformers' own rule) have the
sha256 the manifest pins for that name; otherwise ``RemoteCodeMismatch`` is raised before the
import. The check wraps transformers' ``get_class_in_module``, where every remote class of a
config, tokenizer or processor is imported (``get_class_from_dynamic_module``). Other folders'
code passes through untouched.

What is imported is exactly the bytes that were hashed: the module and its relative imports are
compiled from them (``_PinnedLoader``), never from a ``__pycache__/*.pyc`` (Python's own loader
would run a planted one, an unchecked-hash .pyc without even looking at the source) and never
from the file read a second time. The packages above them (transformers writes their
``__init__.py`` empty) are created without running anything.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from cachecd.errors import RemoteCodeMismatch

_lock = threading.Lock()
_guarded: dict[str, list[tuple[Path, dict[str, str]]]] = {}  # module dir name -> (dir, pins)
_verified: dict[str, tuple[str, bytes]] = {}  # module name -> (its file, the bytes that passed)


def guard(model_dir: Path, pins: Mapping[str, str]) -> None:
    """From now on in this process, code of ``model_dir`` imports only as ``pins`` pin it."""
    import transformers.dynamic_module_utils as dmu

    name = module_dir_name(model_dir)
    entry = (Path(model_dir).resolve(), dict(pins))
    with _lock:
        entries = _guarded.setdefault(name, [])
        if entry not in entries:
            entries.append(entry)
        if not getattr(dmu.get_class_in_module, "cachecd_checked", False):
            dmu.get_class_in_module = _checked(dmu.get_class_in_module)


def module_dir_name(model_dir: Path) -> str:
    """The folder transformers copies a local model's code into (under transformers_modules)."""
    import transformers.dynamic_module_utils as dmu

    base = os.path.basename(os.path.normpath(str(model_dir)))
    sanitize = getattr(dmu, "_sanitize_module_name", lambda n: n)
    return str(sanitize(base))


def _checked(original: Any) -> Any:
    def get_class_in_module(class_name: str, module_path: Any, *args: Any, **kwargs: Any) -> Any:
        import transformers.dynamic_module_utils as dmu

        cache = Path(dmu.HF_MODULES_CACHE)
        sources = check_import(cache, Path(module_path))
        if sources is None:  # not a guarded model's code
            return original(class_name, module_path, *args, **kwargs)
        module = import_verified(cache, Path(module_path), sources,
                                 bool(kwargs.get("force_reload")))
        return getattr(module, class_name)

    get_class_in_module.cachecd_checked = True  # type: ignore[attr-defined]
    get_class_in_module.__wrapped__ = original  # type: ignore[attr-defined]
    return get_class_in_module


def check_import(cache: Path, module_path: Path) -> dict[Path, bytes] | None:
    """Raise unless the module transformers is about to import from ``cache`` (and its relative
    imports) is pinned, byte for byte, by a guarded model of that folder name; the bytes that
    passed, by file (None: no guarded model has that folder name)."""
    parts = module_path.parts
    with _lock:
        guards = list(_guarded.get(parts[1], ())) if len(parts) >= 3 else []
    if not guards:
        return None
    from transformers.dynamic_module_utils import get_relative_import_files

    module = cache / module_path
    files = [module, *(Path(f) for f in get_relative_import_files(str(module)))]
    sources = {f: f.read_bytes() for f in files}  # read once: what is hashed is what is run
    problems = [_first_problem(_root(cache, parts, pins), sources, pins) for _, pins in guards]
    if not all(problems):
        return sources
    raise RemoteCodeMismatch(
        f"{problems[0]}; transformers would import that copy, so nothing of it ran. Delete "
        f"{cache.joinpath(*parts[:2])} (transformers copies the installed files again), and "
        f"if the install's own file changed too, run `cachecd setup --stream` again")


def _root(cache: Path, parts: tuple[str, ...], pins: Mapping[str, str]) -> Path:
    """The folder the module's repo-relative name starts in: transformers puts a local model's
    code in ``transformers_modules/<folder name>/<hash>/`` (the hash level is matched, not
    assumed, so another layout is checked too)."""
    for k in range(2, len(parts)):
        if "/".join(parts[k:]) in pins:
            return cache.joinpath(*parts[:k])
    return cache.joinpath(*parts[:min(3, len(parts) - 1)])


def _first_problem(root: Path, sources: Mapping[Path, bytes],
                   pins: Mapping[str, str]) -> str | None:
    for f, data in sources.items():
        name = f.relative_to(root).as_posix() if f.is_relative_to(root) else str(f)
        digest = hashlib.sha256(data).hexdigest()
        if pins.get(name) != digest:
            return (f"{f} (the modules-cache copy of {name}) has sha256 {digest}, not the "
                    f"{pins.get(name, 'no')} sha256 the manifest pins")
    return None


# -- the import itself, from the verified bytes -------------------------------------------------
class _PinnedLoader(importlib.machinery.SourceFileLoader):
    """Compiles the bytes that passed the pins; never reads or writes bytecode."""

    def __init__(self, fullname: str, path: str, source: bytes) -> None:
        super().__init__(fullname, path)
        self._source = source

    def get_code(self, fullname: str) -> CodeType:
        return self.source_to_code(self._source, self.path)

    def get_data(self, path: str) -> bytes:  # what tracebacks and inspect show
        return self._source if path == self.path else super().get_data(path)


class _PinnedFinder(importlib.abc.MetaPathFinder):
    """A guarded module's relative imports: found here, before the path finder (whose loader
    would take a .pyc), from the bytes ``check_import`` verified with the module."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        with _lock:
            found = _verified.get(fullname)
        return None if found is None else _spec(fullname, *found)


_finder = _PinnedFinder()


def _spec(name: str, file: str, source: bytes) -> importlib.machinery.ModuleSpec:
    spec = importlib.util.spec_from_file_location(name, file,
                                                  loader=_PinnedLoader(name, file, source))
    assert spec is not None
    return spec


def _module_name(module_path: Path) -> str:
    """transformers' name for a module of its modules cache (``get_class_in_module``'s rule)."""
    return os.path.normpath(module_path).removesuffix(".py").replace(os.path.sep, ".")


def import_verified(cache: Path, module_path: Path, sources: Mapping[Path, bytes],
                    force_reload: bool = False) -> ModuleType:
    """The module at ``module_path`` (relative to ``cache``), run from ``sources``: the bytes of
    it and of its relative imports that passed the pins. Imported again when they changed."""
    names = {_module_name(f.relative_to(cache)): (str(f), data) for f, data in sources.items()}
    name = _module_name(module_path)
    digest = hashlib.sha256(b"".join(n.encode() + d for n, (_, d) in sorted(names.items())))
    with _lock:
        _verified.update(names)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        module = sys.modules.get(name)
        if (module is not None and not force_reload
                and getattr(module, "__cachecd_pinned__", None) == digest.hexdigest()):
            return module
        _ensure_packages(cache, name)
        spec = _spec(name, *names[name])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
    try:
        assert spec.loader is not None
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    module.__cachecd_pinned__ = digest.hexdigest()  # type: ignore[attr-defined]
    return module


def _ensure_packages(cache: Path, name: str) -> None:
    """The packages above ``name`` in ``sys.modules``, made without running their
    ``__init__.py`` (transformers writes them empty; a .pyc beside one would run otherwise)."""
    parts = name.split(".")[:-1]
    for i in range(1, len(parts) + 1):
        package = ".".join(parts[:i])
        if package not in sys.modules:
            spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
            spec.submodule_search_locations = [str(cache.joinpath(*parts[:i]))]
            sys.modules[package] = importlib.util.module_from_spec(spec)
