"""Cost model of the newer modes: compression payloads, all_gather, overlapped averaging, hierarchical sync,
local-SGD steps and auto, each checked against numbers computed by hand."""

from __future__ import annotations

import pytest

from dptrain import costmodel
from dptrain.costmodel import Calibration, Settings

# 1e6 bytes = 250,000 float32 elements; 1000 samples, batch 10: 50 steps per epoch on 2 workers.
CAL = Calibration(seconds_per_sample=1e-3, model_bytes=1_000_000, bandwidth=1e6, latency=1e-3,
                  samples=1000, batch_size=10)


def test_compressed_payloads_are_two_bytes_an_element_or_one_plus_a_scale_per_256():
    assert costmodel.compressed_bytes(1000) == 4000
    assert costmodel.compressed_bytes(1000, "fp16") == costmodel.compressed_bytes(1000, "bf16") == 2000
    assert costmodel.compressed_bytes(1000, "int8") == 1000 + 4 * 4  # ceil(1000/256) = 4 scales
    assert costmodel.compressed_bytes(256, "int8") == 260
    assert costmodel.compressed_bytes(257, "int8") == 257 + 8
    assert costmodel.compressed_bytes(250_000, "int8") == 250_000 + 977 * 4
    with pytest.raises(ValueError, match="compression must be one of"):
        costmodel.compressed_bytes(10, "int4")


def test_all_gather_sends_n_minus_one_payloads():
    assert costmodel.all_gather_seconds(1, 1e6, 1e6, 1e-3) == 0.0
    assert costmodel.all_gather_seconds(4, 1e6, 1e6, 1e-3) == pytest.approx(3.0 + 3e-3, rel=1e-12)
    # the same bytes: all_gather of fp16 on 2 ranks (1 x 2M/2) equals the ring all-reduce of float32 (2/2 x 4M/4)
    assert costmodel.all_gather_seconds(2, 5e5, 1e6, 0.0) == costmodel.ring_allreduce_seconds(2, 5e5, 1e6, 0.0)


def test_the_two_step_mean_costs_a_ring_all_reduce_of_the_payload():
    assert costmodel.all_to_all_seconds(1, 1e6, 1e6, 1e-3) == 0.0
    assert costmodel.all_to_all_seconds(4, 1e6, 1e6, 1e-3) == pytest.approx(0.75 + 3e-3)  # 3 of 4 parts
    assert costmodel.two_step_mean_seconds(4, 1e6, 1e6, 1e-3) == pytest.approx(0.75 + 3e-3 + 0.75 + 3e-3)
    for workers in (2, 3, 4, 8, 16):
        assert costmodel.two_step_mean_seconds(workers, 1e6, 1e6, 1e-3) == \
            pytest.approx(costmodel.ring_allreduce_seconds(workers, 1e6, 1e6, 1e-3))
        # int8 about a quarter, fp16 half of float32's ring at every N (the former all_gather lost from 8 and 4 on)
        fp32 = costmodel.average_seconds(workers, 4_000_000, 1e6, 0.0)
        assert costmodel.average_seconds(workers, 4_000_000, 1e6, 0.0, "int8") == pytest.approx(0.2539 * fp32, rel=1e-3)
        assert costmodel.average_seconds(workers, 4_000_000, 1e6, 0.0, "fp16") == pytest.approx(fp32 / 2)
    assert costmodel.all_gather_seconds(8, costmodel.compressed_bytes(10**6, "int8"), 1e6, 0.0) > \
        costmodel.ring_allreduce_seconds(8, 4e6, 1e6, 0.0)


