"""What a user's script hands dptrain.Trainer, checked where it is handed over: a mistake is one line naming the bad
value and what would do (a UserError, and the TypeError or ValueError that Python code expects), not a traceback
from deep inside the loop later."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dptrain import registry
from dptrain.errors import UserTypeError, UserValueError, closest, did_you_mean
from dptrain.strategies.base import Strategy
from dptrain.train.step import AMP_DTYPES

LOSSES = ("cross-entropy", "mse")  # the losses Trainer takes by name (dptrain.train.step.make_loss)


def check_trainer_arguments(model: Any, optimizer: Any, loss: Any, strategy: Any, amp: str) -> None:
    """Refuse, in one line each: a model that is no torch Module, an optimizer that is none or holds none of
    the model's parameters (built over another model: training would change nothing), a loss that is neither
    a name of LOSSES nor a callable, a strategy that is not a Strategy object (a name, the class), an amp
    setting not in AMP_DTYPES."""
    if not isinstance(model, nn.Module):
        raise UserTypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserTypeError(f"optimizer must be a torch.optim.Optimizer over the model's parameters, "
                            f"not {type(optimizer).__name__}")
    own = {id(parameter) for parameter in model.parameters()}
    if own and not any(id(parameter) in own for group in optimizer.param_groups for parameter in group["params"]):
        raise UserValueError(f"the optimizer ({type(optimizer).__name__}) holds none of the model's parameters, so "
                             "training would change nothing; build it over this model's: "
                             f"torch.optim.{type(optimizer).__name__}(model.parameters(), ...)")
    if isinstance(loss, str) and loss not in LOSSES:
        hint = did_you_mean(loss, LOSSES)
        raise UserValueError(f"unknown loss '{loss}'; {hint + ' ' if hint else ''}valid names are "
                             f"{', '.join(LOSSES)}, or pass a callable (output, target) -> loss")
    if not isinstance(loss, str) and not callable(loss):
        raise UserTypeError(f"loss must be one of {', '.join(LOSSES)} or a callable (output, target) -> loss, "
                            f"not {type(loss).__name__}")
    if strategy is not None and not isinstance(strategy, Strategy):
        raise UserTypeError(_not_a_strategy(strategy))
    if amp not in AMP_DTYPES:
        raise UserValueError(f"amp must be one of {', '.join(sorted(AMP_DTYPES))}, not {amp!r}")


def fit_data(train: Any, test: Any, strategy: Any, membership: Any) -> tuple:
    """Trainer.fit's train and test as Datasets (dptrain.data.sampler.as_dataset). Shards read as a stream are
    refused in one line where they cannot go yet, as `dptrain train` refuses them: --strategy auto, live
    membership with async (`membership`: the Trainer's MembershipOptions; dptrain.data.streams.refuse_stream_run)."""
    from dptrain.data.sampler import as_dataset
    from dptrain.data.stream_splits import as_stream

    # iterable data (a torch IterableDataset, a WebDataset pipeline, a Hugging Face IterableDataset): a stream
    def made(data: Any, role: str) -> Any:
        stream = as_stream(data)
        return stream if stream is not None else as_dataset(data, role)

    train, test = made(train, "training"), (made(test, "test") if test is not None else None)
    if getattr(train, "is_stream", False):
        from dptrain.data.streams import refuse_stream_run
        refuse_stream_run(getattr(strategy, "name", "allreduce"), False, False, membership.min_workers,
                          merges=strategy is not None and not strategy.meets_at_epoch_ends)
    return train, test


def _not_a_strategy(given: Any) -> str:
    """The line for a strategy given as something other than a Strategy object: its name, its class, else."""
    classes = {name: entry.target.rpartition(":")[2] for name, entry in registry.STRATEGIES.items()}
    listed = ", ".join(f"dptrain.{cls}()" for cls in classes.values())
    if isinstance(given, type) and issubclass(given, Strategy):
        return f"strategy {given.__name__} is the class; pass an instance, {given.__name__}() (its options as keywords)"
    if isinstance(given, str):
        name = given if given in classes else closest(given.lower(), list(classes))
        if name is not None:
            return (f"strategy '{given}' is a name, not a Strategy: pass dptrain.{classes[name]}() (its options as "
                    f"keywords); the strategies are {listed}")
        return f"strategy '{given}' is not a Strategy: pass one of {listed}"
    return f"strategy must be a dptrain Strategy, one of {listed}, not {type(given).__name__}"
