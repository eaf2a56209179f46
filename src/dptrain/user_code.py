"""Import a user's "package.module:function" or "path/to/file.py:function" (a model or data factory),
every mistake one UserError."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
from types import ModuleType
from typing import Any, Callable, Optional

from dptrain.errors import UserError

SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# A Python file named by its path: ./mymodels.py:make_net, models/nets.py:build, /abs/x.py:f
FILE_SPEC = re.compile(r"^(?P<path>.+\.py):(?P<attribute>[A-Za-z_]\w*)$")

# Files loaded so far, by absolute path: loading one twice gives the same module (and the same classes).
_FILE_MODULES: dict[str, ModuleType] = {}


def looks_like_spec(text: str) -> bool:
    """Whether `text` has the form package.module:function or path/to/file.py:function."""
    return bool(SPEC.match(text) or FILE_SPEC.match(text))


def spec_file(spec: str) -> Optional[str]:
    """The file of a `path/to/file.py:function` spec (as given), or None for a module spec or anything else."""
    match = FILE_SPEC.match(spec)
    return match["path"] if match else None


def check_spec_file(spec: str, flag: str) -> None:
    """One line when `spec` names a Python file that is not there (a module spec is not checked)."""
    path = spec_file(spec)
    if path is not None and not os.path.isfile(path):
        raise UserError(f"{flag} {spec}: the file '{path}' does not exist; give the path of a Python file "
                        f"(relative to {os.getcwd()}) or package.module:function")


def _import_file(path: str, flag: str, spec: str) -> ModuleType:
    """The module of the Python file `path`, loaded once (spec_from_file_location).

    Its directory goes first on sys.path, as for `python FILE`, so that it imports the modules beside
    it; it is registered under its own name when that is free, so that pickled objects find it.
    """
    check_spec_file(spec, flag)
    full = os.path.realpath(path)
    if full in _FILE_MODULES:
        return _FILE_MODULES[full]
    stem = os.path.splitext(os.path.basename(full))[0]
    name = stem if stem.isidentifier() and stem not in sys.modules else \
        f"dptrain_user_{re.sub(r'[^0-9A-Za-z_]', '_', stem)}_{hashlib.sha1(full.encode()).hexdigest()[:8]}"
    directory = os.path.dirname(full)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    loader_spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise UserError(f"cannot import the file '{path}' for {flag} {spec}: {type(error).__name__}: {error}") from error
    _FILE_MODULES[full] = module
    return module


def load_callable(spec: str, flag: str, noun: str, purpose: str) -> Callable[..., Any]:
    """The function `spec` names, for `flag` (e.g. --model); `purpose` completes "a callable that ..."."""
    path = spec_file(spec)
    if path is not None:
        module_name, attribute = path, spec.rpartition(":")[2]
        module = _import_file(path, flag, spec)
    else:
        module_name, _, attribute = spec.partition(":")
        if not module_name or not attribute or ":" in attribute:
            raise UserError(f"{noun} '{spec}' is not of the form package.module:factory (or path/to/file.py:factory), "
                            "e.g. mypkg.nets:build")
        try:
            module = importlib.import_module(module_name)
        except Exception as error:
            raise UserError(
                f"cannot import module '{module_name}' for {flag} {spec}: {type(error).__name__}: {error}"
            ) from error
    factory = getattr(module, attribute, None)
    if factory is None:
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UserError(
            f"module '{module_name}' has no attribute '{attribute}' for {flag} {spec}; "
            f"its public callables are: {', '.join(available) or 'none'}"
        )
    if not callable(factory):
        raise UserError(f"'{spec}' is a {type(factory).__name__}, but it must be a callable that {purpose}")
    return factory
