"""Compressed averaging: encodings checked by hand, error feedback, and the mean over real ranks."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from dptrain.strategies.compression import (COMPRESSIONS, ErrorFeedback, compressed_mean, decode, encode,
                                            payload_bytes)


def test_int8_encoding_by_hand():
    values = torch.tensor([0.0, 1.27, -2.54, 0.5, 0.0, 0.0, 0.0])
    payload = encode("int8", values, block=4)
    # Two blocks: scales 2.54/127 = 0.02 and 0 (all zeros), then 7 int8 values.
    assert payload.numel() == 4 * 2 + 7 == payload_bytes("int8", 7, block=4)
    scales = payload[:8].view(torch.float32)
    assert scales.tolist() == pytest.approx([0.02, 0.0])
    assert payload[8:].view(torch.int8).tolist() == [0, 64, -127, 25, 0, 0, 0]  # 1.27/0.02 = 63.5 → 64
    decoded = decode("int8", payload, 7, block=4)
    assert decoded.tolist() == pytest.approx([0.0, 1.28, -2.54, 0.5, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("kind,per_element", [("none", 4), ("fp16", 2), ("bf16", 2)])
def test_float_payloads_are_the_cast_values(kind, per_element):
    values = torch.randn(300)
    payload = encode(kind, values)
    assert payload.dtype == torch.uint8 and payload.numel() == per_element * 300 == payload_bytes(kind, 300)
    cast = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[kind]
    assert torch.equal(decode(kind, payload, 300), values.to(cast).to(torch.float32))


def test_int8_payload_is_under_0_26_of_float32():
    n = 1_000_000
    assert payload_bytes("int8", n) / payload_bytes("none", n) < 0.26


def test_error_feedback_carries_what_rounding_dropped():
    feedback = ErrorFeedback("int8", block=4)
    first = torch.tensor([1.0, 0.013, 0.0, 0.0])
    payload = feedback.encode(first)
    sent = decode("int8", payload, 4, block=4)
    assert torch.allclose(feedback.residual, first - sent)
    second = torch.tensor([1.0, 0.013, 0.0, 0.0])
    payload = feedback.encode(second)
    # The second payload encodes second + the first residual; over both, the total sent equals
    # the total change up to the last residual alone.
    total_sent = sent + decode("int8", payload, 4, block=4)
    assert torch.allclose(total_sent + feedback.residual, first + second, atol=1e-7)


def test_unknown_compression_is_named():
    with pytest.raises(ValueError, match="'int4'"):
        payload_bytes("int4", 3)


def _mean(rank, world, kind, weights):
    torch.manual_seed(rank)
    change = torch.randn(1000) * (rank + 1)
    feedback = ErrorFeedback(kind)
    mean, sent = compressed_mean(change, feedback, weight=None if weights is None else weights[rank])
    return change, mean, sent, feedback.residual


@pytest.mark.parametrize("kind", COMPRESSIONS)
def test_compressed_mean_over_three_ranks_is_the_mean_of_the_decoded_payloads(kind):
    results = run_distributed(_mean, 3, kind, None)
    changes = [r[0] for r in results]
    decoded = [decode(kind, encode(kind, c), c.numel()) for c in changes]
    expected = (decoded[0] + decoded[1] + decoded[2]) / 3
    for _, mean, sent, residual in results:
        assert torch.allclose(mean, expected, atol=1e-6)
        assert sent == payload_bytes(kind, 1000)
    assert all(torch.equal(results[0][1], r[1]) for r in results)  # bit-identical on every rank
    if kind != "none":
        for change, _, _, residual in results:
            assert torch.allclose(residual, change - decode(kind, encode(kind, change), 1000), atol=1e-6)


def test_weighted_compressed_mean_ignores_weight_zero():
    results = run_distributed(_mean, 3, "int8", [2.0, 0.0, 1.0])
    decoded = [decode("int8", encode("int8", r[0]), 1000) for r in results]
    expected = (2 * decoded[0] + decoded[2]) / 3
    for _, mean, sent, _ in results:
        assert torch.allclose(mean, expected, atol=1e-6)
        assert sent == payload_bytes("int8", 1000) + 8


@pytest.mark.parametrize("kind", ["int8", "fp16"])
def test_a_residual_loaded_from_a_checkpoint_follows_the_change_to_its_device(kind):
    """Checkpoints load with map_location="cpu": on a GPU the next change + residual mixed devices and raised
    (then said as "a peer failed"). The meta device stands in for the GPU here."""
    from dptrain.strategies.compression import ErrorFeedback

    saved = ErrorFeedback(kind)
    saved.encode(torch.linspace(-1, 1, 300))
    resumed = ErrorFeedback(kind)
    resumed.load_state_dict({"kind": kind, "residual": saved.residual.cpu()})
    payload = resumed.encode(torch.zeros(300, device="meta"))
    assert payload.device.type == "meta" and resumed.residual.device.type == "meta"
