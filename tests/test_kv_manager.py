"""KVCacheManager: its contract (the docstring of kvlab/core/kv_manager.py and of each method),
scenario by scenario."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.core.block_pool import OutOfBlocks
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.labs.invariants import check_kv_manager
from kvlab.labs.kv_snapshot import snapshot_of
from kvlab.labs.paging import token_slots

S = ("model-a", "tenant-1")


def unchanged(mgr: KVCacheManager, fn, exc):
    before = mgr.state_tuple()
    with pytest.raises(exc):
        fn()
    assert mgr.state_tuple() == before
    check_kv_manager(mgr)


def test_admit_allocates_and_commit_caches_full_blocks():
    kv = KVCacheManager(8, 4)
    prompt = list(range(10))
    assert kv.lookup(S, prompt) == 0
    assert kv.blocks_needed(None, 11, S, prompt) == 3
    assert kv.admit("a", S, prompt, 11) == 0
    assert kv.block_table("a") == [0, 1, 2]
    assert token_slots(kv.block_table("a"), kv.block_size, 3, 6) == [3, 4, 5]
    kv.commit("a", prompt)
    snap = snapshot_of(kv)
    assert snap.cached_blocks == 2 and snap.protected_blocks == 2 and snap.evictable_blocks == 0
    assert snap.block_states[:3] == ("shared", "shared", "exclusive")  # cache + a
    assert snap.refcounts[:3] == (2, 2, 1)
    check_kv_manager(kv)


def test_prefix_hit_reuses_and_locks_blocks():
    kv = KVCacheManager(8, 4)
    prompt = list(range(10))
    kv.admit("a", S, prompt, 11)
    kv.commit("a", prompt)
    kv.free("a")
    snap = snapshot_of(kv)
    assert snap.block_states[:3] == ("cached", "cached", "free")
    assert snap.evictable_blocks == 2 and snap.free_blocks == 6
    second = [*prompt, 50, 51]
    assert kv.lookup(S, second) == 8
    # 4 blocks in all, 2 cached: 2 fresh + the 2 evictable cached ones it will lock
    assert kv.blocks_needed(None, 13, S, second) == 4
    assert kv.admit("b", S, second, 13) == 8
    assert kv.block_table("b")[:2] == [0, 1]
    assert snapshot_of(kv).evictable_blocks == 0
    assert snapshot_of(kv).hit_tokens == 8
    check_kv_manager(kv)


def test_last_token_always_recomputed():
    kv = KVCacheManager(8, 4)
    prompt = list(range(8))  # exactly two blocks
    kv.admit("a", S, prompt, 8)
    kv.commit("a", prompt)
    kv.free("a")
    assert kv.lookup(S, prompt) == 4  # not 8: the last token's logits are needed
    assert kv.admit("b", S, prompt, 9) == 4
    # b recomputes block 1 into a private duplicate; committing keeps the cached one canonical
    kv.commit("b", prompt)
    assert kv.prefix_cache.match(S, prompt, leave_last=False).blocks == (0, 1)
    check_kv_manager(kv)
    kv.free("b")
    check_kv_manager(kv)
    assert snapshot_of(kv).cached_blocks == 2


def test_scopes_never_share():
    kv = KVCacheManager(8, 4)
    prompt = list(range(9))
    kv.admit("a", S, prompt, 9)
    kv.commit("a", prompt)
    assert kv.lookup(("model-a", "tenant-2"), prompt) == 0
    assert kv.admit("b", ("model-a", "tenant-2"), prompt, 9) == 0
    check_kv_manager(kv)


def test_fork_shares_and_grow_copies_on_write():
    kv = KVCacheManager(10, 4)
    prompt = list(range(6))
    kv.admit("p", S, prompt, 7)
    kv.commit("p", prompt)
    for child in ("c1", "c2"):
        kv.fork("p", child)
    assert snapshot_of(kv).refcounts[:2] == (4, 3)  # cache + 3 sequences; tail block shared by 3
    check_kv_manager(kv)
    # each sequence writes its first sampled token at position 6 (inside the shared tail block)
    assert kv.blocks_needed("c1", 7, write_from=6) == 1
    copies = kv.grow("c1", 7, 6)
    assert copies == [(1, 2)]
    assert snapshot_of(kv).block_states[1:3] == ("pending_copy", "pending_copy")
    check_kv_manager(kv)
    kv.complete_copies(copies)
    copies2 = kv.grow("c2", 7, 6)
    assert copies2 == [(1, 3)]
    kv.complete_copies(copies2)
    assert kv.grow("p", 7, 6) == []  # the last owner writes in place
    assert kv.block_table("p") == [0, 1]
    assert kv.block_table("c1") == [0, 2] and kv.block_table("c2") == [0, 3]
    check_kv_manager(kv)
    # growing into a new block allocates without copies
    assert kv.grow("c1", 9, 8) == [] and len(kv.block_table("c1")) == 3
    for rid in ("p", "c1", "c2"):
        assert kv.free(rid)
        assert not kv.free(rid)  # idempotent
    check_kv_manager(kv)
    assert snapshot_of(kv).count("cached") == 1


def test_free_during_pending_copy_parks_blocks():
    kv = KVCacheManager(4, 2)
    kv.admit("p", S, [1, 2, 3], 3)
    kv.fork("p", "c")
    copies = kv.grow("c", 4, 2)
    kv.free("p")
    kv.free("c")
    check_kv_manager(kv)
    assert snapshot_of(kv).free_blocks == 2  # the two fenced blocks are parked
    kv.complete_copies(copies)
    assert snapshot_of(kv).free_blocks == 4
    check_kv_manager(kv)


def test_eviction_under_pressure_keeps_locked_paths():
    kv = KVCacheManager(7, 2)
    a = [1, 2, 3, 4, 5]
    kv.admit("a", S, a, 5)
    kv.commit("a", a)  # caches blocks 0, 1
    kv.free("a")
    b = [1, 2, 3, 4, 9, 9, 9]
    assert kv.admit("b", S, b, 7) == 4  # locks blocks 0, 1 and takes 2 more
    c = [7, 7, 7, 7, 7]
    kv.admit("c", ("other",), c, 5)  # 3 blocks
    kv.commit("c", c)
    kv.free("c")
    snap = snapshot_of(kv)
    assert snap.evictable_blocks == 2 and snap.free_blocks == 1
    assert kv.num_allocatable_blocks() == 3
    kv.admit("d", ("x",), [5, 5, 5], 3)  # the free block, then c's LRU leaf; never b's path
    assert kv.lookup(S, b) == 4
    assert kv.lookup(("other",), c) == 2
    check_kv_manager(kv)
    unchanged(kv, lambda: kv.admit("e", ("x",), [6, 6, 6], 3), OutOfBlocks)
    assert kv.blocks_needed(None, 3, ("x",), [6, 6, 6]) == 2 > kv.num_allocatable_blocks()


def test_errors_leave_manager_unchanged():
    kv = KVCacheManager(4, 2)
    kv.admit("a", S, [1, 2, 3], 3)
    kv.commit("a", [1, 2, 3])
    unchanged(kv, lambda: kv.admit("a", S, [1], 1), ValueError)
    unchanged(kv, lambda: kv.admit("b", S, [1, 2, 3], 2), ValueError)  # num_tokens <= cached
    unchanged(kv, lambda: kv.admit("b", S, [9] * 20, 20), OutOfBlocks)
    unchanged(kv, lambda: kv.admit(3, S, [1], 1), TypeError)
    unchanged(kv, lambda: kv.grow("zz", 4, 0), KeyError)
    unchanged(kv, lambda: kv.grow("a", 4, 5), ValueError)
    unchanged(kv, lambda: kv.grow("a", 100, 3), OutOfBlocks)
    unchanged(kv, lambda: kv.commit("a", [1, 2, 3, 4, 5]), ValueError)
    unchanged(kv, lambda: kv.commit("zz", [1]), KeyError)
    unchanged(kv, lambda: kv.fork("a", "a"), ValueError)
    unchanged(kv, lambda: kv.fork("zz", "y"), KeyError)
    unchanged(kv, lambda: kv.complete_copies([(0, 1)]), ValueError)
    unchanged(kv, lambda: kv.block_table("zz"), KeyError)
    assert kv.free("zz") is False


def test_preemption_by_recompute_hits_committed_blocks():
    kv = KVCacheManager(16, 4)
    prompt = list(range(10))
    kv.admit("r", S, prompt, 11)
    kv.commit("r", prompt)
    outputs = [100, 101, 102, 103, 104, 105]
    kv.grow("r", 16, 10)
    kv.commit("r", prompt + outputs)  # 16 tokens = 4 full blocks cached
    kv.free("r")  # preempted
    again = prompt + outputs
    assert kv.admit("r", S, again, 17) == 12
    check_kv_manager(kv)


def test_caching_disabled():
    kv = KVCacheManager(4, 2, enable_prefix_caching=False)
    assert kv.prefix_cache is None
    kv.admit("a", S, [1, 2, 3], 3)
    kv.commit("a", [1, 2, 3])
    kv.free("a")
    assert kv.lookup(S, [1, 2, 3]) == 0
    assert snapshot_of(kv).free_blocks == 4
    assert kv.admit("b", S, [1, 2, 3], 3) == 0
    assert kv.blocks_needed(None, 3, S, [1, 2, 3]) == 2
    check_kv_manager(kv)


def test_snapshot_is_frozen_plain_data():
    kv = KVCacheManager(4, 2)
    kv.admit("a", S, [1, 2, 3], 3)
    snap = snapshot_of(kv)
    with pytest.raises(AttributeError):
        snap.num_blocks = 3  # type: ignore[misc]
    assert snap.tables == {"a": (0, 1)}
    assert set(snap.block_states) <= {"free", "exclusive", "shared", "cached", "pending_copy"}
    assert snap.hit_rate == 0.0


def test_invariant_checker_names_the_broken_rule():
    kv = KVCacheManager(4, 2)
    kv.admit("a", S, [1, 2, 3], 3)
    kv.pool._refcount[0] += 1  # corrupt on purpose
    with pytest.raises(AssertionError, match="refcount == owners"):
        check_kv_manager(kv)
    kv.pool._refcount[0] -= 1
    kv._tables["a"].append(3)  # a table that lists a block the pool never gave it
    with pytest.raises(AssertionError, match="refcount == live owners"):
        check_kv_manager(kv)


# ---------------------------------------------------------------------------- chapter 3 views
def test_fork_scenario_and_pool_figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.viz.blocks import RefcountView, fork_scenario, pool_figure
    from kvlab.viz.style import BLOCK_STATE_COLORS

    cached = fork_scenario(n=3, enable_prefix_caching=True)   # chapter 4's look ahead
    states = [s for _, snap in cached for s in snap.block_states]
    assert {"free", "exclusive", "shared", "cached", "pending_copy"} <= set(states)
    steps = fork_scenario(n=3)                                # chapter 3: no prefix cache
    states = [s for _, snap in steps for s in snap.block_states]
    assert {"free", "exclusive", "shared", "pending_copy"} <= set(states)
    assert "cached" not in states
    assert set(steps[-1][1].block_states) == {"free"}
    view = RefcountView(steps)
    assert steps[view.start][1].pending_copies
    fig = pool_figure(steps[view.start][1])
    patches = {p.get_gid(): p for p in fig.axes[0].patches if p.get_gid()}
    snap = steps[view.start][1]
    for b in range(snap.num_blocks):
        want = matplotlib.colors.to_rgba(BLOCK_STATE_COLORS[snap.block_states[b]])
        assert patches[f"block-{b}"].get_facecolor() == want
    assert "table-s2-2" in patches
    plt.close(fig)
    assert view.widget() is not None


def test_fork_scenario_abort_mid_copy_and_explorer(monkeypatch):
    import itertools

    import matplotlib

    matplotlib.use("Agg")
    from kvlab.viz.blocks import (
        FIRST_TOKEN_STEP,
        FORK_GRID,
        FORK_STEPS,
        FORK_TWIN_STEPS,
        fork_explorer,
        fork_kernel_free,
        fork_scenario,
        pool_size,
    )
    from kvlab.viz.kernel_free import EXPORT_ENV, min_display_width

    steps = fork_scenario(n=3, abort_mid_copy=True)
    caption, aborted = steps[4]
    assert caption.startswith("s2 aborted mid-copy")
    (src, first), (_, second) = aborted.pending_copies
    assert src == 2 and aborted.refcounts[first] == 0             # s2's target: no owner ...
    assert aborted.block_states[first] == "pending_copy"          # ... but still fenced
    assert "s2" not in aborted.tables
    _, done = steps[5]
    assert done.block_states[first] == "free" and not done.pending_copies
    assert done.block_states[second] == "exclusive"
    assert set(steps[-1][1].block_states) == {"free"}
    with pytest.raises(ValueError, match="abort_mid_copy"):
        fork_scenario(n=1, abort_mid_copy=True)
    # every setting the explorer offers runs, in the same number of steps
    for n, prompt, bs, abort in itertools.product(range(2, 7), range(1, 25), (2, 4, 8),
                                                 (False, True)):
        run = fork_scenario(n=n, prompt_len=prompt, block_size=bs, abort_mid_copy=abort,
                            num_blocks=pool_size(n, prompt, bs))
        assert len(run) == FORK_STEPS
        caption, first = run[FIRST_TOKEN_STEP]
        assert caption.startswith("first token")
        copies = first.pending_copies
        assert len(copies) == (0 if prompt % bs == 0 else n - 1)   # a full last block: no copy
        if abort:    # the caption says what happened: a fenced target only if a copy ran
            assert ("mid-copy" in run[4][0]) == bool(copies)
        assert ("fences lifted" in run[4 + abort][0]) == bool(copies)
    box = fork_explorer()
    controls = [c for row in box.children[:2] for c in row.children]
    assert [c.description for c in controls] == ["n", "prompt", "block size",
                                                 "abort a child mid-copy", "step"]
    controls[3].value = True                                      # redraws, no error
    controls[4].value = FORK_STEPS - 1
    monkeypatch.setenv(EXPORT_ENV, "1")
    kf = fork_kernel_free()
    # the twin moves the controls "Things to try" names: prompt length, block size, abort
    assert set(kf.controls) == {"prompt_len", "block_size", "abort_mid_copy", "step"}
    assert any(p % q == 0 for p in FORK_GRID["prompt_len"] for q in FORK_GRID["block_size"])
    assert any(p % q for p in FORK_GRID["prompt_len"] for q in FORK_GRID["block_size"])
    frames = (len(FORK_GRID["prompt_len"]) * len(FORK_GRID["block_size"])
              * len(FORK_GRID["abort_mid_copy"]) * len(FORK_TWIN_STEPS))
    assert len(kf.frames) == frames and frames <= 48
    for frame in kf.frames:          # every frame fits a phone's column at 9 px text or more
        assert 0 < min_display_width(frame.width, frame.min_text_px) <= 340, frame.key


def test_chapter3_exercise_checks():
    from kvlab.exercises._common import NotYetAnswered
    from kvlab.exercises.ch03 import (
        SAMPLING,
        WRITE_ORDER,
        _sampling_blocks,
        check_cow,
        check_double_release,
        check_sampling_blocks,
        check_write_order,
        write_order_outcome,
    )
    from kvlab.reference import BlockAllocator

    assert "Correct" in check_cow(BlockAllocator.cow)

    def decrement_first(alloc, table, i):  # the classic bug: mutate, then allocate
        table = list(table)
        old = table[i]
        if alloc.refcount[old] == 1:
            return table, None
        alloc.refcount[old] -= 1
        table[i] = alloc.allocate()
        return table, (old, table[i])

    with pytest.raises(AssertionError, match=r"reference does not do|differ from the reference"):
        check_cow(decrement_first)
    with pytest.raises(NotYetAnswered):
        check_cow(...)
    # 730 // 16 = 45 full prompt blocks once, then each sample's own blocks past them:
    # ceil((730 + o) / 16) - 45 for o in (90, 70, 6, 22, 90) = 7, 5, 1, 2, 7; without sharing
    # 52 + 50 + 46 + 47 + 52
    # 4 copies: every sample's first token lands in the shared partial block (730 % 16 = 10);
    # all but the last writer copy it
    assert SAMPLING["output_tokens"] == (90, 70, 6, 22, 90)
    assert _sampling_blocks(**SAMPLING) == (45 + 22, 247, 4) == (67, 247, 4)
    assert _sampling_blocks(730, (90,) * 5, 16) == (45 + 5 * 7, 5 * 52, 4)  # equal lengths
    assert _sampling_blocks(720, (9, 9), 16)[2] == 0             # a full last block: no copy
    # the exercise asks for a function; the printed triple returned for every request, one
    # number off, or the equal-length answer: one verdict, which names no number
    verdicts = set()
    for triple in ((67, 247, 4), (66, 247, 4), (67, 260, 4), (67, 247, 5), (80, 260, 4)):
        with pytest.raises(AssertionError) as err:
            check_sampling_blocks(lambda prompt_tokens, output_tokens, block_size, t=triple: t)
        verdicts.add(str(err.value))
    assert len(verdicts) == 1
    message = verdicts.pop()
    assert "too" not in message and not any(str(v) in message for v in (67, 247, 4))
    with pytest.raises(ValueError, match="one token each"):
        _sampling_blocks(730, (90, 0), 16)
    # the chapter never imports the check's truth
    from pathlib import Path
    chapter = Path(__file__).parents[1] / "notebooks" / "03-refcounts-cow.md"
    assert "sampling_blocks" not in chapter.read_text().replace("check_sampling_blocks", "")
    # exercise 3: parent first -> p and s1 copy, s2 (last owner) writes in place
    assert write_order_outcome(**WRITE_ORDER) == (2, "s2")
    assert write_order_outcome(3, 10, 4, ("s2", "s1", "p")) == (2, "p")   # the chapter's order
    with pytest.raises(ValueError, match="partial block"):                # full block: no copy
        write_order_outcome(3, 8, 4, ("p", "s1", "s2"))
    assert "Correct" in check_write_order(2, "s2")
    for copies, who in ((3, "s2"), (1, "s2"), (2, "p"), (2, "s1")):
        with pytest.raises(AssertionError) as err:
            check_write_order(copies, who)
        message = str(err.value)
        assert "s2" not in message and "2 copies" not in message.replace(f"{copies} copies", "")
        assert "many" not in message and "few" not in message       # never which way
    with pytest.raises(AssertionError, match="not one of"):
        check_write_order(2, "s3")
    with pytest.raises(NotYetAnswered):
        check_write_order(..., "p")
    # check_double_release (kept for teachers): a wrong letter says why it fails, never "c"
    assert "Correct" in check_double_release("c")
    for wrong in "abd":
        with pytest.raises(AssertionError, match=rf"\({wrong}\) fails") as err:
            check_double_release(wrong)
        assert "(c)" not in str(err.value) and "no-op" not in str(err.value)
    with pytest.raises(AssertionError, match="one of the letters"):
        check_double_release("e")


def test_chapter3_cow_counterexample_check():
    from kvlab.exercises.ch03 import check_cow_counterexample
    from kvlab.reference import BlockAllocator

    def full_pool_shared():
        alloc = BlockAllocator(2)
        table = [alloc.allocate()]
        alloc.share(table)
        alloc.allocate()
        return alloc, table, 0

    def roomy_shared():                      # the suspect behaves on the ordinary path
        alloc = BlockAllocator(3)
        table = [alloc.allocate()]
        alloc.share(table)
        return alloc, table, 0

    def exclusive():
        alloc = BlockAllocator(2)
        return alloc, [alloc.allocate()], 0

    assert "lost a reference" in check_cow_counterexample(full_pool_shared)
    for case in (roomy_shared, exclusive):
        with pytest.raises(AssertionError, match="does not show here") as err:
            check_cow_counterexample(case)
        assert "full" not in str(err.value) and "decrement" not in str(err.value)
    shared = BlockAllocator(2)
    with pytest.raises(AssertionError, match="new BlockAllocator"):
        check_cow_counterexample(lambda: (shared, [0], 0))

    def bad_index(index, table=(0,)):   # the versions differ, but only in input checking
        def case():
            alloc = BlockAllocator(2)
            alloc.allocate()
            return alloc, list(table), index
        return case

    for case in (bad_index(-1), bad_index(1), bad_index(0, table=(1,))):
        with pytest.raises(AssertionError, match="valid case"):
            check_cow_counterexample(case)


def test_chapter3_max_samples_check():
    from kvlab.exercises.ch03 import SAMPLES_DESIGN, check_max_samples, samples_fit

    d = SAMPLES_DESIGN
    full = d["prompt_tokens"] // d["block_size"]                       # 18 shared blocks
    private = -(-(d["prompt_tokens"] + d["output_tokens"]) // d["block_size"]) - full   # 7
    truth = (d["num_blocks"] - full) // private
    assert truth == 6 and samples_fit(6, **d) and not samples_fit(7, **d)
    assert "Correct" in check_max_samples(truth)
    for wrong in (3, 5, 7):                                       # same verdict either way
        with pytest.raises(AssertionError) as err:
            check_max_samples(wrong)
        assert str(err.value).startswith(f"n = {wrong} is not the largest")
        assert "6" not in str(err.value) and "too" not in str(err.value)
    with pytest.raises(AssertionError, match="positive whole number"):
        check_max_samples(0)


def test_commit_never_caches_a_block_whose_copy_is_pending():
    kv = KVCacheManager(8, 2, enable_prefix_caching=True)
    kv.admit("p", S, [1, 2, 3], 3)  # blocks 0 (full) and 1 (partial)
    kv.commit("p", [1, 2, 3])       # block 0 is cached before the fork
    kv.fork("p", "c")
    copies = kv.grow("c", 4, 3)  # c copies the partial block before writing position 3
    assert copies == [(1, 2)]
    kv.commit("c", [1, 2, 3, 9])  # KV of position 3 is not there yet: the copy is pending
    assert kv.prefix_cache.match(S, [1, 2, 3, 9, 0]).num_tokens == 2
    check_kv_manager(kv)
    kv.complete_copies(copies)
    kv.commit("c", [1, 2, 3, 9])
    assert kv.prefix_cache.match(S, [1, 2, 3, 9, 0]).num_tokens == 4
    check_kv_manager(kv)


def test_core_memory_modules_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, kvlab.core.kv_cache_manager, kvlab.labs.invariants.structural, "
            "kvlab.core.radix_cache; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fork_before_commit_caches_shared_blocks_only_once_unshared():
    """A child forked before the parent cached its full blocks shares them uncached. The cache
    indexes a block only once its committer holds it alone, so nothing shared is cached (and
    nothing a live request uses can be evicted); when the parent is gone, the child's next
    commit caches them under its own lock."""
    kv = KVCacheManager(25, 2)
    tokens = list(range(100, 120))
    kv.admit("r0", (), tokens[:10], 10)
    kv.fork("r0", "r1")
    kv.grow("r0", 11, 10)
    kv.commit("r0", tokens[:11])
    check_kv_manager(kv)
    assert snapshot_of(kv).cached_blocks == 0 and kv.locked_node("r0") is None
    kv.free("r0")
    check_kv_manager(kv)
    shared = kv.block_table("r1")
    kv.commit("r1", tokens[:10])
    check_kv_manager(kv)
    assert kv.locked_node("r1").depth == 5
    assert all(not kv.prefix_cache.is_evictable(b) for b in shared)
    kv.admit("x", ("other",), list(range(38)), 38)   # memory pressure evicts nothing in use
    check_kv_manager(kv)
    assert kv.block_table("r1") == shared


def _fork_before_commit(bs: int, prompt_len: int, children: int, commit_order: list[int],
                        free_order: list[int]) -> None:
    """Fork ``children`` samples of a request before anyone caches its full blocks, each sample
    writes its own next token, then they commit and free in the given orders. After every call
    the invariants hold, and memory pressure (a big admission) never evicts a block in use."""
    num_blocks = (children + 1) * (prompt_len // bs + 2) + 4
    kv = KVCacheManager(num_blocks, bs)
    prompt = list(range(1, prompt_len + 1))
    ids = [f"r{i}" for i in range(children + 1)]
    kv.admit(ids[0], (), prompt, prompt_len)
    for rid in ids[1:]:
        kv.fork(ids[0], rid)
        check_kv_manager(kv)
    for rid in ids:
        kv.complete_copies(kv.grow(rid, prompt_len + 1, prompt_len))
        check_kv_manager(kv)
    for i in commit_order:
        kv.commit(ids[i], [*prompt, 100 + i])
        check_kv_manager(kv)
    for i in free_order:
        tables = {r: kv.block_table(r) for r in ids if kv.has(r) and r != ids[i]}
        kv.free(ids[i])
        check_kv_manager(kv)
        spare = kv.num_allocatable_blocks()
        if spare:  # evict everything evictable; the live requests keep their blocks
            kv.admit("pressure", ("other",), list(range(spare * bs)), spare * bs)
            check_kv_manager(kv)
            assert {r: kv.block_table(r) for r in tables} == tables
            kv.free("pressure")
            check_kv_manager(kv)
    assert kv.num_allocatable_blocks() == num_blocks


@settings(max_examples=150, deadline=None)
@given(bs=st.sampled_from([1, 2, 4]), prompt_len=st.integers(1, 12), data=st.data())
def test_fork_before_commit_any_order(bs, prompt_len, data):
    children = data.draw(st.integers(1, 3))
    order = list(range(children + 1))
    commit_order = data.draw(st.permutations(order))
    commit_order = commit_order[:data.draw(st.integers(1, children + 1))]
    free_order = data.draw(st.permutations(order))
    _fork_before_commit(bs, prompt_len, children, commit_order, free_order)


def test_fork_before_commit_check_is_not_vacuous(monkeypatch):
    """A commit that also caches blocks other requests share breaks an invariant: the sharers'
    locks do not cover them, so they sit on an evictable path while in use."""
    monkeypatch.setattr(KVCacheManager, "_cacheable",
                        lambda self, block: not self.pool.is_fenced(block))
    with pytest.raises(AssertionError, match=r"cached on an unlocked \(evictable\) node"):
        _fork_before_commit(2, 10, 1, [0], [0, 1])


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_blocks": 0, "block_size": 2}, "num_blocks"),
    ({"num_blocks": -3, "block_size": 2}, "num_blocks"),
    ({"num_blocks": True, "block_size": 2}, "num_blocks"),
    ({"num_blocks": 4.0, "block_size": 2}, "num_blocks"),
    ({"num_blocks": 4, "block_size": True}, "block_size"),
    ({"num_blocks": 4, "block_size": 0}, "block_size"),
    ({"num_blocks": 4, "block_size": "2"}, "block_size"),
])
def test_constructor_names_the_bad_size(kwargs, field):
    with pytest.raises(ValueError, match=f"{field} must be a positive int"):
        KVCacheManager(**kwargs)


def test_bool_positions_and_sizes_are_rejected_unchanged():
    kv = KVCacheManager(8, 2)
    kv.admit("a", (), [1, 2, 3], 3)
    with pytest.raises(ValueError):
        kv.blocks_for(True)
    unchanged(kv, lambda: kv.grow("a", True, 0), ValueError)
    unchanged(kv, lambda: kv.grow("a", 4, False), ValueError)

