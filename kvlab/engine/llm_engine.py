"""LLMEngine: the step-level engine (requests in, one step of the engine core per ``step()``).

Ownership: :class:`~kvlab.core.engine_core.EngineCore` runs the one step loop (schedule →
execute → update) over the scheduler of :mod:`kvlab.core`, which owns requests, queues and KV
blocks, and the :class:`~kvlab.engine.model_runner.ModelRunner`, which owns the tensors and
samples. This class owns what neither should know: tokenization, sampling parameters, the
``n`` samples of a request, timestamps, and the :class:`~kvlab.engine.outputs.RequestOutput`
objects handed back.

**Parallel sampling fans out at admission** (as in vLLM v1): ``n > 1`` enters the scheduler as
requests ``r``, ``r#1``, …, with seeds ``s + i``, sharing full prompt blocks through the prefix
cache; nothing forks mid-step (chapter 7 states the cost).

Threading: one thread calls :meth:`step`; other threads may call :meth:`add_request` and
:meth:`abort_request` at any time (an abort during a step takes effect when the step ends; its
final output is returned at once). A second concurrent :meth:`step` raises
:class:`~kvlab.core.engine_core.EngineBusy`.

Every public method validates its input before mutating anything: a bad request raises
(ValueError / KeyError / TypeError naming the problem) and the engine is unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from kvlab.core.checks import is_int
from kvlab.core.engine_core import EngineCore
from kvlab.core.kv_manager import KVCacheManager
from kvlab.core.scheduler_api import (
    RuntimeRequest,
)
from kvlab.core.scheduler_config import SchedulerConfig

from .engine_args import (
    DEFAULT_KV_CACHE_MEMORY_CPU,
    SEED_MOD,
    EngineArgs,
    resolve_device,
    resolve_dtype,
    size_kv_cache,
)
from .engine_build import (
    engine_cache_scope,
    load_engine_checkpoint,
    make_scheduler,
    parse_kv_transfer,
    resolve_max_model_len,
)
from .model_runner import StepInfo
from .outputs import (
    EngineStats,
    OutputProcessor,
    RequestMetrics,
    RequestOutput,
    RequestState,
    SampleState,
    StepTrace,
)
from .params import SamplingParams
from .quantization.setup import EngineQuantization
from .sampling import SamplerState
from .spec_decode.setup import Speculator
from .structured_outputs.manager import StructuredOutputManager
from .tokenizer import load_tokenizer

__all__ = ["DEFAULT_KV_CACHE_MEMORY_CPU", "EngineArgs", "EngineStats", "LLMEngine", "Prompt",
           "StepTrace"]

Prompt = str | Sequence[int]

_SAMPLE_SEP = "#"  # sample i > 0 of request "r" runs as request "r#i"


class LLMEngine:
    """A real model stepping through paged KV, built from one frozen :class:`EngineArgs`
    (``LLMEngine(EngineArgs("kvlab-tiny", max_model_len=256))``). See the module docstring."""

    def __init__(self, args: EngineArgs):
        from .invariant_hook import attach
        if not isinstance(args, EngineArgs):
            raise TypeError(f"LLMEngine takes an EngineArgs, got {type(args).__name__} "
                            "(LLMEngine(EngineArgs(model, ...)); LLM(model, ...) builds one)")
        self.args = a = args
        model, block_size, num_blocks = a.model, a.block_size, a.num_blocks
        max_num_seqs, max_num_batched_tokens = a.max_num_seqs, a.max_num_batched_tokens
        max_model_len, enable_prefix_caching = a.max_model_len, a.enable_prefix_caching
        tokenizer, security_domain = a.tokenizer, a.security_domain
        quant = EngineQuantization.resolve(a.quantization, a.quantization_group_size,
                                           a.kv_cache_dtype)
        transfer = parse_kv_transfer(a.kv_transfer_config, enable_prefix_caching, quant)
        dev = resolve_device(a.device)
        dtype = resolve_dtype(a.dtype, dev)
        ckpt = load_engine_checkpoint(model, quant, dev, dtype)
        self.quantization = quant
        self.checkpoint = ckpt
        self.model = ckpt.model
        self.config = cfg = ckpt.config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(ckpt.path)
        self.device, self.dtype = dev, dtype
        self.speculator = Speculator.load(a.speculative_config, cfg, self.tokenizer, dev, dtype)
        self.max_model_len = max_model_len = resolve_max_model_len(cfg, max_model_len)
        itemsize = torch.empty((), dtype=dtype).element_size()
        size = size_kv_cache(
            block_bytes=(quant.kv_bytes_per_token(cfg, itemsize) + Speculator.kv_bytes(
                self.speculator, itemsize)) * block_size, block_size=block_size,
            num_blocks=num_blocks, kv_cache_memory=a.kv_cache_memory, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, device=dev)
        self.model.prepare_rope(max_model_len)
        self.block_size = block_size
        self.num_blocks = size.num_blocks
        self.cache = quant.make_kv_cache(cfg, size.num_blocks, block_size, dtype, dev)
        self.kv = KVCacheManager(size.num_blocks, block_size,
                                 enable_prefix_caching=enable_prefix_caching)
        # A step's batch never holds more requests than tokens (each entry takes >= 1), so the
        # schedulers' rule max_num_seqs <= max_num_batched_tokens loses nothing here.
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=min(max_num_seqs, max_num_batched_tokens),
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk=a.max_prefill_chunk or max_num_batched_tokens,
            num_lookahead_tokens=self.speculator.num_lookahead if self.speculator else 0)
        self.scheduler = make_scheduler(a.scheduler, self.kv, self.scheduler_config)
        self.kv_transfer = None
        if transfer is not None:   # prefill/decode disaggregation (chapter 10)
            from .kv_transfer import KVPayloadCodec, KVTransfer, engine_model_fields
            self.kv_transfer = KVTransfer(transfer, KVPayloadCodec(self.cache),
                                          engine_model_fields(ckpt.weights_hash, cfg, dtype))
            self.scheduler = self.kv_transfer.wrap(self.scheduler)
        self.executor = Speculator.make_executor(self.speculator, self.model, self.cache,
                                                 self.scheduler.get_request, max_model_len)
        self.core = EngineCore(self.scheduler, self.executor)
        self.invariant_hook = attach(self, a.check_invariants)   # None unless "every_step"
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.seed = a.seed
        self.security_domain = security_domain
        self.eos_token_ids = tuple(dict.fromkeys(cfg.eos_token_ids + ckpt.generation_eos))
        self._arrivals = 0
        self._scopes: dict[str, tuple] = {}   # security domain -> prefix-cache scope
        self._ending: dict[str, tuple[str, ...]] = {}   # aborted request id -> its sample ids
        self.last_trace: StepTrace | None = None
        self.stats = EngineStats()
        self.structured_outputs = StructuredOutputManager(self.tokenizer, cfg.vocab_size,
                                                          self.eos_token_ids)
        self.outputs = OutputProcessor(
            self.scheduler.get_request,
            self.tokenizer.decode if self.tokenizer is not None else None)
        self.clock: Callable[[], float] = time.monotonic
        self.cache_scope()   # the default tenant's scope, built once here

    # ------------------------------------------------------------------ scope and prompts
    def cache_scope(self, security_domain: str | None = None) -> tuple:
        """The prefix-cache scope of this engine's requests (spec rule 4), as a hashable key.
        Computed once per security domain (everything else in it is fixed at construction)."""
        domain = security_domain or self.security_domain
        scope = self._scopes.get(domain)
        if scope is None:
            if len(self._scopes) >= 64:   # many tenants: keep the memory bounded
                self._scopes.clear()
            scope = self._scopes[domain] = engine_cache_scope(
                self.checkpoint, self.tokenizer, self.block_size, domain, self.quantization,
                self.dtype)
        return scope

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, tuple[int, ...]]:
        """(text or None, token ids) of a prompt; ValueError/TypeError naming the problem."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass prompts as token ids")
            ids = tuple(self.tokenizer.encode(prompt))
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)):
            if not all(is_int(t) for t in prompt):
                raise TypeError("prompt token ids must be ints")
            ids = tuple(prompt)
            text = None
        else:
            raise TypeError(f"prompt must be a str or a sequence of token ids, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary "
                             f"(0..{self.config.vocab_size - 1})")
        return text, ids

    # ------------------------------------------------------------------ requests
    def _seq_id(self, request_id: str, i: int) -> str:
        return request_id if i == 0 else f"{request_id}{_SAMPLE_SEP}{i}"

    def _runtime_request(self, state: RequestState, sample: SampleState, scope: tuple,
                         seed: int) -> tuple[RuntimeRequest, SamplerState]:
        """The scheduler's request for ``sample`` and the executor's sampler state for it."""
        p = state.params
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops.update(self.eos_token_ids[1:])  # extra eos ids act as stop tokens
        sampler = SamplerState.create(p, (seed + sample.index) % SEED_MOD, self.device)
        if p.structured_outputs is not None:
            stops.update(self.structured_outputs.stop_token_ids_for(p))  # ends at EOS
            sampler.grammar = self.structured_outputs.new_state(p)  # one per sample (n > 1)
        return RuntimeRequest(
            request_id=sample.seq_id,
            prompt_token_ids=state.prompt_token_ids,
            max_tokens=p.max_tokens,
            scope=scope,
            stop_token_ids=frozenset(stops),
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            ignore_eos=p.ignore_eos,
            arrival_time=state.metrics.arrival_time,
            max_model_len=self.max_model_len,
        ), sampler

    def validate_request(self, prompt: Prompt, params: SamplingParams | None = None,
                         request_id: str | None = None
                         ) -> tuple[str | None, tuple[int, ...], SamplingParams]:
        """Every check :meth:`add_request` makes, without queueing anything.

        Returns ``(prompt text or None, token ids, params)``; raises ValueError / TypeError
        naming the problem (empty or too long prompt, ids outside the vocabulary, bad params,
        a request that can never fit the KV cache, a bad or duplicate ``request_id``).
        """
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
            if _SAMPLE_SEP in request_id:
                raise ValueError(f"request_id {request_id!r} may not contain {_SAMPLE_SEP!r} "
                                 "(reserved for the samples of n > 1 requests)")
            if request_id in self.outputs.requests:
                raise ValueError(f"duplicate request_id {request_id!r}: already in the engine")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.config.vocab_size)
        if params.structured_outputs is not None:
            self.structured_outputs.validate(params)  # compiles (cached): a bad grammar raises
        text, ids = self.encode_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context: "
                             f"max_model_len={self.max_model_len} leaves no room to generate")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} samples exceed max_num_seqs={self.max_num_seqs}")
        longest = min(len(ids) + params.max_tokens, self.max_model_len) - 1  # last token: no KV
        if -(-longest // self.block_size) > self.num_blocks:
            raise ValueError(
                f"request needs up to {longest} tokens of KV "
                f"({-(-longest // self.block_size)} blocks) but the cache has {self.num_blocks}")
        return text, ids, params

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    *, security_domain: str | None = None) -> None:
        """Queue a request (its ``n`` samples). ValueError/TypeError (engine unchanged) on bad
        input, see :meth:`validate_request`. ``security_domain`` overrides the engine's
        default tenant. Safe to call from another thread while one thread steps."""
        text, ids, params = self.validate_request(prompt, params, request_id)
        if security_domain is not None and (not isinstance(security_domain, str)
                                            or not security_domain):
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
                seed = (self.seed * 1_000_003 + self._arrivals) % (2**63)
            state = RequestState(request_id, text, ids, params, RequestMetrics(self.clock()))
            state.samples = [SampleState(self._seq_id(request_id, i), i,
                                         [] if params.logprobs is not None else None)
                             for i in range(params.n)]
            requests = [self._runtime_request(state, s, scope, seed) for s in state.samples]
            for request, sampler in requests:   # validated above: these cannot raise
                self.executor.add_request(request.request_id, sampler)
                self.core.add_request(request)
            self.outputs.add(state)
            self._arrivals += 1

    def abort_request(self, request_id: str) -> RequestOutput:
        """Cancel a request (all its samples) and free its KV (at the end of the step in flight,
        if any). KeyError for an unknown id. Returns its final output (``finish_reason="abort"``
        on unfinished samples); the next :meth:`step` returns it as well, so a loop that steps
        until its requests finish (:meth:`LLM.generate`) sees an abort from another thread."""
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
            else:
                self.executor.remove_requests(ids)
            state.metrics.finished_time = self.clock()
            out = self.outputs.make_output(state, force_finished=True)
            self.outputs.drop(state)
            self.outputs.defer(out)   # the next step() reports it too (LLM.generate waits)
            return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests) or bool(self.outputs.undelivered)

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
        """Hand ``outputs`` back: the next :meth:`step` returns them (the latest per request)
        besides its own. :meth:`LLM.generate` uses it for requests it did not add."""
        with self.core.lock:
            for out in outputs:
                self.outputs.defer(out)

    # ------------------------------------------------------------------ the step
    def step(self, *, only_finished: bool = False) -> list[RequestOutput]:
        """Run one step of the engine core. Returns the outputs of every request that got a
        token, finished, or was rejected (``only_finished``: of those that finished)."""
        t0 = time.perf_counter()
        result = self.core.step()
        with self.core.lock:
            self.executor.remove_requests(r.request_id for r in result.ended + result.aborted)
            outputs = self.outputs.process(result, self.clock(), self.stats, only_finished)
            for request_id in list(self._ending):
                self._samples_ending(request_id)     # forgets the aborts that have ended
            info: StepInfo = result.model.info
            self.last_trace = StepTrace(result.output, info.metadata, info.request_ids,
                                        info.logits_shape, dict(result.model.sampled),
                                        [r.request_id for r in result.ended])
        self.stats.add_step(result, time.perf_counter() - t0)
        return outputs

    # ------------------------------------------------------------------ inspection
    def check_invariants(self) -> None:
        """The scheduler's and KV manager's invariants, plus engine bookkeeping agreement."""
        with self.core.lock:
            self.scheduler.check_invariants()
            self.kv.check_invariants()
            for rid, (state, sample) in self.outputs.samples.items():
                assert self.outputs.requests.get(state.request_id) is state, f"orphan {rid}"
                assert sample.ended is not None or self.scheduler.find_request(rid) is not None, \
                    f"the scheduler lost {rid}"
            batch = self.executor.input_batch
            rows = batch.row_ids()
            for rid in self.kv.requests():   # the runner's tables, kept from deltas alone
                if rid in rows:
                    table = self.kv.block_table(rid)   # (a rollback is sent with the next step)
                    assert batch.table(rid)[:len(table)] == table, f"runner's table of {rid}"
            samplers = self.executor.samplers
            for rid in samplers:
                assert self.scheduler.find_request(rid) is not None, \
                    f"the executor keeps the sampler of forgotten request {rid}"
            self.structured_outputs.check_states(
                (r.request_id, samplers.get(r.request_id), r.output_token_ids)
                for r in self.scheduler.requests() if not r.status.is_terminal)
            for state in self.outputs.requests.values():
                assert state.samples, f"request {state.request_id} has no sample"

    def quantization_report(self):
        """Spec rule 7's five facts, weight and KV bytes (:mod:`kvlab.engine.quantization`)."""
        from .quantization.report import build_report
        with self.core.lock:
            return build_report(self.quantization, self.model, self.cache, self.block_size,
                                self.stats.forward_passes)

    def snapshot(self):
        """Plain-data view of the engine (see :mod:`kvlab.engine.snapshot`)."""
        from .snapshot import take_snapshot

        with self.core.lock:
            return take_snapshot(self)
