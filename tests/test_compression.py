"""Compressed averaging: encodings checked by hand, error feedback, and the mean over real ranks."""

from __future__ import annotations

import io

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


def _mean(rank, world, kind, weights, scheme="all-gather"):
    torch.manual_seed(rank)
    change = torch.randn(1000) * (rank + 1)
    feedback = ErrorFeedback(kind)
    mean, sent = compressed_mean(change, feedback, weight=None if weights is None else weights[rank], scheme=scheme)
    return change, mean, sent, feedback.residual


@pytest.mark.parametrize("kind", COMPRESSIONS)
def test_the_all_gather_scheme_is_the_mean_of_the_decoded_payloads(kind):
    """The former scheme, still selectable (scheme="all-gather"): every payload to every rank."""
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


def test_weighted_all_gather_scheme_ignores_weight_zero():
    results = run_distributed(_mean, 3, "int8", [2.0, 0.0, 1.0])
    decoded = [decode("int8", encode("int8", r[0]), 1000) for r in results]
    expected = (2 * decoded[0] + decoded[2]) / 3
    for _, mean, sent, _ in results:
        assert torch.allclose(mean, expected, atol=1e-6)
        assert sent == payload_bytes("int8", 1000) + 8


# -- the two-step mean (the default): all_to_all of chunks, a mean per chunk, all_gather of the means ----------

