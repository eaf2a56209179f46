"""Import a user's "package.module:function" (a model or data factory), every mistake one UserError."""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable

from dptrain.errors import UserError

SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def looks_like_spec(text: str) -> bool:
    """Whether `text` has the form package.module:function."""
    return bool(SPEC.match(text))


def load_callable(spec: str, flag: str, noun: str, purpose: str) -> Callable[..., Any]:
    """The function `spec` names, for `flag` (e.g. --model); `purpose` completes "a callable that ..."."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise UserError(f"{noun} '{spec}' is not of the form package.module:factory, e.g. mypkg.nets:build")
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
