"""thdpack.planning.pipeline_parallel.simulate: megatron-core's 1F1B and interleaved 1F1B schedules simulated op by op.

1. Hand-worked timelines: every stage's ops with their start and end, worked out on paper (in the comments),
   never by the code under test.
2. :func:`stage_ops` against megatron-core 0.19.2's own ``get_schedule_table`` and ``get_pp_rank_microbatches``
   (``megatron/core/pipeline_parallel/schedules.py``, unpacked by tests/megatron_env.py). The module imports
   torch and megatron-core's training stack, so the two functions (plain Python) are taken out of the file with
   ``ast`` and run alone; ``get_pp_rank_microbatches`` reads the pipeline's size and rank from its
   ``p2p_communicator`` argument, given as a small stub. Skipped, with the reason in the id, where the wheel
   cannot be had.
3. Properties: the classic 1F1B step time with uniform costs, the lower bound, the two entry points agree.
4. Errors.
"""

from __future__ import annotations

import ast
import math
import types
from typing import Optional

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_env  # tests/megatron_env.py
from thdpack.planning.pipeline_parallel.simulate import (
    BACKWARD,
    FORWARD,
    PipelineShape,
    simulate_pipeline,
    stage_ops,
    step_time,
    step_time_bound,
)

F, B = FORWARD, BACKWARD


def timeline_rows(tl, s):
    """Stage ``s`` of a timeline as ``[(kind, micro-batch, chunk, start, end), ...]`` in run order."""
    return [(int(k), int(j), int(c), float(t0), float(t1))
            for (k, j, c), t0, t1 in zip(tl.ops[s].tolist(), tl.start[s], tl.end[s])]


def check_timeline(tl, expected, step):
    """``expected``: per stage, ``[(kind, micro-batch, chunk, start, end), ...]`` (chunk left out: 0)."""
    assert len(tl.ops) == len(expected)
    for s, want in enumerate(expected):
        want = [row if len(row) == 5 else (row[0], row[1], 0, row[2], row[3]) for row in want]
        got = timeline_rows(tl, s)
        assert [r[:3] for r in got] == [r[:3] for r in want], f"stage {s} order"
        np.testing.assert_allclose([r[3:] for r in got], [r[3:] for r in want], rtol=0, atol=1e-12,
                                   err_msg=f"stage {s} times")
    assert tl.step_time == pytest.approx(step, abs=1e-12)


# --------------------------------------------------------------------------- 1. hand-worked timelines

def test_pp2_uniform_by_hand():
    # P = 2, V = 1, m = 3, costs 3: forward per stage 3 / (3·2) = 0.5, backward 1.0.
    # Warm-up: stage 0 P-1-0 = 1 forward, stage 1 none.
    #   stage 0: F0 F1 B0 F2 B1 B2      stage 1: F0 B0 F1 B1 F2 B2
    # S0 F0 0-0.5; S0 F1 0.5-1.0; S1 F0 (needs S0 F0 = .5) .5-1; S1 B0 (needs own F0 = 1) 1-2;
    # S0 B0 (needs S1 B0 = 2) 2-3; S1 F1 (needs S0 F1 = 1, free 2) 2-2.5; S1 B1 2.5-3.5;
    # S0 F2 (free 3) 3-3.5; S0 B1 (needs S1 B1 = 3.5) 3.5-4.5; S1 F2 (needs 3.5, free 3.5) 3.5-4;
    # S1 B2 4-5; S0 B2 (needs 5) 5-6. Step 6 = m·c/P + (P-1)·c/P = 4.5 + 1.5.
    expected = [
        [(F, 0, 0.0, 0.5), (F, 1, 0.5, 1.0), (B, 0, 2.0, 3.0), (F, 2, 3.0, 3.5), (B, 1, 3.5, 4.5), (B, 2, 5.0, 6.0)],
        [(F, 0, 0.5, 1.0), (B, 0, 1.0, 2.0), (F, 1, 2.0, 2.5), (B, 1, 2.5, 3.5), (F, 2, 3.5, 4.0), (B, 2, 4.0, 5.0)],
    ]
    tl = simulate_pipeline([3.0, 3.0, 3.0], PipelineShape(pp_size=2))
    check_timeline(tl, expected, 6.0)
    np.testing.assert_allclose(tl.busy, [4.5, 4.5])
    assert tl.bubble_fraction == pytest.approx(1 - 4.5 / 6.0)
    assert step_time([3.0, 3.0, 3.0], PipelineShape(pp_size=2)) == 6.0


