"""The Trainer computes exactly what a raw PyTorch loop computes (fp32, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from trainer_testkit import (
    Regression,
    assert_same_weights,
    make_batches,
    make_optimizer,
    quiet,
    raw_fit,
)

from gpulayer.train import Trainer

pytestmark = pytest.mark.torch


@pytest.mark.parametrize(
    ("optimizer", "accumulate", "clip"),
    [
        ("sgd", 1, None),
        ("adam", 1, None),
        ("sgd", 3, None),  # 10 batches: steps after 3, 6, 9 and the epoch's last
        ("adam", 4, None),
        ("sgd", 3, 0.05),  # small enough that clipping changes every step
    ],
)
def test_final_weights_equal_a_raw_loop(
    optimizer: str, accumulate: int, clip: float | None
) -> None:
    torch.manual_seed(0)
    module = Regression(optimizer=optimizer)
    net = copy.deepcopy(module.net)
    data = make_batches(10)
    epochs = 2

    trainer = Trainer(
        **quiet(max_epochs=epochs, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    )
    trainer.fit(module, data)
    steps = raw_fit(
        net,
        make_optimizer(net.parameters(), optimizer, module.lr),
        [data] * epochs,
        accumulate,
        clip,
    )

    assert trainer.global_step == steps == epochs * -(-10 // accumulate)
    assert trainer.current_epoch == epochs
    assert_same_weights(module.net, net)
    # The weights moved: a no-op Trainer would not pass this either.
    assert not torch.equal(module.net[0].weight, copy.deepcopy(Regression().net)[0].weight)


def test_accumulation_differs_from_stepping_every_batch() -> None:
    # Guards the parity test above against a Trainer that ignores the setting.
    data = make_batches(6)
    results = []
    for accumulate in (1, 2):
        torch.manual_seed(0)
        module = Regression()
        Trainer(**quiet(max_epochs=1, accumulate_grad_batches=accumulate)).fit(module, data)
        results.append(module.net[0].weight.detach().clone())
    assert not torch.equal(results[0], results[1])


def test_max_steps_stops_mid_epoch_like_a_raw_loop() -> None:
    torch.manual_seed(0)
    module = Regression()
    net = copy.deepcopy(module.net)
    data = make_batches(10)
    trainer = Trainer(**quiet(max_steps=13))
    trainer.fit(module, data)
    raw_fit(net, make_optimizer(net.parameters(), "sgd", module.lr), [data, data[:3]])
    assert trainer.global_step == 13
    assert trainer.current_epoch == 2  # as Lightning: the cut-short second epoch counts
    assert_same_weights(module.net, net)


def test_step_interval_scheduler_matches_a_raw_loop() -> None:
    torch.manual_seed(0)
    module = Regression(step_lr=4)
    net = copy.deepcopy(module.net)
    data = make_batches(10)
    Trainer(**quiet(max_epochs=2)).fit(module, data)

    optimizer = make_optimizer(net.parameters(), "sgd", module.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 4, gamma=0.5)
    for _ in range(2):
        for x, y in data:
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
    assert_same_weights(module.net, net)
