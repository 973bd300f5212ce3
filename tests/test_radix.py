"""TokenTrie: differential test against the reference PrefixCache. RadixCache: the block tree,
scope isolation."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from conftest import new_reader
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.core.cache_scope import SCOPE_FIELDS, CacheScope
from kvlab.core.radix_cache import RadixCache, scope_key
from kvlab.labs.invariants.structural import check_radix
from kvlab.labs.kv_snapshot import radix_snapshot
from kvlab.labs.token_trie import TokenTrie
from kvlab.reference import PrefixCache

# ---------------------------------------------------------------------------- TokenTrie
tokens = st.lists(st.integers(0, 3), max_size=8)
scopes = st.sampled_from([(), ("m", 1), ("m", 2)])
tables = st.lists(st.integers(0, 50), max_size=4)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), scopes, tokens, tables),
        st.tuples(st.just("longest"), scopes, tokens),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_differential_against_reference(operations):
    ref, trie = PrefixCache(), TokenTrie()
    for op in operations:
        if op[0] == "put":
            _, scope, toks, table = op
            ref.put(scope, toks, table)
            trie.put(scope, toks, table)
            assert trie.num_entries == len(ref.entries)
            assert trie.state_tuple() == tuple(sorted(
                (repr(tuple(s)), k, v) for (s, k), v in ref.entries.items()))
        else:
            _, scope, toks = op
            assert trie.longest(scope, toks) == ref.longest(scope, toks)


def test_reference_semantics_spelled_out():
    cache = TokenTrie()
    cache.put(("s",), [], (9,))
    assert cache.longest(("s",), [1]) == (0, ())  # an empty key never matches
    cache.put(("s",), [1, 2, 3], (1,))
    cache.put(("s",), [1, 2], (2,))
    assert cache.longest(("s",), [1, 2, 3, 4]) == (3, (1,))
    assert cache.longest(("s",), [1, 2, 4]) == (2, (2,))
    assert cache.longest(("s",), [1]) == (0, ())
    cache.put(("s",), [1, 2], ())  # overwrite with an empty table, still a hit of length 2
    assert cache.longest(("s",), [1, 2, 4]) == (2, ())
    assert cache.longest(("other",), [1, 2, 3]) == (0, ())
    assert cache.longest(["s"], (1, 2, 3)) == (3, (1,))  # scopes compare as tuples


# ---------------------------------------------------------------------------- scope isolation
BASE = CacheScope(
    model="llama-3-8b", weights_version="2024-04-18", tokenizer="llama3-tiktoken-128k",
    chat_template="llama3-chat-v1", adapter="none", rope="theta=500000,scaling=none",
    kv_dtype="bfloat16", kv_layout="paged-nhd-16", quant_schema="none", security_domain="tenant-a",
)


@pytest.mark.parametrize("name", SCOPE_FIELDS)
def test_no_hit_across_any_differing_scope_field(name):
    other = dataclasses.replace(BASE, **{name: getattr(BASE, name) + "-other"})
    assert other.key() != BASE.key()
    cache, trie = RadixCache(block_size=2), TokenTrie()
    prompt = list(range(9))
    cache.insert(BASE, prompt, [10, 11, 12, 13])
    trie.put(BASE, prompt, (10, 11, 12, 13))
    assert cache.match(BASE, prompt).num_tokens == 8
    assert trie.longest(BASE, prompt) == (9, (10, 11, 12, 13))
    assert cache.match(other, prompt).num_tokens == 0
    assert trie.longest(other, prompt) == (0, ())
    ref = PrefixCache()
    ref.put(scope_key(BASE), prompt, (1,))
    assert ref.longest(scope_key(other), prompt) == (0, ())


def test_scope_fields_are_required_and_checked():
    assert len(dataclasses.fields(CacheScope)) == len(SCOPE_FIELDS) == 10
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(CacheScope))
    with pytest.raises(TypeError):
        CacheScope(model="m")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="security_domain"):
        dataclasses.replace(BASE, security_domain="")
    with pytest.raises(TypeError, match="adapter"):
        dataclasses.replace(BASE, adapter=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.model = "x"  # type: ignore[misc]
    assert hash(BASE) == hash(dataclasses.replace(BASE))


# ---------------------------------------------------------------------------- RadixCache
def test_match_is_block_granular_and_leaves_the_last_token():
    cache = RadixCache(block_size=4)
    prompt = list(range(12))
    res = cache.insert("s", prompt, [7, 8, 9])
    assert res.new_blocks == (7, 8, 9)
    assert cache.match("s", prompt).num_tokens == 8  # 12 tokens: the last block is recomputed
    assert cache.match("s", prompt, leave_last=False).blocks == (7, 8, 9)
    assert cache.match("s", [*prompt, 99]).blocks == (7, 8, 9)
    assert cache.match("s", prompt[:6]).blocks == (7,)
    assert cache.match("s", [0, 1, 2, 5, 6]).blocks == ()
    assert cache.match("s", []).num_tokens == 0
    check_radix(cache)


def test_insert_first_writer_wins_and_validates():
    cache = RadixCache(block_size=2)
    cache.insert("s", [1, 2, 3, 4], [0, 1])
    res = cache.insert("s", [1, 2, 3, 4, 5, 6], [5, 6, 2])
    assert res.new_blocks == (2,)  # the path [1,2],[3,4] already exists with blocks 0, 1
    assert cache.match("s", [1, 2, 3, 4, 5, 6, 7]).blocks == (0, 1, 2)
    before = cache.state_tuple()
    for args in (("s", [1, 2], [3, 4]), ("s", [9, 9, 8, 8], [3, 3]), ("s", [7, 7], [1])):
        with pytest.raises(ValueError):
            cache.insert(*args)
        assert cache.state_tuple() == before
    check_radix(cache)


def test_lock_protects_and_eviction_is_lru_leaves_first():
    cache = RadixCache(block_size=1)
    cache.insert("s", [1, 2, 3], [10, 11, 12])  # path a
    cache.insert("s", [1, 5], [10, 15])  # branch b shares block 10
    cache.insert("t", [7], [20])  # another scope
    assert cache.evictable_blocks() == 5
    m = cache.match("s", [1, 2, 3, 0])
    assert m.blocks == (10, 11, 12) and m.unlocked_blocks == 3
    cache.lock(m.node)
    assert cache.evictable_blocks() == 2 and cache.protected_blocks() == 3
    check_radix(cache)
    # unlocked leaves in LRU order: [1,5] (older) then [7]; locked path untouched
    assert cache.evict(10) == [15, 20]
    assert cache.scopes() == [scope_key("s")]
    assert cache.match("s", [1, 2, 3, 0]).blocks == (10, 11, 12)
    cache.unlock(m.node)
    with pytest.raises(ValueError):
        cache.unlock(m.node)
    assert cache.evict(1) == [12]  # the tail goes first
    assert cache.evict(5) == [11, 10]
    assert cache.num_cached_blocks() == 0 and cache.scopes() == []
    with pytest.raises(ValueError):
        cache.lock(m.node)  # evicted handle
    check_radix(cache)


def test_unlock_refreshes_recency():
    cache = RadixCache(block_size=1)
    a = cache.insert("s", [1], [1]).node
    cache.insert("s", [2], [2])
    cache.lock(a)
    cache.unlock(a)  # [1] is now the most recently used
    assert cache.evict(1) == [2]


def test_tree_snapshot_is_plain_data():
    cache = RadixCache(block_size=2)
    cache.insert("s", [1, 2, 3, 4], [0, 1])
    cache.insert("s", [1, 2, 5, 6], [0, 2])
    snap = radix_snapshot(cache, "s")
    assert [n.block for n in snap.nodes] == [0, 1, 2]
    assert snap.nodes[1].parent_id == snap.nodes[0].node_id
    assert radix_snapshot(cache, "nothing").nodes == ()


def test_bad_arguments():
    with pytest.raises(ValueError):
        RadixCache(0)
    cache = RadixCache()
    with pytest.raises(TypeError):
        TokenTrie().put([[1]], [1], [1])  # unhashable scope
    with pytest.raises(TypeError):
        cache.match([[1]], [1])  # unhashable scope
    with pytest.raises(ValueError):
        cache.evict(-1)
    with pytest.raises(TypeError):
        cache.lock("not a node")


# ---------------------------------------------------------------------------- chapter 4 views
def test_radix_figure_highlights_the_hit_path():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.viz.radix import (
        RadixLookup,
        describe_lookup,
        hit_rate_figure,
        radix_figure,
    )

    cache = RadixCache(block_size=2)
    cache.insert("s", [1, 2, 3, 4], [0, 1])
    cache.insert("s", [1, 2, 5, 6], [0, 2])
    m = cache.match("s", [1, 2, 5, 6, 7])
    cache.lock(m.node)
    fig = radix_figure(radix_snapshot(cache, "s"), highlight=m.blocks)
    patches = {p.get_gid(): p for p in fig.axes[0].patches if p.get_gid()}
    assert {"node-0", "node-1", "node-2", "node-root"} <= set(patches)
    assert patches["node-2"].get_linewidth() > patches["node-1"].get_linewidth()
    plt.close(fig)
    fig = hit_rate_figure({"few-shot": {"computed_off": 10, "computed_on": 2, "hit_rate": 0.8}})
    plt.close(fig)
    # the lookup spelled out: hits, the miss where the walk stops, the partial tail
    found = RadixLookup(radix_snapshot(cache, "s"), (1, 2, 5, 7, 8), 2, (0,))
    lines = describe_lookup(found).splitlines()
    assert lines[0] == "2 of 5 tokens cached"
    assert [line.split()[0] for line in lines[1:]] == ["hit", "miss", "+"]
    last = describe_lookup(RadixLookup(found.tree, (1, 2, 3, 4), 2, (0,))).splitlines()
    assert last[2].split()[0] == "last"          # the last full block holds the last token


def test_radix_view_serves_and_looks_up_through_its_explore_function():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlab.core.kv_cache_manager import KVCacheManager
    from kvlab.viz.radix import RadixLookup, RadixView

    calls = []

    def explore(served, query):
        calls.append((served, query))
        kv = KVCacheManager(16, 2)
        for i, (scope, tokens) in enumerate(served):
            kv.admit(f"s{i}", scope, tokens, len(tokens))
            kv.commit(f"s{i}", tokens)
            kv.free(f"s{i}")
        hit = kv.prefix_cache.match(query[0], query[1])
        return RadixLookup(radix_snapshot(kv.prefix_cache, query[0]), query[1],
                           hit.num_tokens, hit.blocks)

    prompts = {"x": ("s", (1, 2, 3, 4, 5)), "y": ("s", (1, 2, 9, 9, 9)), "z": ("t", (1, 2, 3))}
    view = RadixView(explore, prompts, ["x", "y"], served=["y"], lookup="x")
    plt.close(view.figure())
    assert calls[-1] == ((prompts["y"],), prompts["x"])          # only what is served
    assert view.caption(["x", "y"], "x").startswith("4 of 5 tokens cached")
    assert view.caption(["x", "y"], "z").startswith("0 of 3")    # another scope, another tree
    assert view.widget() is not None
    twin = view.kernel_free()
    assert len(twin.frames) == 2 * 2 * 3                         # served on/off x lookups
    assert len({f.png for f in twin.frames}) > 4
    with pytest.raises(ValueError, match="unknown"):
        RadixView(explore, prompts, ["x", "w"])
    with pytest.raises(ValueError, match="lookup"):
        RadixView(explore, prompts, ["x"], lookup="w")


def _course_answers():
    """The instructor edition (course/answers.py), where the exercises' truths are computed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import seal_answers

    return seal_answers.load_answers()


