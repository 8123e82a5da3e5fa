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
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cachecd.errors import RemoteCodeMismatch

_lock = threading.Lock()
_guarded: dict[str, list[tuple[Path, dict[str, str]]]] = {}  # module dir name -> (dir, pins)


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

        check_import(Path(dmu.HF_MODULES_CACHE), Path(module_path))
        return original(class_name, module_path, *args, **kwargs)

    get_class_in_module.cachecd_checked = True  # type: ignore[attr-defined]
    get_class_in_module.__wrapped__ = original  # type: ignore[attr-defined]
    return get_class_in_module


def check_import(cache: Path, module_path: Path) -> None:
    """Raise unless the module transformers is about to import from ``cache`` (and its relative
    imports) is pinned, byte for byte, by a guarded model of that folder name."""
    parts = module_path.parts
    with _lock:
        guards = list(_guarded.get(parts[1], ())) if len(parts) >= 3 else []
    if not guards:
        return
    from transformers.dynamic_module_utils import get_relative_import_files

    module = cache / module_path
    files = [module, *(Path(f) for f in get_relative_import_files(str(module)))]
    problems = [_first_problem(_root(cache, parts, pins), files, pins) for _, pins in guards]
    if all(problems):
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


def _first_problem(root: Path, files: list[Path], pins: Mapping[str, str]) -> str | None:
    for f in files:
        name = f.relative_to(root).as_posix() if f.is_relative_to(root) else str(f)
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        if pins.get(name) != digest:
            return (f"{f} (the modules-cache copy of {name}) has sha256 {digest}, not the "
                    f"{pins.get(name, 'no')} sha256 the manifest pins")
    return None
