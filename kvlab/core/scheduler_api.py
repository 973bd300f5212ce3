"""The contract between a scheduler (kvlab.core) and the engine that executes its decisions.

The engine owns tensors; the scheduler owns requests, queues and KV blocks. Each engine step:

1. ``out = scheduler.schedule()`` decides which tokens run, allocates their KV slots and returns
   a :class:`SchedulerOutput` (chunks with block-table deltas, copy-on-write copies to perform
   first).
2. The executor performs ``out.copies`` on the KV tensors, runs the forward pass over
   ``out.chunks`` and samples one token for every chunk whose ``sample`` flag is set; the
   engine core then lifts the copies' fences (``scheduler.kv.complete_copies``).
3. ``scheduler.update_from_output(out, sampled)`` appends the sampled tokens, applies stop
   conditions, frees the KV of finished requests and returns the requests that finished.

Requests are :class:`RuntimeRequest` objects; the reference ``Request`` of the spec is the
three-field teaching version of the same state machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from .checks import is_int
from .scope import scope_key


class RequestStatus(Enum):
    """Where a runtime request is. Exactly one at any moment (spec rule 5)."""

    WAITING = "waiting"        # queued, holds no KV
    RUNNING = "running"        # holds a block table; prefilling or decoding (derived, see
                               # RuntimeRequest.is_decoding)
    PREEMPTED = "preempted"    # KV taken back; waits to recompute, keeps its generated tokens
    FINISHED = "finished"      # terminal: stop token or length
    CANCELLED = "cancelled"    # terminal: aborted by the client
    FAILED = "failed"          # terminal: an error while running
    REJECTED = "rejected"      # terminal: refused at admission (can never fit, or overload)
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # a consumer's request parked until its
                               # transferred KV is installed (kvlab.core.remote_kv); no KV

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED, RequestStatus.REJECTED}
)


class FinishReason(str, Enum):
    """Why a request ended. ``stop``, ``length`` and ``abort`` are vLLM's ``finish_reason``
    values (the first two also OpenAI's); ``error`` and ``rejected`` are kvlab's additions."""

    STOP = "stop"          # a stop token (or EOS) was generated
    LENGTH = "length"      # max_tokens reached (or the model's context)
    ABORT = "abort"        # cancelled by the client
    ERROR = "error"        # failed while running
    REJECTED = "rejected"  # refused at admission


@dataclass
class RuntimeRequest:
    """A request as the scheduler sees it. Token ids only; the executor owns its sampling.

    ``all_token_ids = prompt_token_ids + output_token_ids``. ``num_computed_tokens`` of them have
    KV written in the request's block table. The request still has to compute
    ``all_token_ids[num_computed_tokens:]``; when that is exactly the last sampled token it is
    decoding, otherwise prefilling (the prompt, or prompt + outputs after a preemption).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    scope: tuple = ()                       # prefix-cache compatibility scope (spec rule 4)
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_id: int | None = None
    ignore_eos: bool = False
    priority: int = 0                       # lower value = more important (as in vLLM)
    deadline: float | None = None          # absolute time on the engine's clock, seconds
    arrival_time: float = 0.0
    max_model_len: int | None = None        # context limit; reaching it finishes with LENGTH
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0              # prompt tokens served by the prefix cache at admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Filled in by the scheduler (the engine may read them; it should not write them):
    status_message: str | None = None       # why it was rejected / failed (human readable)
    arrival_seq: int = 0                    # arrival order (the scheduler's stable tie-breaker)
    admit_seq: int = 0                      # order of the latest admission (preemption victims)
    arrival_step: int | None = None         # scheduler step counter when add_request ran
    admitted_step: int | None = None        # step that first gave it KV (kept across preemption)
    first_token_step: int | None = None     # step whose output carried its first sampled token
    finished_step: int | None = None        # step in which it reached a terminal status

    def check_new(self) -> None:
        """ValueError naming the field unless this is a well-formed request as submitted:
        non-empty str id, prompt a non-empty tuple of ints >= 0, ``max_tokens >= 1``, optional
        ``max_model_len >= 1``, stop/EOS ids ints >= 0, bool ``ignore_eos``, int ``priority``,
        a number or None ``deadline``, a hashable scope, and fresh state (WAITING, no outputs,
        nothing computed). Schedulers call it at their boundary, ``add_request``.
        """
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty str, got {rid!r}")
        prompt = self.prompt_token_ids
        if not isinstance(prompt, tuple):
            raise ValueError(f"request {rid!r}: prompt_token_ids must be a tuple of ints, got "
                             f"{type(prompt).__name__}")
        if not prompt:
            raise ValueError(f"request {rid!r} has an empty prompt")
        for i, token in enumerate(prompt):
            if not is_int(token) or token < 0:
                raise ValueError(f"request {rid!r}: prompt_token_ids[{i}] must be an int >= 0, "
                                 f"got {token!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be an int >= 1, "
                             f"got {self.max_tokens!r}")
        if self.max_model_len is not None and (
                not is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"request {rid!r}: max_model_len must be None or an int >= 1, "
                             f"got {self.max_model_len!r}")
        stops = self.stop_token_ids
        if not isinstance(stops, (set, frozenset)) or not all(
                is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"request {rid!r}: stop_token_ids must be a frozenset of ints >= 0, "
                             f"got {stops!r}")
        eos = self.eos_token_id
        if eos is not None and (not is_int(eos) or eos < 0):
            raise ValueError(f"request {rid!r}: eos_token_id must be None or an int >= 0, "
                             f"got {eos!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"request {rid!r}: ignore_eos must be a bool, "
                             f"got {self.ignore_eos!r}")
        if not is_int(self.priority):
            raise ValueError(f"request {rid!r}: priority must be an int, "
                             f"got {self.priority!r}")
        deadline = self.deadline
        if deadline is not None and (not isinstance(deadline, (int, float))
                                     or isinstance(deadline, bool) or deadline != deadline):
            raise ValueError(f"request {rid!r}: deadline must be None or a number, "
                             f"got {deadline!r}")
        try:
            scope_key(self.scope)
        except TypeError as error:
            raise ValueError(f"request {rid!r}: bad scope: {error}") from None
        if (self.status != RequestStatus.WAITING or self.output_token_ids
                or self.num_computed_tokens or self.finish_reason is not None):
            raise ValueError(
                f"request {rid!r} must be fresh (WAITING, no outputs, nothing computed)")

    @property
    def is_decoding(self) -> bool:
        """Running and one token behind: only its last sampled token lacks KV. Otherwise a
        running request is prefilling (its prompt, or prompt + outputs after a preemption).
        Derived from the token counts, so nothing has to keep it in step."""
        return (self.status is RequestStatus.RUNNING and bool(self.output_token_ids)
                and self.num_computed_tokens == self.num_tokens - 1)

    @property
    def phase(self) -> str:
        """``"prefill"`` or ``"decode"`` while running, else the status value."""
        if self.status is not RequestStatus.RUNNING:
            return self.status.value
        return "decode" if self.is_decoding else "prefill"

    @property
    def max_kv_slots(self) -> int:
        """KV slots the request can ever occupy: every token but the last one sampled."""
        final = self.num_prompt_tokens + self.max_tokens
        if self.max_model_len is not None:
            final = min(final, self.max_model_len)
        return final - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """``all_token_ids[start:end]`` for ``0 <= start <= end``, in O(end - start): the hot
        paths use it instead of rebuilding the whole prompt + output tuple every step."""
        if not 0 <= start <= end:
            raise ValueError(f"token_slice needs 0 <= start <= end, got {start}, {end}")
        prompt = self.prompt_token_ids
        p = len(prompt)
        if end <= p:
            return prompt[start:end]
        if start >= p:
            return tuple(self.output_token_ids[start - p:end - p])
        return prompt[start:] + tuple(self.output_token_ids[:end - p])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens


def stop_reason(request: RuntimeRequest) -> FinishReason | None:
    """Why a running request must stop after its latest sampled token, or None to go on.

    A stop token (or EOS unless ``ignore_eos``) stops with STOP; reaching ``max_tokens`` or
    ``max_model_len`` with LENGTH. Only a RUNNING request with outputs can stop.
    """
    if request.status != RequestStatus.RUNNING or not request.output_token_ids:
        return None
    token = request.output_token_ids[-1]
    if token in request.stop_token_ids or (
        request.eos_token_id is not None and token == request.eos_token_id
        and not request.ignore_eos
    ):
        return FinishReason.STOP
    if len(request.output_token_ids) >= request.max_tokens:
        return FinishReason.LENGTH
    if request.max_model_len is not None and request.num_tokens >= request.max_model_len:
        return FinishReason.LENGTH
    return None


@dataclass(frozen=True)
class ScheduledChunk:
    """Work for one request in one step: feed ``token_ids`` at positions ``start_pos...``.

    The block table travels as a delta, as vLLM v1's ``new_block_ids``: the request's table
    after this step's allocation is the first ``num_kept_blocks`` entries of the table the
    executor was last sent, followed by ``new_block_ids`` (a first or resumed chunk sends the
    whole table, ``num_kept_blocks == 0``; copy-on-write or a rollback resends from the entry
    that changed). The table covers positions ``0 .. start_pos + len(token_ids) - 1 +
    num_lookahead``. ``sample`` is True when
    the chunk ends at the request's last token, so the logits of its last position produce the
    next token. ``num_lookahead`` (speculative decoding, :mod:`kvlab.core.spec_plan`): slots
    reserved after the chunk for up to that many draft tokens, verified in the same forward;
    the executor then returns a tuple of 1..num_lookahead+1 tokens for the request.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    new_block_ids: tuple[int, ...]
    sample: bool
    is_prefill: bool
    num_lookahead: int = 0
    num_kept_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_query_tokens(self) -> int:
        """Tokens this chunk may put through the forward: its own plus the lookahead."""
        return len(self.token_ids) + self.num_lookahead


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's decisions; ``copies`` are (src_block, dst_block) KV copies to run first."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    copies: tuple[tuple[int, int], ...] = ()
    preempted: tuple[str, ...] = ()        # request ids preempted (KV released) this step:
                                           # their tables are gone (resent whole on resume)
    admitted: tuple[str, ...] = ()         # request ids given a KV table this step (first
                                           # admission, or re-admission after a preemption)
    rejected: tuple[str, ...] = ()         # request ids refused at admission this step
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class StepPlan:
    """Mutable accumulator of one step's decisions (budgets are enforced by ``add_chunk``)."""

    def __init__(self, token_budget: int, max_seqs: int) -> None:
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.chunks: list[ScheduledChunk] = []
        self.copies: list[tuple[int, int]] = []
        self.preempted: list[str] = []
        self.admitted: list[str] = []
        self.used = 0
        self.scheduled: set[str] = set()

    @property
    def tokens_left(self) -> int:
        return self.token_budget - self.used

    @property
    def seqs_left(self) -> int:
        return self.max_seqs - len(self.chunks)

    def add_chunk(self, chunk: ScheduledChunk) -> None:
        if chunk.request_id in self.scheduled:
            raise AssertionError(f"{chunk.request_id} scheduled twice in one step")
        n = chunk.num_query_tokens
        if n <= 0 or n > self.tokens_left or self.seqs_left <= 0:
            raise AssertionError("a chunk would break the step's budgets")
        self.chunks.append(chunk)
        self.used += n
        self.scheduled.add(chunk.request_id)

    def replace_chunk(self, index: int, chunk: ScheduledChunk) -> None:
        """Swap chunk ``index`` for a larger version of itself (same request; lookahead added)."""
        old = self.chunks[index]
        extra = chunk.num_query_tokens - old.num_query_tokens
        if chunk.request_id != old.request_id or not 0 <= extra <= self.tokens_left:
            raise AssertionError("replace_chunk: another request, or beyond the token budget")
        self.chunks[index] = chunk
        self.used += extra


def check_sampled(output: SchedulerOutput, sampled: Mapping[str, Any]
                  ) -> dict[str, tuple[int, ...]]:
    """Validate one step's executor answer; returns ``request id -> tokens`` (a tuple).

    A chunk with ``sample=True`` needs an int, or (with lookahead) a tuple of
    ``1 .. num_lookahead + 1`` ints >= 0; chunks without ``sample`` get nothing. ValueError
    names the first problem (and nothing was changed).
    """
    expected = {c.request_id: c for c in output.chunks if c.sample}
    missing = set(expected) - set(sampled)
    extra = set(sampled) - set(expected)
    if missing:
        raise ValueError(f"no sampled token for {sorted(missing)}")
    if extra:
        raise ValueError(f"sampled tokens for requests that did not sample: {sorted(extra)}")
    tokens: dict[str, tuple[int, ...]] = {}
    for rid, chunk in expected.items():
        got = sampled[rid]
        seq = tuple(got) if isinstance(got, (tuple, list)) else (got,)
        if not 1 <= len(seq) <= chunk.num_lookahead + 1:
            raise ValueError(f"{rid!r}: {len(seq)} tokens for a chunk with "
                             f"{chunk.num_lookahead} lookahead slots")
        for token in seq:
            if not is_int(token) or token < 0:
                raise ValueError(f"sampled token for {rid!r} must be an int >= 0, got {token!r}")
        tokens[rid] = seq
    return tokens


class Scheduler(Protocol):
    """What the engine needs from a scheduler; see the module docstring for one step's flow."""

    kv: Any  # the KVCacheManager the scheduler allocates from (kvlab.core.kv_manager)

    def add_request(self, request: RuntimeRequest) -> None: ...

    def abort_request(self, request_id: str) -> RuntimeRequest | None: ...

    def schedule(self) -> SchedulerOutput: ...

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int]
    ) -> list[RuntimeRequest]: ...

    def fail_step(self, output: SchedulerOutput, message: str) -> list[RuntimeRequest]:
        """The executor failed on ``output`` (the step in flight): fail its requests with
        reason ERROR, release their KV once, and clear the step so the engine can go on."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def get_request(self, request_id: str) -> RuntimeRequest: ...

    def find_request(self, request_id: str) -> RuntimeRequest | None: ...

    def can_forget(self, request_id: str) -> bool: ...

    def forget(self, request_id: str) -> RuntimeRequest: ...

    def requests(self) -> Sequence[RuntimeRequest]: ...

    def check_invariants(self) -> None: ...