def test_chapter4_exercise_checks():
    import random

    from kvlab.exercises import ch04
    from kvlab.exercises.ch04 import (
        CONVERSATION,
        FEW_SHOT,
        check_conversation_hit,
        check_prefill_tokens,
    )

    answers = _course_answers()
    conversation_hit, saved_prefill = answers.conversation_hit, ch04._measured_prefill

    # 40 + 24 tokens, the last sampled one without KV: 63 with KV, three full blocks
    assert conversation_hit(**CONVERSATION) == 48
    assert conversation_hit(40, 25, 10, 16) == 64          # one more token fills block four
    new_reader()
    assert "Correct" in check_conversation_hit(63, 48, "c")
    for wrong in ((64, 48, "c"), (63, 64, "c"), (63, 32, "c"), (63, 48, "a"), (63, 48, "b"),
                  (63, 48, "d"), (63, 48, "z"), (48, 63, "c")):
        new_reader()
        with pytest.raises(AssertionError):
            check_conversation_hit(*wrong)
    # a wrong prediction is recorded: trying the other letters (or the right one) after it
    # learns nothing
    for later in ((63, 48, "b"), (63, 48, "c"), (63, 48, "d")):
        assert "graded once" in check_conversation_hit(*later)
    new_reader()
    with pytest.raises(AssertionError, match="whole number"):
        check_conversation_hit(63, "48", "c")
    off, on = saved_prefill(**FEW_SHOT)
    assert off == 20 * 640 and on == 640 + 19 * (640 - 592)

    def rule(shared_tokens, question_tokens, requests, block_size):
        prompt = shared_tokens + question_tokens
        reused = shared_tokens // block_size * block_size
        return requests * prompt, prompt + (requests - 1) * (prompt - reused)

    assert "Correct" in check_prefill_tokens(rule)
    # the rule is the KV manager's on the workloads the check draws
    rng = random.Random(2)
    for case in [FEW_SHOT] + [ch04._draw_prefill_case(rng) for _ in range(60)]:
        assert list(rule(**case)) == list(saved_prefill(**case)), case
    assert not hasattr(ch04, "PREFILL_CASES")

    def no_rounding(shared_tokens, question_tokens, requests, block_size):
        prompt = shared_tokens + question_tokens
        return requests * prompt, prompt + (requests - 1) * question_tokens

    def right_on_the_shown_case_only(**case):
        return rule(**FEW_SHOT) if case == FEW_SHOT else (0, 0)

    for wrong in (no_rounding, right_on_the_shown_case_only, lambda **case: "12800"):
        with pytest.raises(AssertionError, match="does not agree") as err:
            check_prefill_tokens(wrong)
        assert "600" not in str(err.value) and " of " not in str(err.value).split(":")[0]
    with pytest.raises(AssertionError, match="pass a function"):
        check_prefill_tokens((off, on))


