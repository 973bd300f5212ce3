"""LLMEngine: requests in, one engine-core step per ``step()``, outputs out. It is the public
boundary where requests are checked and prompts encoded (once each), and it owns what the
scheduler and the runner should not know: text, the ``n`` samples of a request (``r``, ``r#1``,
... with seeds ``s + i``, fanned out at admission as in vLLM v1) and timestamps. What the
runner needs of a request travels in the scheduler's output. A bad request raises, naming the
problem, and changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvlab.core.engine_core import EngineCore
from kvlab.core.request import RuntimeRequest
from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.engine_args import SEED_MOD, EngineArgs
from kvlab.engine.engine_build import build_parts, engine_cache_scope
from kvlab.engine.outputs import (
    EngineStats,
    OutputProcessor,
    RequestMetrics,
    RequestOutput,
    RequestState,
    SampleState,
)
from kvlab.engine.snapshot import StepTrace

__all__ = ["LLMEngine", "Prompt", "TokenizedPrompt"]


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt encoded once (:meth:`LLMEngine.validate_request`): ``text`` (None for token
    ids) and its ``token_ids``. :meth:`LLMEngine.add_request` takes it without encoding again."""

    text: str | None
    token_ids: tuple[int, ...]


Prompt = str | Sequence[int] | TokenizedPrompt

_SAMPLE_SEP = "#"  # sample i > 0 of request "r" runs as request "r#i"