def test_pp2_non_uniform_by_hand():
    # P = 2, costs 3, 6, 3: mb0 F .5 B 1, mb1 F 1 B 2, mb2 F .5 B 1 (per stage). Same op order as above.
    # S0 F0 0-.5; S0 F1 .5-1.5; S1 F0 .5-1; S1 B0 1-2; S0 B0 (needs 2, free 1.5) 2-3;
    # S1 F1 (needs 1.5, free 2) 2-3; S1 B1 3-5; S0 F2 (free 3) 3-3.5; S0 B1 (needs 5) 5-7;
    # S1 F2 (needs 3.5, free 5) 5-5.5; S1 B2 5.5-6.5; S0 B2 (needs 6.5, free 7) 7-8. Step 8.
    expected = [
        [(F, 0, 0.0, 0.5), (F, 1, 0.5, 1.5), (B, 0, 2.0, 3.0), (F, 2, 3.0, 3.5), (B, 1, 5.0, 7.0), (B, 2, 7.0, 8.0)],
        [(F, 0, 0.5, 1.0), (B, 0, 1.0, 2.0), (F, 1, 2.0, 3.0), (B, 1, 3.0, 5.0), (F, 2, 5.0, 5.5), (B, 2, 5.5, 6.5)],
    ]
    tl = simulate_pipeline([3.0, 6.0, 3.0], PipelineShape(pp_size=2))
    check_timeline(tl, expected, 8.0)
    np.testing.assert_allclose(tl.busy, [6.0, 6.0])
    assert tl.bubble_fraction == pytest.approx(0.25)


def test_pp2_order_matters_by_hand():
    # P = 2, costs 6, 3, 3 (the expensive one first): mb0 F 1 B 2, mb1/mb2 F .5 B 1.
    # S0 F0 0-1; S0 F1 1-1.5; S1 F0 1-2; S1 B0 2-4; S0 B0 (needs 4) 4-6; S1 F1 (needs 1.5, free 4) 4-4.5;
    # S1 B1 4.5-5.5; S0 F2 (free 6) 6-6.5; S0 B1 (needs 5.5, free 6.5) 6.5-7.5; S1 F2 (needs 6.5) 6.5-7;
    # S1 B2 7-8; S0 B2 (needs 8) 8-9. Step 9 (3, 6, 3 took 8).
    expected = [
        [(F, 0, 0.0, 1.0), (F, 1, 1.0, 1.5), (B, 0, 4.0, 6.0), (F, 2, 6.0, 6.5), (B, 1, 6.5, 7.5), (B, 2, 8.0, 9.0)],
        [(F, 0, 1.0, 2.0), (B, 0, 2.0, 4.0), (F, 1, 4.0, 4.5), (B, 1, 4.5, 5.5), (F, 2, 6.5, 7.0), (B, 2, 7.0, 8.0)],
    ]
    check_timeline(simulate_pipeline([6.0, 3.0, 3.0], PipelineShape(pp_size=2)), expected, 9.0)


