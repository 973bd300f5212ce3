"""Continuous-batching schedulers over a paged KV cache (spec rules 5, 6 and 11).

Two schedulers implement the :class:`~kvlab.core.scheduler_api.Scheduler` protocol:

* :class:`BaselineScheduler` is the spec's reference :func:`kvlab.reference.build_batch`
  (decode first, then FIFO prefill chunks into what is left of the token budget) wrapped to own
  real requests and real KV. Where KV is ample its batch *is* ``build_batch``'s (tested). When KV
  runs short it does what early engines did: it admits a waiting request only if its first
  chunk fits (head of line: it never skips ahead), and when a running request cannot grow it
  preempts the most recently admitted running request that is not yet scheduled this step
  (recompute: its KV is freed, it waits at the front of the queue and keeps its tokens).
* :class:`ProductionScheduler` shares one token budget between decodes and chunked prefills
  and adds admission control with KV reservation, priority classes, deadlines (EDF), cache
  affinity, ageing with a stated starvation bound, a deterministic preemption victim policy and
  an explicit overload policy. Its policy is documented on the class.

Both are deterministic: no clocks, no randomness, no set-order dependence.

Common rules (the base class):

* ``add_request`` validates its input (``ValueError``, scheduler unchanged) and then *rejects*
  (status REJECTED, reason in ``status_message``) a request that can never fit: its prompt does
  not fit ``max_model_len``, or prompt + max_tokens needs more KV blocks than the pool has.
  Rejected requests appear in the next output's ``rejected`` and in the list returned by the
  next ``update_from_output``.
* ``num_computed_tokens`` advances in ``update_from_output`` (KV is written when the step ran),
  so ``schedule()`` may not be called again before the previous output was consumed.
* Every non-terminal request is in exactly one queue: ``waiting`` (WAITING or PREEMPTED, holds
  no KV) or ``running`` (RUNNING, holds a block table). ``check_invariants`` checks it.
"""

from __future__ import annotations

from .scheduler_base import SchedulerBase
from .scheduler_baseline import BaselineScheduler
from .scheduler_config import SchedulerConfig
from .scheduler_production import (
    OrderKey,
    ProductionScheduler,
    default_order_key,
    starvation_bound,
)

__all__ = [
    "BaselineScheduler",
    "OrderKey",
    "ProductionScheduler",
    "SchedulerBase",
    "SchedulerConfig",
    "default_order_key",
    "starvation_bound",
]
