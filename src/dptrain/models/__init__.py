"""Models by name: the built-in zoo and user models given as "package.module:factory".

Every user-facing check happens here (names, sample shapes, option names and values), so the
builders in zoo/resnet/nfnet are plain constructors. A built-in builder's keyword-only
parameters are its options; their defaults define both the valid names and the expected types.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable

import torch
from torch import nn

from dptrain import registry
from dptrain.errors import UserError, unknown_name
from dptrain.user_code import check_spec_file
from dptrain.models import user

MODEL_NAMES = registry.names("model")
_IMAGE_MODELS = {"cnn", "resnet", "nfnet"}


def build_model(
    name: str, input_shape: tuple[int, ...], num_outputs: int, *, options: dict | None = None
) -> nn.Module:
    """Build `name` for samples shaped `input_shape` with `num_outputs` outputs (logits, or 1 for regression)."""
    input_shape = _check_sample_shape(input_shape)
    if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 1:
        raise UserError(f"the number of model outputs is {num_outputs!r}, but it must be a positive integer")
    options = dict(options or {})
    check_name(name)
    if user.is_user_model(name):
        return user.build_user_model(name, input_shape, num_outputs, options)
    if name in _IMAGE_MODELS and len(input_shape) != 3:
        raise UserError(
            f"model '{name}' needs samples shaped (C, H, W), but the data's samples have shape {input_shape}; "
            "use --model mlp for flat features"
        )
    if name == "cnn1d" and len(input_shape) not in (1, 2):
        raise UserError(
            f"model 'cnn1d' needs sequences shaped (C, L) or (L,), but the data's samples have shape {input_shape}; "
            "use --model cnn for images"
        )
    builder = registry.load("model", name)
    return builder(input_shape, num_outputs, **_check_options(name, builder, options))


def check_name(name: str) -> None:
    """One line when `name` is neither a built-in model nor a user model whose file is there (without building
    or importing anything: `dptrain train` asks before it reads the data)."""
    if user.is_user_model(name):
        check_spec_file(name, "--model")
    elif name not in registry.names("model"):  # read now: an entry registered after import counts too
        raise unknown_name("model", name, registry.names("model"), "or a user model as package.module:factory")


def check_output_shape(model: nn.Module, input_shape: tuple[int, ...], num_outputs: int, about: str = "") -> None:
    """Run a batch of 2 zero samples through `model` and fail early if its output does not fit the data.
    `about` ends the refusal of a wrong shape: what the data was read as, and how to read it otherwise.

    The forward runs in eval mode (BatchNorm must not learn from zeros) without gradients; each
    submodule's train/eval flag is restored afterwards.
    """
    expected = (2, num_outputs)
    modes = [(module, module.training) for module in model.modules()]
    reference = next(model.parameters(), None)
    device = reference.device if reference is not None else torch.device("cpu")
    batch = torch.zeros((2, *input_shape), device=device)
    model.eval()
    try:
        with torch.no_grad():
            output = model(batch)
    except Exception as error:
        raise UserError(
            f"model forward on a batch of samples shaped {tuple(input_shape)} raised "
            f"{type(error).__name__}: {error}"
        ) from error
    finally:
        for module, training in modes:
            module.training = training
    if not isinstance(output, torch.Tensor):
        raise UserError(f"model output is a {type(output).__name__}, but it must be a tensor shaped {expected}")
    if tuple(output.shape) != expected:
        raise UserError(
            f"model output shape {tuple(output.shape)} does not match the data: "
            f"expected {expected} for {num_outputs} outputs{f'; {about}' if about else ''}"
        )


def _check_sample_shape(input_shape: Any) -> tuple[int, ...]:
    shape = tuple(input_shape)
    try:
        # operator.index accepts numpy integers (shapes often come from arrays) but not floats.
        sizes = tuple(operator.index(size) for size in shape)
    except TypeError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise UserError(f"sample shape {shape} is not usable by a model; it must be one or more positive sizes")
    return sizes


def _check_options(name: str, builder: Callable[..., nn.Module], options: dict[str, Any]) -> dict[str, Any]:
    """Options checked against the builder's keyword-only defaults: int -> positive int, tuple -> sizes."""
    defaults = {
        p.name: p.default for p in inspect.signature(builder).parameters.values() if p.kind is p.KEYWORD_ONLY
    }
    checked = {}
    for option, value in options.items():
        if option not in defaults:
            raise UserError(
                f"unknown option '{option}' for model '{name}'; valid options are {', '.join(sorted(defaults))}"
            )
        if isinstance(defaults[option], tuple):
            if not isinstance(value, (list, tuple)) or not all(_is_positive_int(size) for size in value):
                raise UserError(
                    f"option '{option}' for model '{name}' is {value!r}, "
                    f"but it must be a list of positive integers such as {list(defaults[option])}"
                )
            value = tuple(value)
        elif not _is_positive_int(value):
            raise UserError(
                f"option '{option}' for model '{name}' is {value!r}, "
                f"but it must be a positive integer such as {defaults[option]}"
            )
        checked[option] = value
    return checked


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


__all__ = ["MODEL_NAMES", "build_model", "check_name", "check_output_shape"]
