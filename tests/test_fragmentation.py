"""Fragmentation simulator: arenas, accounting invariants, and the paper's headline shape."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvlab.labs.fragmentation import (
    CATEGORIES,
    POLICIES,
    BuddyArena,
    FirstFitArena,
    WorkloadRequest,
    compare_policies,
    reservation,
    sharegpt_like_workload,
    simulate,
    waste_table,
)

ARENA = 16384


@pytest.fixture(scope="module")
def workload():
    return sharegpt_like_workload(400, seed=0)


@pytest.fixture(scope="module")
def reports(workload):
    return compare_policies(workload, ARENA)


def test_workload_is_seeded_and_bounded():
    a = sharegpt_like_workload(300, seed=3)
    b = sharegpt_like_workload(300, seed=3)
    c = sharegpt_like_workload(300, seed=4)
    assert a == b and a != c
    assert all(1 <= r.prompt_len <= 1024 and r.output_len >= 1 and r.total_len <= 2048 for r in a)
    outputs = np.array([r.output_len for r in sharegpt_like_workload(5000, seed=0)])
    assert 250 < outputs.mean() < 350       # log-normal mean 338 before clipping
    timed = sharegpt_like_workload(200, seed=0, arrival_rate=0.5)
    arrivals = [r.arrival for r in timed]
    assert arrivals == sorted(arrivals) and 300 < arrivals[-1] < 500


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_requests": 0}, "num_requests"), ({"sigma": 0}, "sigma"),
    ({"max_seq_len": 1}, "max_seq_len"), ({"arrival_rate": -1.0}, "arrival_rate"),
])
def test_workload_bad_input(kwargs, field):
    args = {"num_requests": 10, **kwargs}
    with pytest.raises(ValueError, match=field):
        sharegpt_like_workload(**args)


def _check_arena_model(arena_cls, size, seed):
    """Random alloc/free against a slot-level model: no overlap, frees restore everything."""
    rng = random.Random(seed)
    arena = arena_cls(size)
    initial = sorted(arena.holes())
    owner = [None] * size
    live = {}
    for step in range(400):
        if live and rng.random() < 0.45:
            start = rng.choice(sorted(live))
            granted = live.pop(start)
            arena.free(start)
            for i in range(start, start + granted):
                owner[i] = None
        else:
            n = rng.randint(1, size // 4)
            got = arena.allocate(n)
            holes = arena.holes()
            if got is None:
                assert all(h < arena.granted_size(n) for h in holes)
                continue
            start, granted = got
            assert granted == arena.granted_size(n) >= n
            assert all(owner[i] is None for i in range(start, start + granted))
            for i in range(start, start + granted):
                owner[i] = step
            live[start] = granted
        assert sum(arena.holes()) == owner.count(None)
    for start in sorted(live):
        arena.free(start)
    assert sorted(arena.holes()) == initial        # everything coalesced back
    assert sum(initial) == size


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("size", [1024, 1000])
def test_first_fit_arena(seed, size):
    _check_arena_model(FirstFitArena, size, seed)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("size", [1024, 1000])
def test_buddy_arena(seed, size):
    _check_arena_model(BuddyArena, size, seed)


def test_buddy_merges_back_to_top_chunks():
    arena = BuddyArena(1000)                       # 512 + 256 + 128 + 64 + 32 + 8
    assert sorted(arena.holes()) == [8, 32, 64, 128, 256, 512]
    starts = [arena.allocate(3)[0] for _ in range(50)]
    assert arena.granted_size(3) == 4
    for s in starts:
        arena.free(s)
    assert sorted(arena.holes()) == [8, 32, 64, 128, 256, 512]


def test_first_fit_coalesces_and_leaves_holes():
    arena = FirstFitArena(10)
    a, b, c = (arena.allocate(3)[0] for _ in range(3))
    arena.free(b)
    assert arena.holes() == [3, 1]
    assert arena.allocate(4) is None               # 4 free slots, no hole of 4: external
    arena.free(a)
    assert arena.holes() == [6, 1]
    arena.free(c)
    assert arena.holes() == [10]


def test_reservations():
    r = WorkloadRequest(0, 0, prompt_len=100, output_len=300)
    assert reservation("max", r, 2048) == 2048
    assert reservation("pow2", r, 2048) == 100 + 512
    assert reservation("oracle", r, 2048) == 400
    with pytest.raises(ValueError, match="policy"):
        reservation("paged", r, 2048)


def test_categories_sum_to_arena_every_step(reports):
    for rep in reports.values():
        total = sum(rep.trace[c] for c in CATEGORIES)
        assert np.all(total == rep.arena_tokens)
        assert all(np.all(rep.trace[c] >= 0) for c in CATEGORIES)
        assert abs(sum(rep.fractions.values()) - 1) < 1e-9


def test_every_request_finishes_and_all_tokens_are_generated(workload, reports):
    decode_tokens = sum(r.output_len for r in workload)
    for rep in reports.values():
        assert rep.finished == len(workload)
        # each output token is one decode write; preempted requests keep their progress
        assert rep.generated_tokens == decode_tokens


def test_structural_zeros(reports):
    paged = reports["paged"].fractions
    assert paged["over_reserved"] == 0 and paged["external"] == 0
    assert reports["oracle"].fractions["over_reserved"] == 0
    assert reports["max"].fractions["internal"] == 0          # 2048 is a power of two


def test_reproduces_pagedattention_shape(reports):
    """Paged waste < 4%; contiguous policies waste 20-80%, ordered max > pow2 > oracle."""
    paged = reports["paged"]
    assert paged.waste < 0.04 and paged.token_states > 0.93
    for name in ("max", "pow2", "oracle"):
        assert 0.20 < reports[name].waste < 0.80
        assert 0.15 < reports[name].token_states < 0.50   # the paper: 20.4% .. 38.2%
    assert (reports["max"].token_states < reports["pow2"].token_states
            < reports["oracle"].token_states)
    # more requests in flight -> more tokens per step, the paper's throughput argument
    assert paged.mean_running > 2 * reports["oracle"].mean_running
    assert paged.steps < reports["oracle"].steps < reports["max"].steps


def test_first_fit_has_external_but_no_rounding(workload):
    rep = simulate(workload, "oracle", ARENA, arena="first_fit")
    assert rep.fractions["internal"] == 0 and rep.fractions["external"] > 0.02


def test_paged_block_size_trades_tail_waste():
    work = sharegpt_like_workload(150, seed=1)
    small = simulate(work, "paged", ARENA, block_size=8)
    large = simulate(work, "paged", ARENA, block_size=256)
    assert large.waste > small.waste


def test_deterministic(workload):
    a = simulate(workload[:100], "pow2", 8192)
    b = simulate(workload[:100], "pow2", 8192)
    assert a.fractions == b.fractions and a.steps == b.steps


def test_waste_table_lists_every_policy(reports):
    text = waste_table(reports)
    assert all(p in text for p in POLICIES) and "external" in text


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"policy": "lru"}, "policy"), ({"arena": "slab"}, "arena"),
    ({"arena_tokens": 0}, "arena_tokens"), ({"block_size": 0}, "block_size"),
    ({"watermark": 1.0}, "watermark"), ({"arena_tokens": 1000}, "never fit"),
])
def test_simulate_bad_input(workload, kwargs, match):
    args = {"policy": "max", "arena_tokens": ARENA, **kwargs}
    with pytest.raises(ValueError, match=match):
        simulate(workload[:5], args.pop("policy"), args.pop("arena_tokens"), **args)


def test_request_longer_than_max_seq_len_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        simulate([WorkloadRequest(0, 0, 100, 200)], "paged", 4096, max_seq_len=256)


# --- figures (headless) --------------------------------------------------------------------


def test_waste_figure_stacks_every_nonzero_category(reports):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.viz.paging import PAPER_TOKEN_STATES, waste_figure

    fig = waste_figure(reports)
    ax = fig.axes[0]
    bars = {p.get_gid(): p for p in ax.patches if p.get_gid()}
    expected = {f"waste-{n}-{c}" for n, r in reports.items() for c in CATEGORIES
                if r.fractions[c] > 0}
    assert set(bars) == expected
    for name, rep in reports.items():      # bars of one policy stack to 100%
        heights = [bars[f"waste-{name}-{c}"].get_height() for c in CATEGORIES
                   if f"waste-{name}-{c}" in bars]
        assert abs(sum(heights) - 100) < 1e-6
        assert abs(bars[f"waste-{name}-used"].get_height() - 100 * rep.token_states) < 1e-9
    assert [t.get_text() for t in ax.get_xticklabels()] == list(reports)
    marks = ax.collections[0].get_offsets()
    assert len(marks) == len(PAPER_TOKEN_STATES)
    with pytest.raises(ValueError, match="lacks"):
        waste_figure({"x": {"used": 1.0}})
    plt.close(fig)


def test_waste_timeline_figure(reports):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.viz.paging import waste_timeline_figure

    fig = waste_timeline_figure(reports["oracle"], steps=500)
    ax = fig.axes[0]
    assert len(ax.collections) == len(CATEGORIES)   # one stacked area per category
    assert fig.axes[1].lines[0].get_xdata().size == 500
    plt.close(fig)


def test_workload_request_validation():
    with pytest.raises(ValueError, match="prompt_len"):
        WorkloadRequest(0, 0, 0, 5)
    with pytest.raises(ValueError, match="arrival"):
        WorkloadRequest(0, -1, 3, 5)


def test_paged_request_must_fit_beside_watermark():
    req = [WorkloadRequest(0, 0, 100, 100)]          # 200 tokens -> 13 blocks of 16
    with pytest.raises(ValueError, match="never fit"):
        simulate(req, "paged", 16 * 13, watermark=0.1)
    rep = simulate(req, "paged", 16 * 13, watermark=0.0)
    assert rep.finished == 1 and rep.preemptions == 0


def test_single_request_timeline_is_exact():
    """One request, prompt 5, output 3, block 4: used 5,6,7,8 over four steps; blocks grow."""
    rep = simulate([WorkloadRequest(0, 0, 5, 3)], "paged", 64, block_size=4, watermark=0.0)
    assert rep.steps == 4
    assert rep.trace["used"].tolist() == [5, 6, 7, 8]
    assert rep.trace["reserved"].tolist() == [3, 2, 1, 0]     # tail of the second block
    assert rep.generated_tokens == 3
    contiguous = simulate([WorkloadRequest(0, 0, 5, 3)], "max", 64, max_seq_len=16)
    assert contiguous.trace["over_reserved"].tolist() == [8, 8, 8, 8]
    assert contiguous.trace["reserved"].tolist() == [3, 2, 1, 0]
