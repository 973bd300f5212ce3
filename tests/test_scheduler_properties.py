"""Property tests of both schedulers over random arrivals, aborts, budgets and KV sizes.

A fake token source (next token = hash of all previous tokens) stands in for the model, so
every output can be checked against an uninterrupted greedy run.
"""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvlab.core.baseline_scheduler import BaselineScheduler
from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.core.production_scheduler import ProductionScheduler, starvation_bound
from kvlab.core.request import RUNNING_STATUSES, FinishReason, RequestStatus, RuntimeRequest
from kvlab.core.scheduler_config import SchedulerConfig
from kvlab.labs.invariants import check_scheduler
from kvlab.sim.tokens import drive, hash_token

S = RequestStatus
SHARED = tuple(range(500, 532))
VOCAB = 1000  # the fake model's vocabulary (hash_token's default)


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 12))
    reqs = []
    for i in range(n):
        head = SHARED[: draw(st.sampled_from([0, 4, 8, 16]))]
        tail = tuple(draw(st.lists(st.integers(1, 400), min_size=1, max_size=20)))
        max_tokens = draw(st.integers(1, 10))
        # stop / eos tokens: often ones the request will generate (so the STOP path is taken),
        # sometimes arbitrary ones (usually never generated)
        cont = greedy(head + tail, max_tokens)
        token = st.one_of(st.sampled_from(cont), st.integers(0, VOCAB - 1))
        reqs.append((
            draw(st.integers(1, 15)),                          # arrival step
            RuntimeRequest(f"r{i}", head + tail, max_tokens=max_tokens,
                           priority=draw(st.integers(0, 2)),
                           deadline=draw(st.one_of(st.none(), st.floats(0, 50))),
                           max_model_len=draw(st.one_of(st.none(), st.integers(8, 40))),
                           stop_token_ids=frozenset(draw(st.lists(token, max_size=2))),
                           eos_token_id=draw(st.one_of(st.none(), token)),
                           ignore_eos=draw(st.booleans())),
        ))
    aborts = draw(st.lists(st.tuples(st.integers(1, 30), st.integers(0, n - 1)), max_size=3))
    seqs = draw(st.integers(1, 6))
    cfg = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=draw(st.integers(seqs, 24)),
        prefill_chunk=draw(st.integers(1, 16)),
        admission=draw(st.sampled_from(["reserve", "watermark"])),
        max_wait_steps=draw(st.one_of(st.none(), st.integers(0, 6))),
        max_waiting=draw(st.one_of(st.none(), st.integers(1, 8))),
        affinity_window=draw(st.integers(1, 8)),
    )
    kv = (draw(st.integers(3, 40)), draw(st.sampled_from([1, 2, 4])), draw(st.booleans()))
    return reqs, aborts, cfg, kv


def greedy(prompt, n):
    """The fake model's uninterrupted continuation: ``n`` tokens, EOS not avoided."""
    tokens, out = list(prompt), []
    for _ in range(n):
        t = hash_token(tokens, VOCAB)
        out.append(t)
        tokens.append(t)
    return out


def model_tokens(request):
    """Token source for drive(): like greedy(), so it can emit the request's EOS."""
    return hash_token(request.all_token_ids, VOCAB)


def stops_at(r, token):
    """Does generating ``token`` end ``r`` with STOP?"""
    return token in r.stop_token_ids or (
        r.eos_token_id is not None and token == r.eos_token_id and not r.ignore_eos)