def test_pp4_vpp2_uniform_by_hand():
    # P = 4, V = 2, group 4 (default = P), m = 4, cost 24: forward per chunk-stage 24 / (3·4·2) = 1, backward 2.
    # Megatron's table (m = 4 is one group): k 0..7 -> (0,0) (1,0) (2,0) (3,0) (0,1) (1,1) (2,1) (3,1);
    # backward k: (mb of k, chunk 1 - chunk of k): B(0,1) B(1,1) B(2,1) B(3,1) B(0,0) B(1,0) B(2,0) B(3,0).
    # Warm-up (P-s-1)·2 + (V-1)·4, capped at m·V = 8: stage 0: 10 -> 8, stage 1: 8, stage 2: 6, stage 3: 4.
    #   stage 0, 1: F k0..7, B k0..7
    #   stage 2:    F k0..5, F k6 B k0, F k7 B k1, B k2..7
    #   stage 3:    F k0..3, F4 B0, F5 B1, F6 B2, F7 B3, B4..7
    # Dependencies (virtual stage c·P + s): F(j,c) on s needs F(j,c) on s-1, or (s = 0, c = 1) F(j,0) on stage 3;
    # B(j,c) on s needs B(j,c) on s+1, or (s = 3, c = 0) B(j,1) on stage 0, or (s = 3, c = 1) its own F(j,1).
    # Forwards of chunk 0 run as a wave: stage s F(j,0) at s+j .. s+j+1.
    # S0 F(0,1) needs S3 F(0,0) = 4: 4-5, then F(1..3,1) 5-6, 6-7, 7-8 (each needs S3 F(j,0) = 4+j+1... <= free).
    # S1 F(j,1) 5+j .. 6+j (needs S0, free).  S2 F(0,1) 6-7, F(1,1) 7-8, F(2,1) 8-9.
    # S3 F(0,1) (needs S2 = 7) 7-8; B(0,1) 8-10; F(1,1) (needs 8, free 10) 10-11; B(1,1) 11-13;
    # S2 B(0,1) (needs S3 = 10) 10-12; F(3,1) (needs S1 = 9, free 12) 12-13; B(1,1) (needs 13) 13-15.
    # S3 F(2,1) (needs S2 = 9, free 13) 13-14; B(2,1) 14-16; S2 B(2,1) (needs 16) 16-18.
    # S3 F(3,1) (needs S2 = 13, free 16) 16-17; B(3,1) 17-19; S2 B(3,1) (needs 19) 19-21.
    # S1 B(0,1) (needs S2 12) 12-14; B(1,1) (15) 15-17; B(2,1) (18) 18-20; B(3,1) (21) 21-23.
    # S0 B(0,1) (needs S1 14) 14-16; B(1,1) (17) 17-19; B(2,1) (20) 20-22; B(3,1) (23) 23-25.
    # S3 B(0,0) (needs S0 B(0,1) = 16, free 19) 19-21; B(1,0) (19, free 21) 21-23; B(2,0) (22, free 23) 23-25;
    #    B(3,0) (25) 25-27.
    # S2 B(j,0) each needs S3's: 21-23, 23-25, 25-27, 27-29.  S1: 23-25, 25-27, 27-29, 29-31.
    # S0: 25-27, 27-29, 29-31, 31-33. Step 33 = m·c/P + (P-1)·c/(P·V) = 24 + 9.
    expected = [
        [(F, 0, 0, 0, 1), (F, 1, 0, 1, 2), (F, 2, 0, 2, 3), (F, 3, 0, 3, 4),
         (F, 0, 1, 4, 5), (F, 1, 1, 5, 6), (F, 2, 1, 6, 7), (F, 3, 1, 7, 8),
         (B, 0, 1, 14, 16), (B, 1, 1, 17, 19), (B, 2, 1, 20, 22), (B, 3, 1, 23, 25),
         (B, 0, 0, 25, 27), (B, 1, 0, 27, 29), (B, 2, 0, 29, 31), (B, 3, 0, 31, 33)],
        [(F, 0, 0, 1, 2), (F, 1, 0, 2, 3), (F, 2, 0, 3, 4), (F, 3, 0, 4, 5),
         (F, 0, 1, 5, 6), (F, 1, 1, 6, 7), (F, 2, 1, 7, 8), (F, 3, 1, 8, 9),
         (B, 0, 1, 12, 14), (B, 1, 1, 15, 17), (B, 2, 1, 18, 20), (B, 3, 1, 21, 23),
         (B, 0, 0, 23, 25), (B, 1, 0, 25, 27), (B, 2, 0, 27, 29), (B, 3, 0, 29, 31)],
        [(F, 0, 0, 2, 3), (F, 1, 0, 3, 4), (F, 2, 0, 4, 5), (F, 3, 0, 5, 6),
         (F, 0, 1, 6, 7), (F, 1, 1, 7, 8), (F, 2, 1, 8, 9), (B, 0, 1, 10, 12),
         (F, 3, 1, 12, 13), (B, 1, 1, 13, 15), (B, 2, 1, 16, 18), (B, 3, 1, 19, 21),
         (B, 0, 0, 21, 23), (B, 1, 0, 23, 25), (B, 2, 0, 25, 27), (B, 3, 0, 27, 29)],
        [(F, 0, 0, 3, 4), (F, 1, 0, 4, 5), (F, 2, 0, 5, 6), (F, 3, 0, 6, 7),
         (F, 0, 1, 7, 8), (B, 0, 1, 8, 10), (F, 1, 1, 10, 11), (B, 1, 1, 11, 13),
         (F, 2, 1, 13, 14), (B, 2, 1, 14, 16), (F, 3, 1, 16, 17), (B, 3, 1, 17, 19),
         (B, 0, 0, 19, 21), (B, 1, 0, 21, 23), (B, 2, 0, 23, 25), (B, 3, 0, 25, 27)],
    ]
    shape = PipelineShape(pp_size=4, vpp_size=2)
    tl = simulate_pipeline([24.0] * 4, shape)
    check_timeline(tl, expected, 33.0)
    np.testing.assert_allclose(tl.busy, [24.0] * 4)
    assert tl.bubble_fraction == pytest.approx(1 - 24 / 33)