class LLMEngine:
    """A real model stepping through paged KV, built from one frozen :class:`EngineArgs`
    (``LLMEngine(EngineArgs("kvlab-tiny", max_model_len=256))``)."""

    def __init__(self, args: EngineArgs):
        if not isinstance(args, EngineArgs):
            raise TypeError(f"LLMEngine takes an EngineArgs, got {type(args).__name__} "
                            "(LLMEngine(EngineArgs(model, ...)); LLM(model, ...) builds one)")
        p = build_parts(args)   # engine_build.py, in dependency order
        self.args = args
        self.quantization = p.quantization
        self.checkpoint = p.checkpoint
        self.model = p.checkpoint.model
        self.config = p.checkpoint.config
        self.tokenizer = p.tokenizer
        self.device = p.device
        self.dtype = p.dtype
        self.speculator = p.speculator
        self.max_model_len = p.max_model_len
        self.block_size = args.block_size
        self.num_blocks = p.num_blocks
        self.cache = p.cache
        self.kv = p.kv
        self.scheduler_config = p.scheduler_config
        self.scheduler = p.scheduler
        self.kv_transfer = p.kv_transfer
        self.executor = p.executor
        self.eos_token_ids = p.eos_token_ids
        self.structured_outputs = p.structured_outputs
        self.core = EngineCore(self.scheduler, self.executor, overlap=args.async_scheduling)
        self._arrivals = 0
        self._scopes: dict[str, tuple] = {}   # security domain -> prefix-cache scope
        self._ending: dict[str, tuple[str, ...]] = {}   # aborted request id -> its sample ids
        self.last_trace: StepTrace | None = None
        self.stats = EngineStats()
        self.outputs = OutputProcessor(self.tokenizer.decode if self.tokenizer else None)
        self.clock: Callable[[], float] = time.monotonic
        self.cache_scope()   # the default tenant's scope, built once here
        self.kv_events = None   # KV events published to routers (chapter 13), off by default
        if p.kv_events_config is not None:
            from kvlab.engine.kv_events import KVEvents
            self.kv_events = KVEvents.create(p.kv_events_config, self.kv.prefix_cache,
                                             self.cache_salt)

    def cache_scope(self, security_domain: str | None = None) -> tuple:
        """The prefix-cache scope (spec rule 4) of this engine's requests, once per domain."""
        domain = security_domain or self.args.security_domain
        scope = self._scopes.get(domain)
        if scope is None:
            if len(self._scopes) >= 64:   # many tenants: keep the memory bounded
                self._scopes.clear()
            scope = self._scopes[domain] = engine_cache_scope(
                self.checkpoint, self.tokenizer, self.block_size, domain, self.quantization,
                self.dtype)
        return scope

    def cache_salt(self, scope: tuple) -> str | None:
        """The ``cache_salt`` of a prefix-cache scope in KV events: its security domain, unless
        it is the engine's own (that one is unsalted, as a vLLM request without a salt)."""
        domain = dict(scope).get("security_domain")
        return None if domain == self.args.security_domain else domain

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``); False, nothing changed,
        while any request holds KV. With KV events on, ``AllBlocksCleared`` goes out now."""
        with self.core.lock:
            done = self.kv.reset_prefix_cache()
            if done and self.kv_events is not None:
                self.kv_events.flush()
            return done

    def close(self) -> None:
        """Stop what runs beside the engine (the KV-event publisher's thread and sockets)."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, tuple[int, ...]]:
        """(text or None, token ids) of a prompt (a str is encoded, a :class:`TokenizedPrompt`
        is not again); ValueError/TypeError naming the problem."""
        if isinstance(prompt, TokenizedPrompt):
            text, ids = prompt.text, tuple(prompt.token_ids)
            if not all(type(t) is int for t in ids):
                raise TypeError("prompt token ids must be ints")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass prompts as token ids")
            text, ids = prompt, tuple(self.tokenizer.encode(prompt))
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise TypeError("prompt token ids must be ints")
            text, ids = None, tuple(prompt)
        else:
            raise TypeError(f"prompt must be a str or a sequence of token ids, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        if bad := [t for t in ids if not 0 <= t < self.config.vocab_size]:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary "
                             f"(0..{self.config.vocab_size - 1})")
        return text, ids

    @staticmethod
    def _sample_id(request_id: str, index: int) -> str:
        """The scheduler's id of sample ``index`` of ``request_id``."""
        return request_id if index == 0 else f"{request_id}{_SAMPLE_SEP}{index}"

    def _runtime_request(self, state: RequestState, sample: SampleState, scope: tuple,
                         seed: int) -> RuntimeRequest:
        """The scheduler's request for ``sample``; its sampling params and seed travel on to
        the runner in the scheduler's output."""
        p = state.params
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops.update(self.eos_token_ids[1:])  # extra eos ids act as stop tokens
        if p.structured_outputs is not None:
            stops.update(self.structured_outputs.stop_token_ids_for(p))  # ends at EOS
        return RuntimeRequest(
            sample.seq_id, state.prompt_token_ids, p.max_tokens, scope, frozenset(stops),
            self.eos_token_ids[0] if self.eos_token_ids else None, p.ignore_eos,
            arrival_time=state.metrics.arrival_time, max_model_len=self.max_model_len,
            sampling_params=p if not sample.index else replace(p, prompt_logprobs=None),
            seed=(seed + sample.index) % SEED_MOD)

    def validate_request(self, prompt: Prompt, params: SamplingParams | None = None,
                         request_id: str | None = None
                         ) -> tuple[str | None, tuple[int, ...], SamplingParams]:
        """:meth:`add_request`'s checks (a duplicate id it checks under the lock), queueing
        nothing: ``(text or None, token ids, params)``, or ValueError / TypeError naming it.
        Pass ``TokenizedPrompt(text, token_ids)`` on to :meth:`add_request` to encode once."""
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
            if _SAMPLE_SEP in request_id:
                raise ValueError(f"request_id {request_id!r} may not contain {_SAMPLE_SEP!r} "
                                 "(reserved for the samples of n > 1 requests)")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.config.vocab_size)
        if params.stop and (self.tokenizer is None or params.output_kind.value):
            raise ValueError("SamplingParams.stop needs a tokenizer and CUMULATIVE outputs")
        if params.penalized and self.args.speculative_config is not None:
            raise ValueError("SamplingParams penalties and min_tokens are not supported with "
                             "speculative decoding")
        if params.structured_outputs is not None:
            self.structured_outputs.validate(params)  # compiles (cached): a bad grammar raises
        text, ids = self.encode_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context: "
                             f"max_model_len={self.max_model_len} leaves no room to generate")
        longest = min(len(ids) + params.max_tokens, self.max_model_len) - 1  # last token: no KV
        if (blocks := -(-longest // self.block_size)) > self.num_blocks:
            raise ValueError(f"request needs up to {longest} tokens of KV ({blocks} blocks) but "
                             f"the cache has {self.num_blocks}")
        return text, ids, params

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    *, security_domain: str | None = None) -> None:
        """Queue a request (its ``n`` samples); ``security_domain`` overrides the engine's
        tenant. Bad input raises (see :meth:`validate_request`) and leaves the engine as it was."""
        text, ids, params = self.validate_request(prompt, params, request_id)
        if security_domain is not None and not (isinstance(security_domain, str)
                                                and security_domain):
            raise ValueError(f"security_domain must be a non-empty str, got {security_domain!r}")
        scope = self.cache_scope(security_domain)
        with self.core.lock:
            if request_id in self.outputs.requests:
                raise ValueError(f"duplicate request_id {request_id!r}: already in the engine")
            if self._samples_ending(request_id):
                raise ValueError(f"request_id {request_id!r}: a sample of the aborted request "
                                 "is still ending in the scheduler; reuse the id after this step")
            seed = params.seed
            if seed is None:  # reproducible per engine: engine seed and arrival order
                seed = (self.args.seed * 1_000_003 + self._arrivals) % (2**63)
            state = RequestState(request_id, text, ids, params, RequestMetrics(self.clock()))
            state.samples = [
                SampleState(self._sample_id(request_id, i), i,
                            [] if params.logprobs is not None else None)
                for i in range(params.n)]
            for sample in state.samples:   # validated above: these cannot raise
                self.core.add_request(self._runtime_request(state, sample, scope, seed))
            self.outputs.add(state)
            self._arrivals += 1

    def abort_request(self, request_id: str) -> RequestOutput:
        """Cancel a request (all its samples) and free its KV (at the end of the step in flight,
        if any); KeyError for an unknown id. Returns its final output (unfinished samples end
        with ``"abort"``), which the next :meth:`step` returns as well."""
        with self.core.lock:
            state = self.outputs.requests.get(request_id)
            if state is None:
                raise KeyError(f"abort_request: unknown request_id {request_id!r}")
            for sample in state.samples:
                if sample.ended is None:
                    sample.ended = self.core.abort_request(sample.seq_id)
            ids = tuple(s.seq_id for s in state.samples)
            if any(self.scheduler.find_request(sid) is not None for sid in ids):
                self._ending[request_id] = ids     # aborted mid-step: gone when it ends
            state.metrics.finished_time = self.clock()
            out = self.outputs.make_output(state, force_finished=True)
            self.outputs.drop(state)
            self.outputs.defer(out)   # the next step() reports it too (LLM.generate waits)
            return out

    def has_unfinished_requests(self) -> bool:
        """Requests unfinished or outputs undelivered (overlap: or a step still to apply, so a
        loop over :meth:`step` ends with nothing left of the requests it ran)."""
        return (bool(self.outputs.requests) or bool(self.outputs.undelivered)
                or self.core.has_steps_in_flight())

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is in use: unfinished here, or its samples still ending."""
        with self.core.lock:
            return request_id in self.outputs.requests or self._samples_ending(request_id)

    def _samples_ending(self, request_id: str) -> bool:
        """Whether a sample of an aborted ``request_id`` is still in the scheduler (an abort
        during a step ends it at the step's end); forgets the abort once none is."""
        ids = self._ending.get(request_id, (request_id,))
        if any(self.scheduler.find_request(sid) is not None for sid in ids):
            return True
        self._ending.pop(request_id, None)
        return False

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.requests)

    def defer_outputs(self, outputs: Sequence[RequestOutput]) -> None:
        """The next :meth:`step` returns ``outputs`` (the latest per request) besides its own."""
        with self.core.lock:
            for out in outputs:
                self.outputs.defer(out)

    def step(self, *, only_finished: bool = False) -> list[RequestOutput]:
        """One step of the engine core: the outputs of every request that got a token, finished
        or was rejected (``only_finished``: of those that finished)."""
        t0 = time.perf_counter()
        result = self.core.step()
        with self.core.lock:
            if self.outputs.stops is not None:   # a matched stop string ends its sample
                result = self.outputs.stops.end_matched(result, self.core.abort_request)
            outputs = self.outputs.process(result, self.clock(), self.stats, only_finished)
            if self.core.overlap:   # a sample that ended may still be in the step in flight
                for out in outputs:
                    ids = tuple(self._sample_id(out.request_id, c.index) for c in out.outputs)
                    if out.finished and any(map(self.scheduler.find_request, ids)):
                        self._ending[out.request_id] = ids
            for request_id in list(self._ending):
                self._samples_ending(request_id)     # forgets the aborts that have ended
            if self.kv_events is not None:   # this step's cache changes, one batch
                self.kv_events.flush()
            info = result.model.info
            self.last_trace = StepTrace(result.output, info.metadata, info.request_ids,
                                        info.logits_shape, dict(result.model.sampled),
                                        [r.request_id for r in result.ended])
        self.stats.add_step(result, time.perf_counter() - t0)
        return outputs

    def snapshot(self):   # plain data, for figures (kvlab.engine.snapshot)
        from kvlab.engine.snapshot import take_snapshot
        with self.core.lock:
            return take_snapshot(self)