def test_compressed_sync_averages_travel_by_the_two_step_mean():
    fp16 = costmodel.epoch_seconds("sync", 2, CAL, settings=Settings(compression="fp16"))
    assert fp16["communication"] == pytest.approx(500_000 / 1e6 + 2e-3)  # 2 x 1/2 x 500 kB + 2 x (2-1) alpha
    int8 = costmodel.epoch_seconds("sync", 4, CAL, settings=Settings(compression="int8", every=2))
    assert int8["communication"] == pytest.approx((2 * 3 / 4 * 253_908 / 1e6 + 6e-3) / 2)
    assert int8["compute"] == pytest.approx(0.25)
    plain = costmodel.epoch_seconds("sync", 2, CAL, settings=Settings())
    assert plain == costmodel.epoch_seconds("sync", 2, CAL)  # Settings() is the plain strategy


def test_compressed_gradients_fp16_halve_the_ring_int8_quarters_it():
    assert costmodel.epoch_seconds("allreduce", 2, CAL, settings=Settings(compression="fp16"))["communication"] == \
        pytest.approx(50 * (500_000 / 1e6 + 2e-3))
    assert costmodel.epoch_seconds("allreduce", 2, CAL, settings=Settings(compression="bf16"))["communication"] == \
        pytest.approx(50 * 0.502)
    assert costmodel.epoch_seconds("allreduce", 2, CAL, settings=Settings(compression="int8"))["communication"] == \
        pytest.approx(50 * (253_908 / 1e6 + 2e-3))


def test_local_sgd_pays_one_average_every_k_steps():
    assert costmodel.epoch_seconds("sync", 2, CAL, settings=Settings(every_steps=10))["communication"] == \
        pytest.approx(5 * 1.002)  # 50 steps / 10


def test_overlapped_period_is_compute_plus_the_unhidden_transfer_plus_apply():
    assert costmodel.overlapped_period_seconds(1.0, 0.3, 0.5, 0.01) == pytest.approx(1.0 + 0.2 + 0.01)
    assert costmodel.overlapped_period_seconds(1.0, 1.0, 0.5, 0.0) == 1.0  # hidden entirely: max(compute, transfer)
    assert costmodel.overlapped_period_seconds(1.0, 1.0, 1.5, 0.0) == 1.5


def test_overlapped_average_hides_the_transfer_behind_the_delay():
    def comm(cal, **settings):
        return costmodel.communication_seconds("overlapped-average", 2, cal, Settings(**settings))

    # one average per epoch (50 steps of 10 ms); transfer 1.002 s; applied 1 step later: 10 ms of it hidden
    assert comm(CAL, delay_steps=1) == pytest.approx(1.002 - 0.01)
    # applied 50 steps later (the whole period) with a 50 ms apply: max(0.5, 1.002) + 0.05 - 0.5 of compute
    cal = Calibration(**{**CAL.as_dict(), "apply_seconds": 0.05})
    assert comm(cal, delay_steps=50) == pytest.approx(1.002 + 0.05 - 0.5)
    # a delay longer than the period hides no more than the period
    assert comm(cal, delay_steps=80) == pytest.approx(comm(cal, delay_steps=50))
    # every 10 steps on a fast link (transfer 12 ms < 100 ms of compute): only the 5 applies of 1 ms show
    fast = Calibration(**{**CAL.as_dict(), "bandwidth": 1e8, "apply_seconds": 1e-3})
    assert comm(fast, every_steps=10, delay_steps=10) == pytest.approx(5 * 1e-3)
    # with a delay of 2 steps (20 ms hidden) each of the 5 periods waits 12 - 20 < 0: still only the applies
    assert comm(fast, every_steps=10, delay_steps=2) == pytest.approx(5 * 1e-3)
    # delay 1: 10 ms hidden, 2 ms waited per period
    assert comm(fast, every_steps=10, delay_steps=1) == pytest.approx(5 * (0.002 + 1e-3))
    # streaming's default delay: half the period rounded up (25 of 50 steps: 0.25 s of the 1.002 s hidden)
    assert comm(CAL) == pytest.approx(1.002 - 0.25)
    assert costmodel.epoch_seconds("streaming", 2, CAL)["communication"] == pytest.approx(1.002 - 0.25)
    # 4 fragments: a ring of 250 kB a period (0.25 s + 2 alpha) behind 25 steps (0.25 s): 2 ms waited
    assert comm(CAL, fragments=4) == pytest.approx(0.252 - 0.25)
    # 3 fragments of 1 MB: ceil(250,000 / 3) = 83,334 elements, 333,336 bytes, nothing hidden
    assert comm(CAL, fragments=3, delay_steps=0) == pytest.approx(333_336 / 1e6 + 2e-3)