def test_pp4_vpp2_non_uniform_by_hand():
    # P = 4, V = 2, group 4, m = 4, costs 24, 48, 24, 24: F 1 (mb1: 2), B 2 (mb1: 4). Op order as the uniform case.
    # Chunk 0 forwards: S0 0-1, 1-3, 3-4, 4-5; S1 1-2, (needs 3) 3-5, (free 5) 5-6, 6-7;
    #   S2 2-3, (5) 5-7, 7-8, 8-9; S3 3-4, (7) 7-9, 9-10, 10-11.
    # S0 F(0,1) (needs S3 F(0,0) = 4, free 5) 5-6; F(1,1) (needs S3 F(1,0) = 9) 9-11; F(2,1) (10, free 11) 11-12;
    #   F(3,1) (11, free 12) 12-13.
    # S1 F(0,1) (6, free 7) 7-8; F(1,1) (11) 11-13; F(2,1) (12, free 13) 13-14; F(3,1) (13, free 14) 14-15.
    # S2 F(0,1) (8, free 9) 9-10; F(1,1) (13) 13-15; F(2,1) (14, free 15) 15-16.
    # S3 F(0,1) (10, free 11) 11-12; B(0,1) 12-14; F(1,1) (S2 15) 15-17; B(1,1) 17-21; F(2,1) (16, free 21) 21-22;
    #   B(2,1) 22-24.
    # S2 B(0,1) (14, free 16) 16-18; F(3,1) (S1 15, free 18) 18-19; B(1,1) (21) 21-25; B(2,1) (24, free 25) 25-27.
    # S3 F(3,1) (19, free 24) 24-25; B(3,1) 25-27.  S2 B(3,1) (27) 27-29.
    # S1 B(0,1) (18) 18-20; B(1,1) (25) 25-29; B(2,1) (27, free 29) 29-31; B(3,1) (29, free 31) 31-33.
    # S0 B(0,1) (20) 20-22; B(1,1) (29) 29-33; B(2,1) (31, free 33) 33-35; B(3,1) (33, free 35) 35-37.
    # S3 B(0,0) (S0 B(0,1) = 22, free 27) 27-29; B(1,0) (33) 33-37; B(2,0) (35, free 37) 37-39; B(3,0) (37) 39-41.
    # S2 B(0,0) (29) 29-31; B(1,0) (37) 37-41; B(2,0) (39, free 41) 41-43; B(3,0) (41, free 43) 43-45.
    # S1 B(0,0) (31, free 33) 33-35; B(1,0) (41) 41-45; B(2,0) (43, free 45) 45-47; B(3,0) 47-49.
    # S0 B(0,0) (35, free 37) 37-39; B(1,0) (45) 45-49; B(2,0) (47, free 49) 49-51; B(3,0) 51-53. Step 53.
    expected = [
        [(F, 0, 0, 0, 1), (F, 1, 0, 1, 3), (F, 2, 0, 3, 4), (F, 3, 0, 4, 5),
         (F, 0, 1, 5, 6), (F, 1, 1, 9, 11), (F, 2, 1, 11, 12), (F, 3, 1, 12, 13),
         (B, 0, 1, 20, 22), (B, 1, 1, 29, 33), (B, 2, 1, 33, 35), (B, 3, 1, 35, 37),
         (B, 0, 0, 37, 39), (B, 1, 0, 45, 49), (B, 2, 0, 49, 51), (B, 3, 0, 51, 53)],
        [(F, 0, 0, 1, 2), (F, 1, 0, 3, 5), (F, 2, 0, 5, 6), (F, 3, 0, 6, 7),
         (F, 0, 1, 7, 8), (F, 1, 1, 11, 13), (F, 2, 1, 13, 14), (F, 3, 1, 14, 15),
         (B, 0, 1, 18, 20), (B, 1, 1, 25, 29), (B, 2, 1, 29, 31), (B, 3, 1, 31, 33),
         (B, 0, 0, 33, 35), (B, 1, 0, 41, 45), (B, 2, 0, 45, 47), (B, 3, 0, 47, 49)],
        [(F, 0, 0, 2, 3), (F, 1, 0, 5, 7), (F, 2, 0, 7, 8), (F, 3, 0, 8, 9),
         (F, 0, 1, 9, 10), (F, 1, 1, 13, 15), (F, 2, 1, 15, 16), (B, 0, 1, 16, 18),
         (F, 3, 1, 18, 19), (B, 1, 1, 21, 25), (B, 2, 1, 25, 27), (B, 3, 1, 27, 29),
         (B, 0, 0, 29, 31), (B, 1, 0, 37, 41), (B, 2, 0, 41, 43), (B, 3, 0, 43, 45)],
        [(F, 0, 0, 3, 4), (F, 1, 0, 7, 9), (F, 2, 0, 9, 10), (F, 3, 0, 10, 11),
         (F, 0, 1, 11, 12), (B, 0, 1, 12, 14), (F, 1, 1, 15, 17), (B, 1, 1, 17, 21),
         (F, 2, 1, 21, 22), (B, 2, 1, 22, 24), (F, 3, 1, 24, 25), (B, 3, 1, 25, 27),
         (B, 0, 0, 27, 29), (B, 1, 0, 33, 37), (B, 2, 0, 37, 39), (B, 3, 0, 39, 41)],
    ]
    shape = PipelineShape(pp_size=4, vpp_size=2)
    tl = simulate_pipeline([24.0, 48.0, 24.0, 24.0], shape)
    check_timeline(tl, expected, 53.0)
    np.testing.assert_allclose(tl.busy, [30.0] * 4)
    assert step_time_bound(120.0, 24.0, shape) == 39.0


