"""Optimizers by name and per-step LR schedules: exact factors, and the LR a real optimizer applies at each step."""

import math

import pytest
import torch

from dptrain.lr_policy import build_schedule, lr_factor
from dptrain.train.optim import build_optimizer


def factors(steps, **kwargs):
    return [lr_factor(step, **kwargs) for step in range(steps)]


def test_constant_schedule_is_one_at_every_step_and_beyond_the_end():
    assert factors(50, steps_per_epoch=7, epochs=5) == [1.0] * 50


def test_cosine_starts_at_one_halves_at_mid_run_and_reaches_zero_at_the_end():
    kwargs = dict(steps_per_epoch=10, epochs=4, schedule="cosine")  # 40 steps
    values = factors(41, **kwargs)
    assert values[0] == 1.0
    assert values[20] == pytest.approx(0.5, abs=1e-15)
    assert values[39] == pytest.approx(0.5 * (1 + math.cos(math.pi * 39 / 40)), rel=1e-15)
    assert 0 < values[39] < 2e-3
    assert values[40] == 0.0
    assert lr_factor(1000, **kwargs) == 0.0  # clamped after the last step, never rising again
    assert all(a > b for a, b in zip(values, values[1:]))


def test_step_schedule_multiplies_by_gamma_at_each_boundary_of_step_epochs():
    kwargs = dict(steps_per_epoch=7, epochs=12, schedule="step", step_epochs=3, gamma=0.1)
    for k in range(4):
        boundary = k * 3 * 7
        assert lr_factor(boundary, **kwargs) == 0.1**k
        assert lr_factor(boundary + 3 * 7 - 1, **kwargs) == 0.1**k  # held until the next boundary
        if k:
            assert lr_factor(boundary - 1, **kwargs) == 0.1 ** (k - 1)


def test_linear_warmup_ramps_as_step_plus_one_over_warmup_steps_then_follows_the_schedule():
    # 2 warm-up epochs of 5 steps: factors 1/10, 2/10, ..., 10/10, then the schedule alone.
    constant = factors(20, steps_per_epoch=5, epochs=4, warmup_epochs=2)
    assert constant == [(s + 1) / 10 for s in range(10)] + [1.0] * 10

    kwargs = dict(steps_per_epoch=5, epochs=4, schedule="cosine")
    warm = factors(20, warmup_epochs=2, **kwargs)
    cold = factors(20, **kwargs)
    assert warm == [c * ((s + 1) / 10) for s, c in enumerate(cold[:10])] + cold[10:]


def test_fractional_warmup_epochs_round_to_whole_steps():
    assert factors(6, steps_per_epoch=8, epochs=1, warmup_epochs=0.5) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_unknown_schedule_is_a_value_error():
    with pytest.raises(ValueError, match="unknown LR schedule 'linear'"):
        lr_factor(0, steps_per_epoch=1, epochs=1, schedule="linear")


@pytest.mark.parametrize("schedule", [
    dict(schedule="constant", warmup_epochs=1),
    dict(schedule="cosine", warmup_epochs=1.5),
    dict(schedule="step", step_epochs=2, gamma=0.5, warmup_epochs=0),
])
def test_sgd_under_build_schedule_applies_base_lr_times_lr_factor_at_every_step(schedule):
    steps_per_epoch, epochs, base_lr = 4, 6, 0.1
    weight = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=base_lr)
    scheduler = build_schedule(optimizer, steps_per_epoch=steps_per_epoch, epochs=epochs, **schedule)
    for step in range(steps_per_epoch * epochs):
        expected = base_lr * lr_factor(step, steps_per_epoch=steps_per_epoch, epochs=epochs, **schedule)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=0)
        optimizer.zero_grad()
        weight.sum().backward()  # gradient 1: plain SGD moves the weight by exactly the LR
        before = weight.item()
        optimizer.step()
        scheduler.step()
        assert before - weight.item() == pytest.approx(expected, rel=1e-9, abs=1e-15)


def params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("momentum, nesterov, expected", [(0.0, False, False), (0.0, True, False),
                                                          (0.9, False, False), (0.9, True, True)])
def test_sgd_is_nesterov_only_when_asked_and_momentum_is_positive(momentum, nesterov, expected):
    weights = params()
    optimizer = build_optimizer("sgd", weights, lr=0.05, momentum=momentum, nesterov=nesterov, weight_decay=1e-4)
    assert type(optimizer) is torch.optim.SGD
    group = optimizer.param_groups[0]
    assert group["params"] == weights
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (0.05, momentum, expected, 1e-4)


@pytest.mark.parametrize("name, cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_and_adamw_get_the_given_lr_and_weight_decay(name, cls, weight_decay):
    weights = params()
    optimizer = build_optimizer(name, weights, lr=3e-4, momentum=0.9, nesterov=True, weight_decay=weight_decay)
    assert type(optimizer) is cls  # AdamW subclasses Adam in recent torch: compare exactly
    group = optimizer.param_groups[0]
    assert group["params"] == weights
    assert (group["lr"], group["weight_decay"]) == (3e-4, weight_decay)


def test_unknown_optimizer_is_a_value_error():
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        build_optimizer("rmsprop", params(), lr=0.1)