def test_chapter4_checks_do_not_print_the_answer():
    from kvlab.exercises.ch04 import check_conversation_hit, check_prefill_tokens

    messages = set()
    for wrong in ((63, 64, "c"), (63, 32, "c"), (64, 48, "c"), (62, 48, "c"), (63, 16, "c")):
        new_reader()
        with pytest.raises(AssertionError) as err:
            check_conversation_hit(*wrong)
        messages.add(str(err.value))
    # one verdict for the pair: no direction, no number, no hint at which one is off
    (text,) = messages
    assert "48" not in text and "63" not in text and "too" not in text
    for letter in "abd":  # a wrong letter says why it fails, never which letter is right
        new_reader()
        with pytest.raises(AssertionError) as err:
            check_conversation_hit(63, 48, letter)
        assert "(c)" not in str(err.value) and "never fed" not in str(err.value)

    def close(shared_tokens, question_tokens, requests, block_size):
        prompt = shared_tokens + question_tokens
        return requests * prompt, prompt + (requests - 1) * (prompt - shared_tokens)

    new_reader()
    with pytest.raises(AssertionError) as err:
        check_prefill_tokens(close)
    assert "too" not in str(err.value) and "1552" not in str(err.value)


def test_chapter4_block_index_debug_check():
    from kvlab.exercises.ch04 import BlockHashIndex, check_block_index

    index = BlockHashIndex(2)
    index.insert("s", [1, 2, 3, 4], [10, 11])
    assert index.match("s", [1, 2, 3, 4, 5]) == (4, (10, 11))
    assert index.match("s", [1, 2, 3, 4]) == (2, (10,))      # the last token is never covered
    assert index.match("t", [1, 2, 3, 4, 5]) == (0, ())      # scopes apart
    # the class as shipped: a lookup of [9, 9, 3, 4, 5] once [9, 9] is cached
    assert index.match("s", [9, 9, 3, 4, 5]) == (0, ())
    index.insert("s", [9, 9], [12])
    assert index.match("s", [9, 9, 3, 4, 5]) == (4, (12, 11))  # 11 holds [1, 2, 3, 4]
    with pytest.raises(AssertionError, match="another prefix"):
        check_block_index(BlockHashIndex)

    class Fixed(BlockHashIndex):
        def block_hash(self, parent, block_tokens, scope):
            return hash((parent, scope, block_tokens))

    class NoScope(BlockHashIndex):
        def block_hash(self, parent, block_tokens, scope):
            return hash((parent, block_tokens))

    class Forgetful(Fixed):
        def insert(self, scope, tokens, blocks):
            super().insert(scope, tokens, list(blocks)[:1])

    assert "Correct" in check_block_index(Fixed)
    with pytest.raises(AssertionError, match="another scope"):
        check_block_index(NoScope)
    with pytest.raises(AssertionError, match="missed"):
        check_block_index(Forgetful)
    with pytest.raises(AssertionError, match="derived from BlockHashIndex"):
        check_block_index(Fixed(2))