def _bounds(kind, n, world):
    """Each rank's chunk, computed here independently: whole int8 blocks of 256 (elements for fp16/bf16),
    as even as possible, the first ranks taking one more."""
    unit = 256 if kind == "int8" else 1
    units = -(-n // unit)
    sizes = [units // world + (1 if r < units % world else 0) for r in range(world)]
    edges = [min(n, unit * sum(sizes[:r])) for r in range(world + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _two_step_reference(kind, changes, weights, residuals, servers):
    """The four steps by hand from the same inputs, on one process. `residuals`/`servers` are updated in place;
    returns the mean every rank must hold, and each rank's chunk payload sizes."""
    world, n = len(changes), changes[0].numel()
    bounds = _bounds(kind, n, world)
    weights = weights or [1.0] * world
    corrected = []
    for rank in range(world):  # 1. worker error feedback (a rank of weight 0 sends zeros, keeps its residual)
        if weights[rank] == 0:
            corrected.append(torch.zeros(n))
            continue
        corrected.append(changes[rank] + residuals[rank])
        residuals[rank] = corrected[rank] - decode(kind, encode(kind, corrected[rank]), n)
    result = []
    for rank, (start, end) in enumerate(bounds):
        # 2. rank `rank` decodes chunk `rank` of each payload (each chunk encoded alone) and forms the mean
        mean = torch.zeros(end - start)
        for weight, values in zip(weights, corrected):
            if weight:
                mean.add_(decode(kind, encode(kind, values[start:end]), end - start), alpha=weight)
        mean.div_(sum(weights))
        # 3. + its server residual, encoded; 4. every rank decodes it
        if servers[rank] is None:
            servers[rank] = torch.zeros(end - start)
        value = mean + servers[rank]
        sent = decode(kind, encode(kind, value), end - start)
        servers[rank] = value - sent
        result.append(sent)
    return torch.cat(result), [payload_bytes(kind, end - start) for start, end in bounds]


def _changes(world, n, call):
    generator = torch.Generator().manual_seed(100 * call + world)
    return [torch.randn(n, generator=generator) * (rank + 1) * 0.1 for rank in range(world)]


def _two_step(rank, world, kind, n, weights, calls):
    """`calls` averages of `_changes`, the feedback saved and loaded between them (as a checkpoint would)."""
    feedback = ErrorFeedback(kind)
    results = []
    for call in range(calls):
        change = _changes(world, n, call)[rank]
        mean, sent = compressed_mean(change, feedback, weight=None if weights is None else weights[rank])
        results.append((mean, sent, feedback.residual, feedback.server))
        saved = io.BytesIO()
        torch.save(feedback.state_dict(), saved)
        feedback = ErrorFeedback(kind)
        feedback.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    return results


TWO_STEP = [("int8", 2, 1000, None), ("int8", 3, 1000, None), ("int8", 4, 2049, None),
            ("int8", 4, 300, [1.0, 0.0, 2.0, 0.5]),  # two chunks empty (300 floats are two blocks)
            ("int8", 3, 1000, [2.0, 0.0, 1.0]), ("fp16", 3, 1001, None), ("bf16", 4, 1001, [0.0, 1.0, 1.0, 3.0])]


@pytest.mark.parametrize("kind,world,n,weights", TWO_STEP,
                         ids=[f"{k}-W{w}-n{n}{'-weighted' if ws else ''}" for k, w, n, ws in TWO_STEP])
def test_the_two_step_mean_is_the_four_steps_to_the_last_bit_on_every_rank(kind, world, n, weights):
    results = run_distributed(_two_step, world, kind, n, weights, 2, timeout=180)
    residuals, servers = [torch.zeros(n) for _ in range(world)], [None] * world
    exact_total, sums = torch.zeros(n), torch.zeros(n)
    for call in range(2):
        changes = _changes(world, n, call)
        expected, sizes = _two_step_reference(kind, changes, weights, residuals, servers)
        used = weights or [1.0] * world
        exact_total += sum(w * c for w, c in zip(used, changes)) / sum(used)
        sums += expected
        for rank in range(world):
            mean, sent, residual, server = results[rank][call]
            assert torch.equal(mean, results[0][call][0]), (call, rank)  # bit-identical on every rank
            assert torch.equal(mean, expected), (call, rank)  # the four steps, to the last bit
            # handed over: the W-1 chunks addressed to the others, the padded mean chunk, the weight
            assert sent == payload_bytes(kind, n) - sizes[rank] + max(sizes) + (8 if weights else 0)
            assert torch.equal(server, servers[rank])  # the server residual, carried (and saved) into the next call
            if not weights or weights[rank]:
                assert torch.equal(residual, residuals[rank])
    # error feedback on both sides: over two calls the results miss the exact sum of the means by what the
    # last roundings dropped (the workers' mean residual and the servers'), at most one rounding of each
    used = weights or [1.0] * world
    kept = sum(w * r for w, r in zip(used, residuals)) / sum(used)
    server = torch.cat(servers)
    assert torch.allclose(sums + kept + server, exact_total, atol=1e-5)
    assert (sums - exact_total).abs().max() <= kept.abs().max() + server.abs().max() + 1e-5
    assert server.abs().max() > 0  # the server's rounding is real (and carried)


def test_the_two_step_mean_moves_about_2_w_minus_1_over_w_payloads_on_the_wire():
    """At W = 8 the former scheme delivered 7 int8 payloads to each rank, more than an fp32 ring all-reduce's
    2·7/8·4n; the two-step one sends 7/8 of a payload in the all_to_all and 7 chunks of 1/8 in the all_gather."""
    n, world = 1_000_000, 8
    sizes = [payload_bytes("int8", end - start) for start, end in _bounds("int8", n, world)]
    wire = sum(sizes) - sizes[0] + (world - 1) * max(sizes)
    assert wire == pytest.approx(2 * (world - 1) / world * payload_bytes("int8", n), rel=1e-3)
    assert wire < 0.26 * 2 * (world - 1) / world * 4 * n < (world - 1) * payload_bytes("int8", n)


def test_a_server_residual_made_for_another_world_starts_again_from_zeros():
    mean = torch.linspace(-1, 1, 300)
    feedback = ErrorFeedback("int8")
    feedback.load_state_dict({"kind": "int8", "residual": None, "server": torch.full((300,), 0.004),
                              "server_for": [3, 1, 1000]})
    same = ErrorFeedback("int8")
    same.load_state_dict(feedback.state_dict())
    assert torch.equal(decode("int8", same.encode_mean(mean, 3, 1, 1000), 300),
                       decode("int8", encode("int8", mean + 0.004), 300))  # the same world: carried
    for world, rank, n in [(2, 1, 1000), (3, 0, 1000), (3, 1, 1200)]:  # another W, rank or n: reset
        other = ErrorFeedback("int8")
        other.load_state_dict({"kind": "int8", "residual": None, "server": torch.full((300,), 0.004),
                               "server_for": [3, 1, 1000]})
        payload = other.encode_mean(mean, world, rank, n)
        assert torch.equal(payload, encode("int8", mean))
        assert other.server_for == (world, rank, n)
        assert torch.equal(other.server, mean - decode("int8", payload, 300))


def test_an_old_checkpoint_with_the_worker_residual_only_still_loads():
    feedback = ErrorFeedback("int8")
    feedback.load_state_dict({"kind": "int8", "residual": torch.zeros(300)})
    assert feedback.server is None and feedback.server_for is None
    feedback.encode_mean(torch.ones(300), 2, 0, 600)
    assert feedback.server_for == (2, 0, 600)


def _world_change(rank, world, n):
    """A feedback saved by a world of 3 (its server residual for that world's chunk) averages in a world of 2."""
    feedback = ErrorFeedback("int8")
    feedback.load_state_dict({"kind": "int8", "residual": torch.zeros(n), "server": torch.full((400,), 0.003),
                              "server_for": [3, rank, n]})
    mean, _ = compressed_mean(_changes(world, n, 0)[rank], feedback)
    return mean, feedback.server_for


def test_a_world_change_resets_the_server_residual():
    n = 1000
    results = run_distributed(_world_change, 2, n)
    expected, _ = _two_step_reference("int8", _changes(2, n, 0), None, [torch.zeros(n)] * 2, [None] * 2)
    for rank, (mean, made_for) in enumerate(results):
        assert torch.equal(mean, expected) and made_for == (2, rank, n)


def test_an_unknown_scheme_is_named():
    with pytest.raises(ValueError, match="'ring'"):
        compressed_mean(torch.zeros(3), ErrorFeedback("int8"), scheme="ring")


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
