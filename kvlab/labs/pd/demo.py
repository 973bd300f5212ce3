"""Chapter 10's drivers: one fault on a live producer/consumer pair, and the two-process run.

:class:`PDDemo` keeps three engines on one checkpoint: a single engine (the truth), a producer
and a consumer joined by an in-process channel. :meth:`PDDemo.run` sends one fresh prompt through
them with one fault injected and returns a :class:`FaultRun`: the consumer's decision, whether
tokens and logprobs equal the single engine's, and the consumer's KV pool right after the
decision. :func:`run_two_processes` starts a producer in its own OS process
(:mod:`.producer_main`) and lets a consumer in this process decode over loopback TCP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.core.sampling_params import SamplingParams
from kvlab.disagg.transfer_faults import FAULT_KINDS, Fault, FaultSchedule, TransferFaultInjector
from kvlab.engine.checkpoint import load_checkpoint
from kvlab.engine.kv_transfer.connectors import InProcessChannel
from kvlab.engine.llm import LLM
from kvlab.labs.invariants import check_engine
from kvlab.labs.kv_snapshot import KVSnapshot, snapshot_of

__all__ = ["DEMO_FAULTS", "FaultRun", "PDDemo", "run_two_processes"]

DEMO_FAULTS = ("none", *(k for k in FAULT_KINDS if k != "consumer_crash"))


@dataclass
class FaultRun:
    fault: str
    request_id: str
    decision: str            # installed, a reject kind, missing, duplicate, after_abort ...
    action: str              # install, recompute, fail, discard
    detail: str
    finished: bool
    tokens_equal: bool
    max_logprob_diff: float
    snapshot: KVSnapshot     # the consumer's pool right after its decision
    table: tuple[int, ...]   # the request's block table at that moment
    stats: dict[str, int] = field(default_factory=dict)


class PDDemo:
    """Single engine, producer and consumer over one checkpoint (see the module docstring)."""

    def __init__(self, model: str = "kvlab-tiny", *, block_size: int = 8, num_blocks: int = 40,
                 prompt_len: int = 29, max_tokens: int = 4) -> None:
        ckpt = load_checkpoint(model)
        self.channel = InProcessChannel()
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
        kw = {"block_size": block_size, "num_blocks": num_blocks}
        self.single = LLM(ckpt, **kw)
        self.producer = LLM(ckpt, **kw, kv_transfer_config={
            "kv_connector": "inprocess", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"channel": self.channel}})
        self.consumer = LLM(ckpt, **kw, kv_transfer_config={
            "kv_connector": "inprocess", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"channel": self.channel, "timeout_s": 0.05}})
        self.prompt_len = prompt_len
        self.runs = 0

    def _inject(self, fault: str, seed: int) -> None:
        sched = FaultSchedule((Fault(fault, 0),) if fault != "none" else (), seed)
        for llm in (self.producer, self.consumer):
            kt = llm.engine.kv_transfer
            kt.injector = TransferFaultInjector(sched)
            kt.exporter.injector = kt.injector

    def run(self, fault: str = "none", seed: int = 0) -> FaultRun:
        """Send one fresh prompt through the pair with ``fault`` injected (see DEMO_FAULTS)."""
        if fault not in DEMO_FAULTS:
            raise ValueError(f"fault must be one of {DEMO_FAULTS}, got {fault!r}")
        self.runs += 1
        rid = f"demo-{self.runs}"
        prompt = [(37 * self.runs + 11 * j) % 900 + 3 for j in range(self.prompt_len)]
        self._inject(fault, seed)
        truth = self.single.generate([prompt], self.params, use_tqdm=False)[0].outputs[0]
        eng = self.consumer.engine
        sched = eng.kv_transfer.scheduler
        seen = len(sched.decisions)
        eng.add_request(rid, prompt, self.params)
        if fault == "after_abort":
            eng.step()
            eng.abort_request(rid)
        self.producer.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0),
                               use_tqdm=False)
        self.producer.engine.kv_transfer.flush()
        outputs, snap, table, decision = [], None, (), None
        for _ in range(1000):
            if not eng.has_unfinished_requests() and decision is not None:
                break
            outputs += eng.step()
            new = [d for d in list(sched.decisions)[seen:]
                   if d.request_id == rid and d.kind != "parked"]
            if new and decision is None:
                decision = new[0]
                snap = snapshot_of(eng.kv)
                table = tuple(eng.kv.block_table(rid)) if eng.kv.has(rid) else ()
        mine = [o for o in outputs if o.request_id == rid and o.finished]
        done = mine[-1].outputs[0] if mine else None
        finished = done is not None and done.finish_reason in ("stop", "length")
        diff = 0.0
        if finished:
            for a, b in zip(truth.logprobs, done.logprobs, strict=True):
                diff = max(diff, *(abs(a[k] - b[k]) for k in a))
        check_engine(eng)
        assert decision is not None and snap is not None
        return FaultRun(fault, rid, decision.kind, decision.action, decision.detail, finished,
                        finished and done.token_ids == truth.token_ids, diff, snap, table,
                        dict(sched.stats))


def run_two_processes(prompts: list[list[int]], schedule: FaultSchedule, *,
                      block_size: int = 8, wait_s: float = 5.0,
                      timeout_s: float = 120.0) -> dict[str, Any]:
    """A consumer here, a producer in a child process, over loopback TCP.

    Returns ``{"producer": <the child's report>, "consumer_pid", "outputs", "decisions",
    "stats"}``; the consumer waits up to ``wait_s`` seconds for a missing entry.
    """
    consumer = LLM("kvlab-tiny", block_size=block_size, num_blocks=256, kv_transfer_config={
        "kv_connector": "tcp", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"port": 0, "timeout_s": wait_s,
                                      "fault_schedule": schedule.to_data()}})
    kt = consumer.engine.kv_transfer
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root),
                                                        os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvlab.labs.pd.producer_main", "--port",
             str(kt.connector.port), "--prompts", json.dumps(prompts), "--faults",
             json.dumps(schedule.to_data()), "--block-size", str(block_size)],
            capture_output=True, text=True, env=env, timeout=timeout_s, check=True)
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        outputs = consumer.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0),
                                    use_tqdm=False)
    finally:
        kt.close()
    return {"producer": report, "consumer_pid": os.getpid(), "outputs": outputs,
            "decisions": [d for d in kt.scheduler.decisions if d.kind != "parked"],
            "stats": kt.stats}
