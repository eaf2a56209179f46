"""Evaluation runs as the run trains (issue 38, item 3): batches of the training batch size, under its autocast."""

from __future__ import annotations

import pytest
import torch

from dptrain.train.trainer import Trainer


class Recording(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)
        self.seen: list[tuple[bool, int, object]] = []  # (training, batch, autocast dtype or None)

    def forward(self, x):
        autocast = torch.is_autocast_enabled("cpu")
        self.seen.append((self.training, len(x), torch.get_autocast_dtype("cpu") if autocast else None))
        return self.linear(x)


@pytest.mark.parametrize("amp, dtype", [("none", None), ("bf16", torch.bfloat16)])
def test_the_test_split_is_evaluated_in_training_batches_under_the_runs_autocast(amp, dtype):
    torch.manual_seed(0)
    model = Recording()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), batch_size=16, amp=amp,
                      verbose=False, progress=False)
    train = (torch.randn(64, 6), torch.randint(0, 3, (64,)))
    test = (torch.randn(40, 6), torch.randint(0, 3, (40,)))
    summary = trainer.fit(train, test, epochs=1)
    evaluated = [(batch, cast) for training, batch, cast in model.seen if not training]
    assert [batch for batch, _ in evaluated][-3:] == [16, 16, 8]  # 40 rows in batches of 16 (not one of 1,024)
    assert {cast for _, cast in evaluated} == {dtype}
    assert 0.0 <= summary.test_accuracy <= 1.0