def test_pp2_vpp2_non_uniform_by_hand():
    # P = 2, V = 2, group 2, m = 2, costs 12, 24: per chunk-stage c / (3·2·2): mb0 F 1 B 2, mb1 F 2 B 4.
    # Table: k 0..3 -> (0,0) (1,0) (0,1) (1,1). Warm-up: stage 0 1·2 + 2 = 4 (all), stage 1 0 + 2 = 2.
    #   stage 0: F(0,0) F(1,0) F(0,1) F(1,1) B(0,1) B(1,1) B(0,0) B(1,0)
    #   stage 1: F(0,0) F(1,0) F(0,1) B(0,1) F(1,1) B(1,1) B(0,0) B(1,0)
    # S0 F(0,0) 0-1, F(1,0) 1-3; S1 F(0,0) 1-2, F(1,0) (needs 3) 3-5;
    # S0 F(0,1) (needs S1 F(0,0) = 2, free 3) 3-4; F(1,1) (needs S1 F(1,0) = 5) 5-7;
    # S1 F(0,1) (needs 4, free 5) 5-6; B(0,1) 6-8; F(1,1) (needs 7, free 8) 8-10; B(1,1) 10-14;
    # S0 B(0,1) (needs 8) 8-10; B(1,1) (needs 14) 14-18;
    # S1 B(0,0) (needs S0 B(0,1) = 10, free 14) 14-16; B(1,0) (needs S0 B(1,1) = 18) 18-22;
    # S0 B(0,0) (needs 16, free 18) 18-20; B(1,0) (needs 22) 22-26. Step 26.
    expected = [
        [(F, 0, 0, 0, 1), (F, 1, 0, 1, 3), (F, 0, 1, 3, 4), (F, 1, 1, 5, 7),
         (B, 0, 1, 8, 10), (B, 1, 1, 14, 18), (B, 0, 0, 18, 20), (B, 1, 0, 22, 26)],
        [(F, 0, 0, 1, 2), (F, 1, 0, 3, 5), (F, 0, 1, 5, 6), (B, 0, 1, 6, 8),
         (F, 1, 1, 8, 10), (B, 1, 1, 10, 14), (B, 0, 0, 14, 16), (B, 1, 0, 18, 22)],
    ]
    tl = simulate_pipeline([12.0, 24.0], PipelineShape(pp_size=2, vpp_size=2))
    check_timeline(tl, expected, 26.0)
    np.testing.assert_allclose(tl.busy, [18.0, 18.0])