def test_chapter4_request_order_check():
    from kvlab.exercises.ch04 import (
        ORDERING,
        check_request_order,
        ordering_requests,
        prefill_for_order,
    )

    longest_prefix_first_order = _course_answers().longest_prefix_first_order

    requests = ordering_requests()
    arrival = list(requests)
    d = ORDERING
    one_group = d["prefix_tokens"] + d["question_tokens"] + (d["per_group"] - 1) * d[
        "question_tokens"]                        # the prefix once, then only the questions
    best = d["groups"] * one_group
    assert prefill_for_order(longest_prefix_first_order()) == best == 768
    assert prefill_for_order(arrival) > best       # interleaved groups evict one another
    assert "Correct" in check_request_order(sorted(arrival))
    with pytest.raises(AssertionError, match="cache-aware order computes less") as err:
        check_request_order(arrival)
    assert "768" not in str(err.value) and "too" not in str(err.value)
    with pytest.raises(AssertionError, match="exactly once"):
        check_request_order(arrival[:-1])
    with pytest.raises(AssertionError, match="exactly once"):
        check_request_order(arrival[:-1] + arrival[:1])


def test_listener_hears_inserts_evictions_and_clears_in_order():
    class Log:
        def __init__(self):
            self.calls = []

        def stored(self, nodes):
            self.calls.append(("stored", nodes[0].parent.is_root,
                               [n.block for n in nodes], [n.chunk for n in nodes]))
            for a, b in itertools.pairwise(nodes):
                assert b.parent is a

        def removed(self, node):
            assert not node.children and node.parent.children.get(node.chunk) is None
            self.calls.append(("removed", node.block))

        def cleared(self):
            self.calls.append(("cleared",))

    cache = RadixCache(block_size=2)
    cache.listener = log = Log()
    cache.insert(("s",), [1, 2, 3, 4], [10, 11])
    cache.insert(("s",), [1, 2, 3, 4, 5, 6], [10, 11, 12])     # only block 12 is new
    cache.insert(("s",), [1, 2, 3, 4], [10, 11])               # nothing new: no call
    assert log.calls == [("stored", True, [10, 11], [(1, 2), (3, 4)]),
                         ("stored", False, [12], [(5, 6)])]
    assert cache.evict(2) == [12, 11]
    assert log.calls[2:] == [("removed", 12), ("removed", 11)]
    result = cache.insert(("t",), [7, 8], [20])
    cache.lock(result.node)
    before = cache.state_tuple()
    with pytest.raises(ValueError, match="locked"):
        cache.clear()
    assert cache.state_tuple() == before and log.calls[-1][0] == "stored"
    cache.unlock(result.node)
    assert sorted(cache.clear()) == [10, 20]
    assert log.calls[-1] == ("cleared",) and cache.num_cached_blocks() == 0
    cache.listener = None
    cache.insert(("s",), [1, 2], [10])     # no listener: no call
    assert log.calls[-1] == ("cleared",)


def test_manager_reset_prefix_cache_frees_cached_blocks_once_idle():
    from kvlab.core.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(8, 2)
    kv.admit("a", (), [1, 2, 3, 4, 5], 6)
    kv.commit("a", [1, 2, 3, 4, 5])
    assert kv.reset_prefix_cache() is False and kv.prefix_cache.num_cached_blocks() == 2
    kv.free("a")
    assert kv.reset_prefix_cache() is True
    assert kv.prefix_cache.num_cached_blocks() == 0 and kv.num_allocatable_blocks() == 8
    assert kv.pool.num_free() == 8