def run(cls, reqs, aborts, cfg, kvspec):
    num_blocks, block_size, caching = kvspec
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = cls(kv, cfg)
    arrivals, abort_at = {}, {}
    for step, r in reqs:
        arrivals.setdefault(step, []).append(RuntimeRequest(
            r.request_id, r.prompt_token_ids, r.max_tokens, priority=r.priority,
            deadline=r.deadline, max_model_len=r.max_model_len,
            stop_token_ids=r.stop_token_ids, eos_token_id=r.eos_token_id,
            ignore_eos=r.ignore_eos))
    for step, i in aborts:
        abort_at.setdefault(step, []).append(reqs[i][1].request_id)
    seen_outputs: dict[str, int] = {}
    seen_computed: dict[str, int] = {}
    waiting_after: list[list[str]] = [[]]

    def on_step(out):
        ids = [c.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.chunks) <= cfg.max_num_seqs
        for c in out.chunks:
            assert c.num_tokens >= 1
            if c.is_prefill:
                assert c.num_tokens <= cfg.prefill_chunk
        for r in sched.requests():
            rid = r.request_id
            assert len(r.output_token_ids) >= seen_outputs.get(rid, 0), "outputs shrank"
            seen_outputs[rid] = len(r.output_token_ids)
            if rid not in out.preempted and r.status in RUNNING_STATUSES:
                assert r.num_computed_tokens >= seen_computed.get(rid, 0), "computed went back"
            seen_computed[rid] = r.num_computed_tokens
        waiting_after.append(list(sched.waiting))

    drive(sched, model_tokens, arrivals=arrivals, aborts=abort_at, check=check_scheduler,
          on_step=on_step, max_steps=3000)
    assert not kv.requests() and kv.num_allocatable_blocks() == num_blocks
    return sched, waiting_after


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from([BaselineScheduler, ProductionScheduler]))
def test_schedulers_keep_every_invariant(workload, cls):
    reqs, aborts, cfg, kvspec = workload
    sched, _ = run(cls, reqs, aborts, cfg, kvspec)
    for r in sched.requests():
        assert r.status.is_terminal and r.finish_reason is not None
        want = greedy(r.prompt_token_ids, r.max_tokens)
        out = r.output_token_ids
        # no token before the last one is a stop token: generating one ends the request at once
        assert not any(stops_at(r, t) for t in out[:-1])
        if r.status == S.FINISHED:
            assert out == want[: len(out)] and out
            # STOP iff the last token stops it (a stop id, or the EOS unless ignore_eos) ...
            assert (r.finish_reason == FinishReason.STOP) == stops_at(r, out[-1])
            if r.finish_reason == FinishReason.LENGTH:  # ... else the length limits ended it
                assert len(out) == r.max_tokens or r.num_tokens == r.max_model_len
        elif r.status == S.CANCELLED:
            assert out == want[: len(out)]
            assert not (out and stops_at(r, out[-1])), "a stopped request cannot be cancelled"
        else:
            assert r.status == S.REJECTED and r.status_message and not r.output_token_ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(0, 6))
def test_production_starvation_bound(workload, max_wait):
    reqs, aborts, cfg, kvspec = workload
    cfg = SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                          prefill_chunk=cfg.prefill_chunk, admission="reserve",
                          max_wait_steps=max_wait, affinity_window=cfg.affinity_window)
    sched, _ = run(ProductionScheduler, reqs, aborts, cfg, kvspec)
    # The bound's premise is "no preemption": true for reserve admission except in the rare
    # case documented on ProductionScheduler (concurrent duplicate prefix writes).
    assume(all(r.num_preemptions == 0 for r in sched.requests()))
    order = {r.request_id: i for i, r in enumerate(sched.requests())}
    longest = max(r.num_prompt_tokens + r.max_tokens for r in sched.requests())
    for r in sched.requests():
        if r.admitted_step is None:
            continue
        aged_at = r.arrival_step + max(max_wait, 1)   # the first step that sees it aged
        if r.admitted_step <= aged_at:
            continue
        # requests ahead of it in FIFO order that still waited when that step began
        older = sum(
            1 for q in sched.requests()
            if order[q.request_id] < order[r.request_id]
            and (q.admitted_step if q.admitted_step is not None else q.finished_step) >= aged_at)
        bound = starvation_bound(cfg, longest, older)
        assert r.admitted_step - r.arrival_step <= bound, (r.request_id, bound)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans())
def test_baseline_equals_reference_where_kv_is_ample(workload, caching):
    """Differential: with KV never short, every baseline batch is build_batch's batch."""
    from kvlab.reference import build_batch
    from kvlab.sim.tokens import greedy_tokens

    reqs, aborts, cfg, _ = workload
    sched = BaselineScheduler(KVCacheManager(600, 4, enable_prefix_caching=caching), cfg)
    arrivals: dict[int, list] = {}
    for step, r in reqs:
        arrivals.setdefault(step, []).append(RuntimeRequest(
            r.request_id, r.prompt_token_ids, r.max_tokens, max_model_len=r.max_model_len))
    abort_at: dict[int, list] = {}
    for step, i in aborts:
        abort_at.setdefault(step, []).append(reqs[i][1].request_id)
    step = 0
    while sched.has_unfinished_requests() or arrivals or abort_at:
        step += 1
        for r in arrivals.pop(step, []):
            sched.add_request(r)
        for rid in abort_at.pop(step, []):
            sched.abort_request(rid)
        view = sched.reference_view()
        want = build_batch(view, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                           cfg.prefill_chunk) if view else []
        out = sched.schedule()
        assert not out.preempted
        assert [(c.request_id, c.num_tokens) for c in out.chunks] == [(r, n) for r, _, n in want]
        sched.update_from_output(out, {c.request_id: greedy_tokens(sched.get_request(c.request_id))
                                       for c in out.chunks if c.sample})