def test_single_stage_by_hand():
    # P = 1: no pipeline; F0 B0 F1 B1 back to back: costs 3, 6 -> F 1 B 2, F 2 B 4. Step 9 = the sum.
    expected = [[(F, 0, 0, 1), (B, 0, 1, 3), (F, 1, 3, 5), (B, 1, 5, 9)]]
    tl = simulate_pipeline([3.0, 6.0])
    check_timeline(tl, expected, 9.0)
    assert tl.bubble_fraction == 0.0


def test_backward_ratio():
    # P = 2, m = 1, cost 4, backward_ratio 3: forward 4 / (4·2) = .5, backward 1.5.
    # S0 F 0-.5, S1 F .5-1, S1 B 1-2.5, S0 B 2.5-4. Step 4.
    expected = [[(F, 0, 0.0, 0.5), (B, 0, 2.5, 4.0)], [(F, 0, 0.5, 1.0), (B, 0, 1.0, 2.5)]]
    check_timeline(simulate_pipeline([4.0], PipelineShape(pp_size=2), backward_ratio=3.0), expected, 4.0)


# --------------------------------------------------------------------------- 2. megatron-core's own schedule

def _schedules_py():
    site = megatron_env.site_or_reason()
    if isinstance(site, str):
        return site
    path = site / "megatron" / "core" / "pipeline_parallel" / "schedules.py"
    return path if path.is_file() else f"{path} is missing"


def megatron_schedule_functions(path):
    """``get_schedule_table`` and ``get_pp_rank_microbatches`` of megatron-core's ``schedules.py``, taken out
    with ``ast`` and run alone (their bodies are plain Python; ``parallel_state`` is only read without a
    ``p2p_communicator``, which the test always passes)."""
    tree = ast.parse(path.read_text())
    wanted = {"get_schedule_table", "get_pp_rank_microbatches"}
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in nodes} == wanted
    namespace = {"Optional": Optional, "P2PCommunicator": object, "parallel_state": None}
    exec(compile(ast.Module(nodes, []), str(path), "exec"), namespace)
    return namespace["get_schedule_table"], namespace["get_pp_rank_microbatches"]


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


# (P, V, group, m): V = 1 is the non-interleaved schedule; m a multiple of the group, and two megatron-core
# accepts with a last group of at least P (6 = 4 + 2 with P = 2; 7 = 4 + 3 with P = 3).
MEGATRON_CASES = [
    (2, 1, None, 1), (2, 1, None, 5), (4, 1, None, 3), (4, 1, None, 8), (3, 1, None, 7),
    (2, 2, None, 2), (2, 2, None, 6), (4, 2, None, 4), (4, 2, None, 8), (4, 3, None, 12),
    (2, 3, 3, 9), (4, 2, 6, 12), (3, 4, 3, 6), (8, 2, None, 16), (2, 2, 4, 6), (3, 2, 4, 7),
]


