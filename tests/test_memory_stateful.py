"""Hypothesis state machines over the KV memory layer, with the invariant checker after every step.

* ``PoolMachine`` drives BlockPool (allocate, share, fork, cow, complete, release) against a
  model of owners.
* ``RadixMachine`` drives TokenTrie (put/longest against the reference PrefixCache) and
  RadixCache (insert, match, lock, unlock, evict against a brute-force model of cached paths).
* ``ManagerMachine`` drives KVCacheManager like an engine would (admit, chunked prefill and
  decode via grow, delayed copies, commit, fork, free, preemption + re-admission) while
  simulating the KV payload itself: every slot records the token whose KV it holds. After every
  step each request must read back exactly its own tokens, and every cached block must hold the
  tokens of its path — so a missed copy-on-write or a wrongly reused block is caught, not just a
  miscount.

Every rule that raises checks the state is unchanged (state_tuple before == after).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvlab.core.block_pool import BlockPool, OutOfBlocks
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.radix_cache import RadixCache
from kvlab.labs.invariants.structural import check_kv_manager, check_pool, check_radix
from kvlab.labs.kv_snapshot import radix_nodes
from kvlab.labs.paging import token_slots
from kvlab.labs.token_trie import TokenTrie
from kvlab.reference import PrefixCache

SETTINGS = settings(max_examples=40, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def expect_unchanged(obj, fn, *exceptions):
    """Run ``fn``; if it raises one of ``exceptions``, the state must be untouched."""
    before = obj.state_tuple()
    try:
        return True, fn()
    except exceptions:
        assert obj.state_tuple() == before, "a failed call changed the state"
        return False, None


# ============================================================================ pool
class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(8)
        self.owners: dict[int, set[str]] = {b: set() for b in range(8)}
        self.tables: dict[str, list[int]] = {}
        self.pending: list[tuple[int, int]] = []
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        rid = self._new_id()
        ok, blocks = expect_unchanged(self.pool, lambda: self.pool.allocate(n, rid), OutOfBlocks)
        if ok:
            assert len(blocks) == n and all(not self.owners[b] for b in blocks)
            self.tables[rid] = blocks
            for b in blocks:
                self.owners[b].add(rid)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tables)))
        child = self._new_id()
        self.pool.fork(self.tables[parent], parent, child)
        self.tables[child] = list(self.tables[parent])
        for b in self.tables[child]:
            self.owners[b].add(child)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def share_invalid(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tables)))
        extra = data.draw(st.integers(0, 7))
        table = [*self.tables[rid], extra]
        if len(set(table)) == len(table) and self.owners[extra]:
            return  # that would be a valid share; covered by fork
        expect_unchanged(self.pool, lambda: self.pool.share(table, rid), ValueError)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def cow(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables[rid]
        if not table:
            return
        idx = data.draw(st.lists(st.sampled_from(range(len(table))), unique=True, max_size=3))
        blocks = [table[i] for i in idx]
        ok, copies = expect_unchanged(self.pool, lambda: self.pool.cow(blocks, rid), OutOfBlocks)
        if not ok:
            return
        shared = [b for b in blocks if len(self.owners[b]) > 1]
        assert [old for old, _ in copies] == shared
        for old, new in copies:
            self.owners[old].discard(rid)
            assert not self.owners[new]
            self.owners[new].add(rid)
            table[table.index(old)] = new
            self.pending.append((old, new))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def complete(self, data):
        k = data.draw(st.integers(1, len(self.pending)))
        done, self.pending = self.pending[:k], self.pending[k:]
        self.pool.complete_copies(done)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), twice=st.booleans())
    def release(self, data, twice):
        rid = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables.pop(rid)
        self.pool.release(table, rid)
        if twice:  # idempotent per owner
            before = self.pool.state_tuple()
            assert self.pool.release(table, rid) == []
            assert self.pool.state_tuple() == before
        for b in table:
            self.owners[b].discard(rid)

    @invariant()
    def consistent(self):
        check_pool(self.pool)
        fenced = {b for pair in self.pending for b in pair}
        for b in range(8):
            assert self.pool.owners(b) == self.owners[b]
            assert self.pool.is_free(b) == (not self.owners[b] and b not in fenced)


# ============================================================================ radix
TOK = st.lists(st.integers(0, 2), min_size=0, max_size=9)
SCOPE = st.sampled_from([("a",), ("b",)])


class RadixMachine(RuleBasedStateMachine):
    locks = Bundle("locks")

    def __init__(self):
        super().__init__()
        self.bs = 2
        self.cache = RadixCache(self.bs)
        self.trie = TokenTrie()
        self.ref = PrefixCache()
        self.paths: dict[tuple, dict[tuple, int]] = {}  # scope -> {block-aligned prefix: block}
        self.next_block = 0
        self.locked_blocks: list[tuple[int, ...]] = []

    @rule(scope=SCOPE, toks=TOK, table=st.lists(st.integers(0, 9), max_size=3))
    def put(self, scope, toks, table):
        self.ref.put(scope, toks, table)
        self.trie.put(scope, toks, table)

    @rule(scope=SCOPE, toks=TOK)
    def longest(self, scope, toks):
        assert self.trie.longest(scope, toks) == self.ref.longest(scope, toks)

    @rule(scope=SCOPE, toks=TOK)
    def insert(self, scope, toks):
        n = len(toks) // self.bs
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        res = self.cache.insert(scope, toks, blocks)
        model = self.paths.setdefault(scope, {})
        adopted = []
        for i in range(n):
            key = tuple(toks[:(i + 1) * self.bs])
            if key not in model:
                model[key] = blocks[i]
                adopted.append(blocks[i])
        assert list(res.new_blocks) == adopted

    @rule(scope=SCOPE, toks=TOK, leave_last=st.booleans())
    def match(self, scope, toks, leave_last):
        m = self.cache.match(scope, toks, leave_last=leave_last)
        model = self.paths.get(scope, {})
        limit = len(toks) - 1 if leave_last else len(toks)
        expect = []
        for i in range(max(0, limit) // self.bs):
            block = model.get(tuple(toks[:(i + 1) * self.bs]))
            if block is None:
                break
            expect.append(block)
        assert list(m.blocks) == expect and m.num_tokens == len(expect) * self.bs

    @rule(target=locks, scope=SCOPE, toks=TOK)
    def lock(self, scope, toks):
        m = self.cache.match(scope, toks, leave_last=False)
        self.cache.lock(m.node)
        self.locked_blocks.append(m.blocks)
        return m

    @rule(m=consumes(locks))
    def unlock(self, m):
        self.cache.unlock(m.node)
        self.locked_blocks.remove(m.blocks)

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        evictable = self.cache.evictable_blocks()
        victims = self.cache.evict(n)
        assert len(victims) == min(n, evictable)
        protected = {b for blocks in self.locked_blocks for b in blocks}
        assert not protected & set(victims), "a locked path was evicted"
        for model in self.paths.values():
            for key, block in list(model.items()):
                if block in victims:
                    del model[key]
        # leaves first: an evicted block never leaves a cached descendant behind
        for model in self.paths.values():
            for key in model:
                for j in range(self.bs, len(key), self.bs):
                    assert key[:j] in model

    @invariant()
    def consistent(self):
        check_radix(self.cache)


# ============================================================================ manager
PROMPT_HEADS = ([1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [9, 9])


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv: KVCacheManager | None = None

    @initialize(bs=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 14),
                caching=st.booleans())
    def setup(self, bs, num_blocks, caching):
        self.bs = bs
        self.kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=caching)
        self.payload: dict[int, int] = {}  # physical slot -> token whose KV it holds
        self.tokens: dict[str, list[int]] = {}  # running requests: prompt + outputs
        self.computed: dict[str, int] = {}
        self.scope: dict[str, tuple] = {}
        self.work: dict[str, tuple[list, int, int]] = {}  # rid -> (copies, write_from, end)
        self.orphan_copies: list[tuple[int, int]] = []
        self.preempted: list[tuple[str, tuple, list[int]]] = []
        self.uncommitted: set[str] = set()  # written but not yet committed to the cache
        self.next_id = 0

    def _rid(self) -> str:
        self.next_id += 1
        return f"q{self.next_id}"

    def _idle(self):
        return sorted(r for r in self.tokens if r not in self.work)

    def _read(self, rid: str, end: int) -> list[int | None]:
        return [self.payload.get(s) for s in self._slots(rid, 0, end)]

    def _slots(self, rid: str, start: int, end: int) -> list[int]:
        return token_slots(self.kv.block_table(rid), self.kv.block_size, start, end)

    @rule(head=st.sampled_from(PROMPT_HEADS), tail=st.lists(st.integers(0, 3), max_size=5),
          scope=st.sampled_from([("s1",), ("s2",)]), reserve=st.integers(0, 3))
    def admit(self, head, tail, scope, reserve):
        prompt = head + tail
        self._admit(self._rid(), scope, prompt, reserve)

    @precondition(lambda self: self.preempted)
    @rule(reserve=st.integers(0, 2))
    def readmit(self, reserve):
        rid, scope, tokens = self.preempted.pop(0)
        self._admit(rid, scope, tokens, reserve)

    def _admit(self, rid, scope, prompt, reserve):
        kv = self.kv
        expected = kv.lookup(scope, prompt)
        needed = kv.blocks_needed(None, len(prompt) + reserve, scope, prompt)
        allocatable = kv.num_allocatable_blocks()
        ok, cached = expect_unchanged(
            kv, lambda: kv.admit(rid, scope, prompt, len(prompt) + reserve), OutOfBlocks)
        assert ok == (needed <= allocatable), "blocks_needed must predict admission exactly"
        if not ok:
            return
        assert cached == expected
        assert cached <= len(prompt) - 1 and cached % self.bs == 0
        # the reused KV really holds this prompt's tokens
        assert self._read(rid, cached) == prompt[:cached]
        self.tokens[rid] = list(prompt)
        self.computed[rid] = cached
        self.scope[rid] = scope

    @precondition(lambda self: self.kv is not None and self._idle())
    @rule(data=st.data(), chunk=st.integers(1, 5))
    def schedule(self, data, chunk):
        """Grow for the next chunk of uncomputed tokens; copies stay pending until execute."""
        rid = data.draw(st.sampled_from(self._idle()))
        start = self.computed[rid]
        if start == len(self.tokens[rid]):
            self.tokens[rid].append(data.draw(st.integers(0, 3)))  # a sampled token
        end = min(len(self.tokens[rid]), start + chunk)
        kv = self.kv
        needed = kv.blocks_needed(rid, end, write_from=start)
        allocatable = kv.num_allocatable_blocks()
        ok, copies = expect_unchanged(kv, lambda: kv.grow(rid, end, start), OutOfBlocks)
        assert ok == (needed <= allocatable), "blocks_needed must predict grow exactly"
        if ok:
            self.work[rid] = (copies, start, end)

    @precondition(lambda self: self.work or self.orphan_copies)
    @rule(data=st.data())
    def execute(self, data):
        """The executor: copy payloads, complete the copies, write KV, commit."""
        if self.orphan_copies:
            self._copy(self.orphan_copies)
            self.orphan_copies = []
        if not self.work:
            return
        rid = data.draw(st.sampled_from(sorted(self.work)))
        copies, start, end = self.work.pop(rid)
        self._copy(copies)
        for pos, slot in zip(range(start, end), self._slots(rid, start, end), strict=True):
            self.payload[slot] = self.tokens[rid][pos]
        self.computed[rid] = end
        if data.draw(st.booleans(), label="commit now"):
            self.kv.commit(rid, self.tokens[rid][:end])
        else:  # commit later: a fork can happen in between (the parent's blocks not cached yet)
            self.uncommitted.add(rid)

    @precondition(lambda self: self.kv is not None and self._late())
    @rule(data=st.data())
    def commit_late(self, data):
        rid = data.draw(st.sampled_from(self._late()))
        self.uncommitted.discard(rid)
        self.kv.commit(rid, self.tokens[rid][:self.computed[rid]])

    def _copy(self, copies):
        bs = self.bs
        for src, dst in copies:
            for i in range(bs):
                if src * bs + i in self.payload:
                    self.payload[dst * bs + i] = self.payload[src * bs + i]
                else:
                    self.payload.pop(dst * bs + i, None)
        self.kv.complete_copies(copies)

    @precondition(lambda self: self.kv is not None and self._idle())
    @rule(data=st.data())
    def fork(self, data):
        self._fork(data.draw(st.sampled_from(self._idle())))

    def _late(self) -> list[str]:
        return sorted(r for r in self.uncommitted if r in self.tokens and r not in self.work)

    @precondition(lambda self: self.kv is not None and self._late())
    @rule(data=st.data())
    def fork_before_commit(self, data):
        """Fork a request whose written full blocks are not cached yet (they are shared
        uncached; the later commit must lock them for the child too)."""
        self._fork(data.draw(st.sampled_from(self._late())))

    def _fork(self, parent: str) -> None:
        child = self._rid()
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        self.scope[child] = self.scope[parent]
        if parent in self.uncommitted:
            self.uncommitted.add(child)

    @precondition(lambda self: self.kv is not None and self.tokens)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if rid in self.work:
            copies, _, _ = self.work.pop(rid)
            self.orphan_copies.extend(copies)  # the executor still finishes in-flight copies
        assert self.kv.free(rid) is True
        assert self.kv.free(rid) is False
        tokens = self.tokens.pop(rid)
        del self.computed[rid]
        self.uncommitted.discard(rid)
        scope = self.scope.pop(rid)
        if preempt:
            self.preempted.append((rid, scope, tokens))

    @precondition(lambda self: self.kv is not None)
    @rule(rid=st.sampled_from(["q1", "nope"]), n=st.integers(-1, 40))
    def bad_calls(self, rid, n):
        kv = self.kv
        if not kv.has(rid):
            expect_unchanged(kv, lambda: kv.grow(rid, 1, 0), KeyError)
            expect_unchanged(kv, lambda: kv.commit(rid, [1]), KeyError)
            expect_unchanged(kv, lambda: kv.fork(rid, "zz"), KeyError)
        else:
            expect_unchanged(kv, lambda: kv.admit(rid, (), [1, 2], 2), ValueError)
            expect_unchanged(kv, lambda: kv.grow(rid, n, n + 1), ValueError)
            expect_unchanged(kv, lambda: kv.commit(rid, [0] * (kv.num_slots(rid) + 1)),
                             ValueError)
        expect_unchanged(kv, lambda: kv.complete_copies([(0, 0)]), ValueError)

    @invariant()
    def consistent(self):
        if self.kv is None:
            return
        check_kv_manager(self.kv)
        # every idle request reads back exactly its own tokens
        for rid in self._idle():
            c = self.computed[rid]
            assert self._read(rid, c) == self.tokens[rid][:c], f"{rid} reads wrong KV"
        # every cached block holds the tokens of its path
        cache = self.kv.prefix_cache
        if cache is not None:
            for node in radix_nodes(cache):
                got = [self.payload.get(node.block * self.bs + i) for i in range(self.bs)]
                assert got == list(node.chunk), f"cached block {node.block} holds stale KV"


TestPool = PoolMachine.TestCase
TestPool.settings = SETTINGS
TestRadix = RadixMachine.TestCase
TestRadix.settings = settings(SETTINGS, max_examples=60)
TestManager = ManagerMachine.TestCase
TestManager.settings = settings(SETTINGS, max_examples=120, stateful_step_count=80)


# mutation tests: no shrinking (it only has to fail), first failure only; derandomized, so the
# example sequence (and therefore which check fires first) is the same on every run
MUTANT_SETTINGS = settings(SETTINGS, max_examples=1000, database=None, phases=[Phase.generate],
                           report_multiple_bugs=False, derandomize=True)


def test_manager_machine_catches_a_missing_copy_on_write(monkeypatch):
    """The machine is not vacuous: a manager that forgets copy-on-write is caught. Without the
    copy a request keeps writing into a block the prefix cache holds for another path, so the
    request ends up using a cached block that its own locked path does not cover, or (whichever
    the example sequence hits first) reads KV another request overwrote, or the cache holds
    stale KV."""
    real = KVCacheManager._plan_grow
    monkeypatch.setattr(KVCacheManager, "_plan_grow",
                        lambda self, table, n, w: (real(self, table, n, w)[0], []))
    with pytest.raises(AssertionError, match=r"block \d+ of '\w+' is cached on an unlocked "
                                             r"\(evictable\) node|reads wrong KV|holds stale KV"):
        run_state_machine_as_test(ManagerMachine, settings=MUTANT_SETTINGS)


def test_manager_machine_catches_a_cache_that_never_locks(monkeypatch):
    """... and so is a cache whose lock/unlock do nothing (its used nodes become evictable)."""
    monkeypatch.setattr(RadixCache, "lock", lambda self, node: None)
    monkeypatch.setattr(RadixCache, "unlock", lambda self, node: None)
    with pytest.raises(AssertionError, match=r"lock 0 != [1-9]\d* requests on its path"):
        run_state_machine_as_test(ManagerMachine, settings=MUTANT_SETTINGS)

