"""Load a user's model from "package.module:factory", turning every mistake into a one-sentence UserError."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

from dptrain.errors import UserError
from dptrain.user_code import load_callable


def is_user_model(name: str) -> bool:
    return ":" in name


def build_user_model(
    spec: str, input_shape: tuple[int, ...], num_outputs: int, options: dict[str, Any]
) -> nn.Module:
    factory = load_factory(spec)
    keywords = {**_data_keywords(spec, factory, input_shape, num_outputs, options), **options}
    try:
        model = factory(**keywords)
    except Exception as error:
        # The user's own code failed; report it as theirs, not as a dptrain crash.
        raise UserError(f"model factory {spec} raised {type(error).__name__}: {error}") from error
    if not isinstance(model, nn.Module):
        raise UserError(
            f"model factory {spec} returned a value of type {type(model).__name__}, "
            "but it must return a torch.nn.Module"
        )
    return model


def load_factory(spec: str) -> Callable[..., Any]:
    return load_callable(spec, "--model", "model", "builds the model")


def _data_keywords(
    spec: str, factory: Callable[..., Any], input_shape: tuple[int, ...], num_outputs: int, options: dict[str, Any]
) -> dict[str, Any]:
    """input_shape/num_outputs for the factory if it can take them; rejects options it cannot take."""
    # Offered only to factories that declare them (or take **kwargs), so zero-argument factories work.
    offered = {"input_shape": input_shape, "num_outputs": num_outputs}
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        # No introspectable signature (e.g. a C extension): pass only what the user configured.
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return offered
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {p.name for p in parameters if p.kind in by_name}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise UserError(
            f"model factory {spec} does not accept option '{unknown[0]}'; "
            f"its keyword parameters are: {', '.join(sorted(accepted - set(offered))) or 'none'}"
        )
    return {name: value for name, value in offered.items() if name in accepted}