@pytest.mark.parametrize("path", [megatron_env.peer_param(_schedules_py(), megatron_env.CORE_ID)])
def test_stage_ops_match_megatron_core(path):
    get_schedule_table, get_pp_rank_microbatches = megatron_schedule_functions(path)
    for p, v, group, m in MEGATRON_CASES:
        shape = PipelineShape(pp_size=p, vpp_size=v, vpp_group=group)
        g = shape.group
        table = get_schedule_table(m, v, g) if v > 1 else [(j, 0) for j in range(m)]
        ours = stage_ops(shape, m)
        assert len(ours) == p
        for s in range(p):
            comm = types.SimpleNamespace(pp_group=_Group(p, s), virtual_pipeline_model_parallel_size=v if v > 1 else None)
            total, all_warmup, warmup, remaining = get_pp_rank_microbatches(m, v, g, p2p_communicator=comm)
            case = f"P={p} V={v} group={g} m={m} stage {s}"
            assert total == m * v and warmup + remaining == total, case
            ops = ours[s]
            assert ops.dtype == np.int64 and ops.shape == (2 * total, 3), case
            kinds = ops[:, 0].tolist()
            # our warm-up: the forwards before the first backward, but the one that starts the 1F1B phase
            # (warm-up m·V and m·V - 1 run the same ops: m·V forwards, then the backwards)
            assert kinds.index(B) - 1 == min(warmup, total - 1), case
            if not remaining:
                assert all_warmup and kinds == [F] * total + [B] * total, case
            # forwards in megatron's table order; backwards the same virtual micro-batches, chunk V-1-chunk
            forwards = [tuple(r[1:]) for r in ops.tolist() if r[0] == F]
            backwards = [tuple(r[1:]) for r in ops.tolist() if r[0] == B]
            assert forwards == [tuple(t) for t in table], case
            assert backwards == [(j, v - 1 - c) for j, c in table], case
            # megatron's steady state: forward k + warm-up, then backward k; then the cool-down backwards
            steady = kinds[warmup:warmup + 2 * remaining]
            assert steady == [F, B] * remaining and kinds[warmup + 2 * remaining:] == [B] * warmup, case


# --------------------------------------------------------------------------- 3. properties

@pytest.mark.parametrize("p, v, group, m", [
    (1, 1, None, 5), (2, 1, None, 1), (2, 1, None, 3), (4, 1, None, 4), (4, 1, None, 9), (8, 1, None, 3),
    (2, 2, None, 2), (2, 2, None, 6), (4, 2, None, 4), (4, 2, None, 12), (4, 4, None, 8), (3, 2, 3, 6),
    (4, 2, 8, 16), (8, 2, None, 8),
])
def test_uniform_costs_classic_value(p, v, group, m):
    # every micro-batch costs c: the last stage computes m·c/P, and the first forward / last backward cross the
    # P-1 other stages' chunk (c / (P·V) each, forward plus backward): m·c/P + (P-1)·c/(P·V).
    # (With V = 1 and m < P the fill and drain still cost (P-1)·c/P: the formula holds for any m.)
    c = 6.0
    shape = PipelineShape(pp_size=p, vpp_size=v, vpp_group=group)
    want = m * c / p + (p - 1) * c / (p * v)
    assert step_time([c] * m, shape) == pytest.approx(want, rel=1e-12)
    assert step_time_bound(m * c, c, shape) == pytest.approx(want, rel=1e-12)  # tight with uniform costs


@st.composite
def cases(draw):
    p = draw(st.integers(1, 4))
    v = draw(st.integers(1, 3)) if p > 1 else 1
    group = draw(st.one_of(st.none(), st.integers(p, p + 2))) if v > 1 else None
    shape = PipelineShape(pp_size=p, vpp_size=v, vpp_group=group)
    m = shape.micro_batch_multiple() * draw(st.integers(1, 3))
    costs = draw(st.lists(st.floats(0.0, 50.0, allow_nan=False), min_size=m, max_size=m))
    ratio = draw(st.sampled_from([1.0, 2.0, 3.5]))
    return shape, costs, ratio