def test_hierarchical_is_a_node_ring_per_step_and_a_node_average_per_period():
    cal = Calibration(**{**CAL.as_dict(), "node_bandwidth": 1e8, "node_latency": 1e-5})
    # 8 ranks as 2 nodes of 4; shard 125 samples: 13 steps
    inside = 13 * (2 * 3 / 4 * 1e6 / 1e8 + 6 * 1e-5)  # 13 x 0.01506
    between = 2 * 1 / 2 * 1e6 / 1e6 + 2 * 1e-3  # ring over the 2 node leaders on the slow link
    handout = 1e6 / 1e8 + 1e-5  # each leader broadcasts the average to its node on the fast link
    comm = costmodel.communication_seconds("hierarchical-allreduce", 8, cal, Settings(ranks_per_node=4))
    assert comm == pytest.approx(inside + between + handout)
    assert comm == pytest.approx(0.19578 + 1.002 + 0.01001)
    every_two = costmodel.communication_seconds("hierarchical-allreduce", 8, cal, Settings(ranks_per_node=4, every=2))
    assert every_two == pytest.approx(inside + (between + handout) / 2)
    int8 = costmodel.communication_seconds("hierarchical-allreduce", 8, cal,
                                           Settings(ranks_per_node=4, compression="int8"))
    assert int8 == pytest.approx(13 * (2 * 3 / 4 * 253_908 / 1e8 + 6e-5) + (253_908 / 1e6 + 2e-3) + handout)
    # one rank per node is sync among all ranks; one node is allreduce (nothing crosses the slow link but
    # the leader's average with itself, which costs nothing)
    assert costmodel.communication_seconds("hierarchical-allreduce", 8, cal, Settings(ranks_per_node=1)) == \
        pytest.approx(costmodel.communication_seconds("periodic-allreduce", 8, cal))
    assert costmodel.communication_seconds("hierarchical-allreduce", 4, cal, Settings(ranks_per_node=4)) == \
        pytest.approx(25 * (2 * 3 / 4 * 1e6 / 1e8 + 6 * 1e-5) + handout)  # 250 samples a rank, batch 10: 25 steps
    with pytest.raises(ValueError, match="ranks_per_node 3 must divide the 8 workers"):
        costmodel.communication_seconds("hierarchical-allreduce", 8, cal, Settings(ranks_per_node=3))


def test_auto_is_timed_as_its_fastest_safe_candidate():
    assert costmodel.epoch_seconds("auto", 2, CAL) == costmodel.epoch_seconds("sync", 2, CAL)  # 1.002 < 50 x 1.002
    assert costmodel.epoch_seconds("auto", 1, CAL)["communication"] == 0.0


def test_unknown_pattern_names_the_valid_ones():
    with pytest.raises(ValueError, match="communication pattern must be one of"):
        costmodel.communication_seconds("gossip", 2, CAL)


def test_auto_keeps_allreduce_when_it_is_predicted_within_five_per_cent():
    # 50 steps of a ring of 0.5 MB at 1e9 B/s (0.5 ms each): 25 ms more than 0.5 s of compute
    cal = Calibration(**{**CAL.as_dict(), "model_bytes": 500_000, "bandwidth": 1e9, "latency": 0.0})
    allreduce = costmodel.epoch_seconds("allreduce", 2, cal)
    assert allreduce["communication"] == pytest.approx(50 * 5e-4)  # 0.525 s against sync's 0.5005 s: 4.9 % more
    assert costmodel.epoch_seconds("auto", 2, cal) == allreduce
