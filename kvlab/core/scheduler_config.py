"""SchedulerConfig: the budgets and policy knobs of kvlab's schedulers, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.core.checks import is_int


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and policy knobs. Token counts are tokens; steps are scheduler steps.

    Attributes:
        max_num_seqs: requests in one step's batch (and, for the production scheduler, running).
        max_num_batched_tokens: the token budget of one step, decodes and prefill chunks together.
        prefill_chunk: the longest prefill chunk one request gets in a step.
        admission: production only. ``"reserve"`` admits a request only if KV for its whole
            prompt + max_tokens fits beside what running requests may still need (no preemption
            is ever needed without forks); ``"watermark"`` admits when the first chunk fits and
            ``watermark`` of the pool stays free, preempting when KV runs out (more concurrency,
            recompute risk).
        watermark: fraction of the pool kept free by ``"watermark"`` admission.
        max_waiting: production only. Overload policy: a request arriving when this many wait
            beyond the free sequence slots is rejected with reason "queue full" (a burst that
            the running set can take is not queued). ``None`` = unbounded queue.
        max_wait_steps: production only. Ageing: a request waiting this many steps since its
            arrival outranks every class, deadline and cache hit, FIFO among the aged, and blocks
            admissions behind it while it does not fit. ``None`` disables ageing (then
            starvation is possible, see chapter 6).
        cache_affinity: production only. Order equal-class, equal-deadline candidates by longest
            prefix-cache hit first (within ``affinity_window`` candidates, to bound lookup cost).
        affinity_window: how many leading candidates get a prefix lookup per step.
        admission_scan_limit: production only. At most this many waiting candidates are tried
            per step (in order); the rest wait for a later step. Bounds the per-step cost when a
            long queue does not fit. ``None``: try them all.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_chunk: int = 256
    admission: str = "reserve"
    watermark: float = 0.0
    max_waiting: int | None = None
    max_wait_steps: int | None = 64
    cache_affinity: bool = True
    affinity_window: int = 256
    admission_scan_limit: int | None = 128
    num_lookahead_tokens: int = 0   # speculative decoding: draft slots per decode (spec_plan)
    #: overlap ("async") scheduling: the next step is planned while the previous executes, a
    #: decode in flight standing in as a placeholder token (see SchedulerBase.schedule)
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk",
                     "affinity_window"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        if self.admission not in ("reserve", "watermark"):
            raise ValueError("SchedulerConfig.admission must be 'reserve' or 'watermark', "
                             f"got {self.admission!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"SchedulerConfig.watermark must be in [0, 1), got {self.watermark!r}")
        if not is_int(self.num_lookahead_tokens) or self.num_lookahead_tokens < 0:
            raise ValueError("SchedulerConfig.num_lookahead_tokens must be an int >= 0, "
                             f"got {self.num_lookahead_tokens!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"SchedulerConfig.async_scheduling must be a bool, got "
                             f"{self.async_scheduling!r}")
        if self.async_scheduling and self.num_lookahead_tokens:
            raise ValueError("SchedulerConfig: async scheduling does not plan speculative "
                             "lookahead (num_lookahead_tokens must be 0)")
        for name, low in (("max_waiting", 0), ("max_wait_steps", 0), ("admission_scan_limit", 1)):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < low):
                raise ValueError(f"SchedulerConfig.{name} must be None or an int >= {low}")