@settings(max_examples=50, deadline=None)
@given(cases())
def test_properties(case):
    shape, costs, ratio = case
    m = len(costs)
    tl = simulate_pipeline(costs, shape, backward_ratio=ratio)
    t = step_time(costs, shape, backward_ratio=ratio)
    assert t == tl.step_time
    assert t >= step_time_bound(sum(costs), min(costs), shape, backward_ratio=ratio) * (1 - 1e-12) - 1e-12
    # every stage runs every (kind, micro-batch, chunk) exactly once
    want = sorted((k, j, c) for k in (F, B) for j in range(m) for c in range(shape.vpp_size))
    for s in range(shape.pp_size):
        assert sorted(map(tuple, tl.ops[s].tolist())) == want
        assert np.all(tl.end[s] >= tl.start[s]) and np.all(tl.start[s] >= 0)
        assert np.all(tl.start[s][1:] >= tl.end[s][:-1] - 1e-12)  # a stage runs one op at a time, in order
    # the dataflow rule: each op starts as soon as its stage is free and its input is there (virtual stage
    # c·P + s: a forward takes the previous virtual stage's forward, a backward the next one's backward, the
    # last virtual stage's backward its own forward)
    p, v = shape.pp_size, shape.vpp_size
    ends = {(s, k, j, c): e for s in range(p) for (k, j, c), e in zip(tl.ops[s].tolist(), tl.end[s])}
    for s in range(p):
        for i, (k, j, c) in enumerate(tl.ops[s].tolist()):
            if k == F:
                vs = c * p + s - 1
                ready = ends[(vs % p, F, j, vs // p)] if vs >= 0 else 0.0
            else:
                vs = c * p + s + 1
                ready = ends[(vs % p, B, j, vs // p)] if vs < p * v else ends[(s, F, j, c)]
            free = tl.end[s][i - 1] if i else 0.0
            assert tl.start[s][i] == pytest.approx(max(free, ready), abs=1e-9)
    # each stage computes all costs / P
    np.testing.assert_allclose(tl.busy, sum(costs) / shape.pp_size, rtol=1e-9, atol=1e-9)
    if t > 0:
        assert 0.0 <= tl.bubble_fraction < 1.0
    assert t == pytest.approx(max(float(e.max()) for e in tl.end))


def test_order_is_run_order():
    # the same costs in another order give another step (see the hand-worked P = 2 cases: 8 and 9)
    shape = PipelineShape(pp_size=2)
    assert step_time([3.0, 6.0, 3.0], shape) == 8.0
    assert step_time([6.0, 3.0, 3.0], shape) == 9.0
    assert step_time(np.array([6.0, 3.0, 3.0]), shape) == 9.0


# --------------------------------------------------------------------------- 4. errors

def test_shape_errors():
    with pytest.raises(ValueError, match="needs pp_size >= 2, got pp_size=1"):
        PipelineShape(vpp_size=2, pp_size=1)
    with pytest.raises(ValueError, match="vpp_group=3 .* must be at least pp_size=4"):
        PipelineShape(pp_size=4, vpp_size=2, vpp_group=3)
    PipelineShape(pp_size=4, vpp_size=1, vpp_group=3)  # no interleaving: the group is not used
    for bad in (0, -1):
        with pytest.raises(ValueError, match="pp_size"):
            PipelineShape(pp_size=bad)
        with pytest.raises(ValueError, match="vpp_size"):
            PipelineShape(pp_size=2, vpp_size=bad)
    assert PipelineShape(pp_size=4, vpp_size=2).micro_batch_multiple() == 4
    assert PipelineShape(pp_size=4, vpp_size=2, vpp_group=6).micro_batch_multiple() == 6
    assert PipelineShape(pp_size=4).micro_batch_multiple() == 1


@pytest.mark.parametrize("costs", [[], [1.0, -1.0], [1.0, math.nan], [math.inf], [[1.0, 2.0]]],
                         ids=["empty", "negative", "nan", "inf", "2d"])
@pytest.mark.parametrize("fn", [step_time, simulate_pipeline])
def test_cost_errors(fn, costs):
    with pytest.raises(ValueError, match="costs must be a non-empty 1-d array of finite costs >= 0"):
        fn(costs, PipelineShape(pp_size=2))


def test_other_argument_errors():
    for ratio in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="backward_ratio must be a positive finite number"):
            step_time([1.0], PipelineShape(pp_size=2), backward_ratio=ratio)
    with pytest.raises(ValueError, match="num_micro_batches"):
        stage_ops(PipelineShape(pp_size=2), 0)
