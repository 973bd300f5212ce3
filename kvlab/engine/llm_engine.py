"""LLMEngine: the step-level engine (requests in, one scheduler step + one forward per ``step()``).

Ownership: the scheduler (:mod:`kvlab.core`) owns requests, queues and KV blocks; the
:class:`~kvlab.engine.executor.TorchExecutor` owns the tensors; this class owns what neither
should know: tokenization, sampling parameters and random streams, ``n > 1`` sample groups,
timestamps, and the :class:`~kvlab.engine.outputs.RequestOutput` objects handed back.

One ``step()``:

1. ``out = scheduler.schedule()`` (admission, chunking, KV allocation, copy-on-write list);
2. the executor copies ``out.copies`` on the KV tensors, then ``kv.complete_copies``;
3. forward over ``out.chunks``; for every chunk with ``sample=True`` the logits of its last
   token are sampled. A request with ``n > 1`` forks its extra samples (``scheduler.fork``)
   right after its prompt's last chunk ran, and each sample draws its own first token from the
   same logits row;
4. ``scheduler.update_from_output(out, sampled)`` appends tokens, applies stop conditions,
   commits KV to the prefix cache and frees finished requests.

Every public method validates its input before mutating anything: a bad request raises
(ValueError / KeyError / TypeError naming the problem) and the engine is unchanged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvlab.core.scheduler_api import (
    FinishReason,
    RequestStatus,
    RuntimeRequest,
    Scheduler,
    SchedulerOutput,
)
from kvlab.core.scope import CacheScope

from .checkpoint import LoadedCheckpoint, load_checkpoint
from .executor import TorchExecutor
from .kv_cache import PagedKVCache
from .model import rope_inv_freq
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .params import SamplingParams
from .sampling import SamplerState, sample
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["DEFAULT_KV_CACHE_MEMORY_CPU", "EngineStats", "LLMEngine", "Prompt", "StepTrace"]

Prompt = str | Sequence[int]

#: Default KV budget on CPU when ``num_blocks`` is None (bytes). On CUDA the default is half of
#: the device memory free after loading the weights. Either way the cache is capped at what
#: ``max_num_seqs`` requests of ``max_model_len`` tokens can use.
DEFAULT_KV_CACHE_MEMORY_CPU = 512 * 2**20

_SAMPLE_SEP = "#"  # sample i > 0 of request "r" runs as request "r#i"


@dataclass
class _Sequence:
    """Engine-side state of one sample (one RuntimeRequest)."""

    seq_id: str
    index: int
    sampler: SamplerState
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float = 0.0


@dataclass
class _Group:
    """A client request: its prompt, parameters and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[_Sequence] = field(default_factory=list)
    forked: bool = False
    base_seed: int = 0
    num_cached_tokens: int = 0
    admitted: bool = False


@dataclass
class StepTrace:
    """What the last :meth:`LLMEngine.step` did, for teaching and debugging (references only).

    ``scheduler_output``: the scheduler's decisions (chunks, copies, admissions, preemptions);
    ``metadata``: the executor's flat-batch layout (``input_ids``, ``positions``,
    ``slot_mapping``, decode buckets, prefill chunks); ``sampled_from``: request ids whose
    logits rows were sampled, in row order; ``logits_shape``: ``(rows, vocab)``;
    ``sampled``: token per sequence (forked samples included); ``finished``: sequence ids that
    ended in this step.
    """

    scheduler_output: SchedulerOutput
    metadata: Any
    sampled_from: list[str]
    logits_shape: tuple[int, ...]
    sampled: dict[str, int]
    finished: list[str]


@dataclass
class EngineStats:
    """Counters since the engine started (times in seconds)."""

    steps: int = 0
    prompt_tokens: int = 0            # prompt tokens of admitted requests
    cached_prompt_tokens: int = 0     # of which served by the prefix cache
    computed_tokens: int = 0          # tokens run through the model (prefill + decode)
    generated_tokens: int = 0
    finished_requests: int = 0
    step_time_s: float = 0.0          # whole step() wall time
    model_time_s: float = 0.0         # executor forward (copies + model + logits)
    prepare_time_s: float = 0.0       # executor metadata building
    schedule_time_s: float = 0.0      # scheduler.schedule() + update_from_output()
    sample_time_s: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of step time spent outside the model forward (scheduling, metadata, sampling,
        bookkeeping)."""
        return 1.0 - self.model_time_s / self.step_time_s if self.step_time_s else 0.0


def _default_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _make_scheduler(kind: str | Callable[..., Scheduler], kv: Any, config: Any) -> Scheduler:
    """``"baseline"`` / ``"production"`` (kvlab.core.scheduler) or a factory
    ``(kv, SchedulerConfig) -> Scheduler``."""
    from kvlab.core import scheduler as sched_mod

    if callable(kind) and not isinstance(kind, str):
        return kind(kv, config)
    classes = {"baseline": sched_mod.BaselineScheduler, "production": sched_mod.ProductionScheduler}
    if kind not in classes:
        raise ValueError(f"unknown scheduler {kind!r}; expected one of {sorted(classes)} "
                         "or a factory (kv, SchedulerConfig) -> Scheduler")
    return classes[kind](kv, config)


class LLMEngine:
    """A real model stepping through paged KV. See the module docstring for one step.

    ``model``: shipped model name, local Hugging Face directory, or a
    :class:`~kvlab.engine.checkpoint.LoadedCheckpoint` (used in place: moved to this engine's
    device and dtype, so engines sharing one must agree on both). ``num_blocks=None`` sizes the
    cache from ``kv_cache_memory`` bytes (default :data:`DEFAULT_KV_CACHE_MEMORY_CPU` on CPU,
    half the free memory on CUDA), capped at ``max_num_seqs * max_model_len`` tokens.
    ``max_model_len`` defaults to the model's ``max_position_embeddings``. ``max_prefill_chunk``
    caps the prefill tokens one request gets per step (None: the whole step budget).
    ``security_domain`` is the default tenant of requests (part of every prefix-cache scope).
    """

    def __init__(
        self,
        model: str | Path | LoadedCheckpoint,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_prefill_chunk: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        scheduler: str | Callable[..., Scheduler] = "baseline",
        kv_cache_memory: int | None = None,
        security_domain: str = "default",
        tokenizer: Tokenizer | None = None,
    ):
        for name, v in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"LLMEngine: {name} must be a positive int, got {v!r}")
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks <= 0):
            raise ValueError(f"LLMEngine: num_blocks must be a positive int or None, "
                             f"got {num_blocks!r}")
        if not isinstance(seed, int):
            raise ValueError(f"LLMEngine: seed must be an int, got {seed!r}")
        for name, v in (("max_prefill_chunk", max_prefill_chunk),
                        ("kv_cache_memory", kv_cache_memory)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"LLMEngine: {name} must be a positive int or None, got {v!r}")
        if isinstance(scheduler, str) and scheduler not in ("baseline", "production"):
            raise ValueError(f"unknown scheduler {scheduler!r}; expected 'baseline', "
                             "'production' or a factory (kv, SchedulerConfig) -> Scheduler")
        if not isinstance(security_domain, str) or not security_domain:
            raise ValueError(f"LLMEngine: security_domain must be a non-empty str, "
                             f"got {security_domain!r}")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("LLMEngine: device='cuda' requested but CUDA is not available")
        if isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"LLMEngine: unknown dtype {dtype!r}")
            dtype = getattr(torch, dtype)
        dtype = dtype or _default_dtype(dev)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"LLMEngine: dtype must be a floating-point torch dtype, "
                             f"got {dtype!r}")
        if isinstance(model, LoadedCheckpoint):
            ckpt = model
            ckpt.model.to(device=dev, dtype=dtype)
            # RoPE frequencies stay float32 (recomputed: a cast to half precision loses bits)
            ckpt.model.inv_freq = rope_inv_freq(ckpt.config.rope, ckpt.config.head_dim,
                                                ckpt.config.max_position_embeddings).to(dev)
        else:
            ckpt = load_checkpoint(model, dtype=dtype, device=dev)
        self.checkpoint = ckpt
        self.model = ckpt.model
        self.config = cfg = ckpt.config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(ckpt.path)
        self.device, self.dtype = dev, dtype
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        if not isinstance(max_model_len, int) or not 0 < max_model_len <= (
                cfg.max_position_embeddings * (cfg.rope.factor if cfg.rope.rope_type != "default"
                                               else 1)):
            raise ValueError(f"LLMEngine: max_model_len must be in 1..{cfg.max_position_embeddings}"
                             f" (scaled by the RoPE factor), got {max_model_len!r}")
        self.max_model_len = max_model_len
        self.model.prepare_rope(max_model_len)
        itemsize = torch.empty((), dtype=dtype).element_size()
        block_bytes = cfg.kv_bytes_per_token(itemsize) * block_size
        if num_blocks is None:
            if kv_cache_memory is None:
                if dev.type == "cuda":
                    free, _ = torch.cuda.mem_get_info(dev)
                    kv_cache_memory = free // 2
                else:
                    kv_cache_memory = DEFAULT_KV_CACHE_MEMORY_CPU
            cap = math.ceil(max_num_seqs * max_model_len / block_size) + max_num_seqs
            num_blocks = max(1, min(kv_cache_memory // block_bytes, cap))
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cache = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                  cfg.head_dim, dtype=dtype, device=dev)
        self.executor = TorchExecutor(self.model, self.cache)
        from kvlab.core.kv_manager import KVCacheManager

        self.kv = KVCacheManager(num_blocks, block_size,
                                 enable_prefix_caching=enable_prefix_caching)
        from kvlab.core.scheduler import SchedulerConfig

        # A step's batch never holds more requests than tokens (each entry takes >= 1), so the
        # schedulers' rule max_num_seqs <= max_num_batched_tokens loses nothing here.
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=min(max_num_seqs, max_num_batched_tokens),
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk=max_prefill_chunk or max_num_batched_tokens)
        self.scheduler = _make_scheduler(scheduler, self.kv, self.scheduler_config)
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.seed = seed
        self.security_domain = security_domain
        self.eos_token_ids = tuple(dict.fromkeys(cfg.eos_token_ids + ckpt.generation_eos))
        self._groups: dict[str, _Group] = {}
        self._seq_owner: dict[str, tuple[_Group, _Sequence]] = {}
        self._scopes: dict[str, tuple] = {}
        self._arrivals = 0
        self._step_count = 0
        self._last_output: SchedulerOutput | None = None
        self._last_sampled: dict[str, int] = {}
        self.last_trace: StepTrace | None = None
        self.stats = EngineStats()
        self.clock: Callable[[], float] = time.monotonic

    # ------------------------------------------------------------------ scope and prompts
    def cache_scope(self, security_domain: str | None = None) -> tuple:
        """The prefix-cache scope of this engine's requests (spec rule 4), as a hashable key."""
        cfg = self.config
        rope = cfg.rope
        return CacheScope(
            model=cfg.architecture,
            weights_version=self.checkpoint.weights_hash,
            tokenizer=self.tokenizer.hash if self.tokenizer is not None else "none",
            chat_template="none",  # kvlab applies no chat template; tokenizer hash covers config
            adapter="none",
            rope=(f"type={rope.rope_type},theta={rope.theta},factor={rope.factor},"
                  f"low={rope.low_freq_factor},high={rope.high_freq_factor},"
                  f"orig={rope.original_max_position_embeddings}"),
            kv_dtype=str(self.dtype).replace("torch.", ""),
            kv_layout=f"paged[block={self.block_size}][kv_heads={cfg.num_kv_heads}]"
                      f"[head_dim={cfg.head_dim}]",
            quant_schema="none",
            security_domain=security_domain or self.security_domain,
        ).key()

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, tuple[int, ...]]:
        """(text or None, token ids) of a prompt; ValueError/TypeError naming the problem."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass prompts as token ids")
            ids = tuple(self.tokenizer.encode(prompt))
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
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

    def _runtime_request(self, group: _Group, seq_id: str) -> RuntimeRequest:
        p = group.params
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops.update(self.eos_token_ids[1:])  # extra eos ids act as stop tokens
        return RuntimeRequest(
            request_id=seq_id,
            prompt_token_ids=group.prompt_token_ids,
            max_tokens=p.max_tokens,
            scope=self._scopes[group.request_id],
            stop_token_ids=frozenset(stops),
            eos_token_id=self.config.eos_token_id,
            ignore_eos=p.ignore_eos,
            arrival_time=group.metrics.arrival_time,
            max_model_len=self.max_model_len,
        )

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
            if request_id in self._groups:
                raise ValueError(f"duplicate request_id {request_id!r}: already in the engine")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.config.vocab_size)
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
        """Queue a request. ValueError/TypeError (engine unchanged) on bad input, see
        :meth:`validate_request`. ``security_domain`` overrides the engine's default tenant."""
        text, ids, params = self.validate_request(prompt, params, request_id)
        if security_domain is not None and (not isinstance(security_domain, str)
                                            or not security_domain):
            raise ValueError(f"security_domain must be a non-empty str, got {security_domain!r}")
        seed = params.seed
        if seed is None:  # reproducible per engine: engine seed and arrival order
            seed = (self.seed * 1_000_003 + self._arrivals) % (2**63)
        now = self.clock()
        group = _Group(request_id, text, ids, params, RequestMetrics(arrival_time=now),
                       base_seed=seed)
        scope = self.cache_scope(security_domain)
        seq = self._new_seq(group, 0)
        self._scopes[request_id] = scope
        try:
            self.scheduler.add_request(self._runtime_request(group, request_id))
        except Exception:
            self._scopes.pop(request_id, None)
            raise
        group.seqs.append(seq)
        self._groups[request_id] = group
        self._seq_owner[request_id] = (group, seq)
        self._arrivals += 1

    def _new_seq(self, group: _Group, i: int) -> _Sequence:
        p = group.params
        return _Sequence(self._seq_id(group.request_id, i), i,
                         SamplerState.create(p, group.base_seed + i, self.device),
                         [] if p.logprobs is not None else None)

    def abort_request(self, request_id: str) -> RequestOutput:
        """Cancel a request (all its samples) and free its KV. KeyError for an unknown id.
        Returns its final output (``finish_reason="abort"`` on unfinished samples)."""
        group = self._groups.get(request_id)
        if group is None:
            raise KeyError(f"abort_request: unknown request_id {request_id!r}")
        for seq in group.seqs:
            self.scheduler.abort_request(seq.seq_id)
        group.metrics.finished_time = self.clock()
        out = self._make_output(group, force_finished=True)
        self._drop(group)
        return out

    def _drop(self, group: _Group) -> None:
        for seq in group.seqs:
            self._seq_owner.pop(seq.seq_id, None)
        self._groups.pop(group.request_id, None)
        self._scopes.pop(group.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step and one forward pass. Returns the outputs of every request
        that got a token, finished, or was rejected this step."""
        return self._step(finished_only=False)

    def _group_done(self, group: _Group) -> bool:
        """Every sample ended. (Before the fork only the parent exists; if it ends then —
        rejected, failed, or done after one token — no sample will ever be forked from it.)"""
        return all(self.scheduler.get_request(s.seq_id).status.is_terminal for s in group.seqs)

    def _step(self, *, finished_only: bool) -> list[RequestOutput]:
        """:meth:`step`; ``finished_only`` skips building outputs of unfinished requests."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        self._step_count += 1
        now = self.clock()
        touched: dict[str, _Group] = {}
        for rid in out.rejected:
            entry = self._seq_owner.get(rid)
            if entry is not None:
                touched[entry[0].request_id] = entry[0]
        for c in out.chunks:
            group = self._seq_owner[c.request_id][0]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
        for rid in out.admitted:
            entry = self._seq_owner.get(rid)
            if entry is None or entry[1].index != 0 or entry[0].admitted:
                continue  # forks and re-admissions after preemption are not counted again
            entry[0].admitted = True
            req = self.scheduler.get_request(rid)
            entry[0].num_cached_tokens = req.num_cached_tokens
            self.stats.prompt_tokens += req.num_prompt_tokens
            self.stats.cached_prompt_tokens += min(req.num_cached_tokens, req.num_prompt_tokens)
        try:
            res = self.executor.execute(out.chunks, out.copies)
            if out.copies:
                self.kv.complete_copies(out.copies)
            t2 = time.perf_counter()
            sampled = self._sample(res.request_ids, res.logits, now, touched)
        except BaseException as error:
            self._fail_step(out, error)
            raise
        t3 = time.perf_counter()
        finished = self.scheduler.update_from_output(out, sampled)
        t4 = time.perf_counter()
        self._last_output, self._last_sampled = out, dict(sampled)
        self.last_trace = StepTrace(out, res.metadata, res.request_ids, tuple(res.logits.shape),
                                    dict(sampled), [r.request_id for r in finished])
        for req in finished:
            entry = self._seq_owner.get(req.request_id)
            if entry is not None:
                touched[entry[0].request_id] = entry[0]
        outputs = []
        for group in touched.values():
            if group.request_id not in self._groups:
                continue
            if finished_only and not self._group_done(group):
                continue
            o = self._make_output(group)
            if o.finished:
                group.metrics.finished_time = now
                o.metrics = group.metrics
                self.stats.finished_requests += 1
                self._drop(group)
            outputs.append(o)
        st = self.stats
        st.steps += 1
        st.computed_tokens += sum(c.num_tokens for c in out.chunks)
        st.generated_tokens += len(sampled)
        st.schedule_time_s += (t1 - t0) + (t4 - t3)
        st.prepare_time_s += res.prepare_s
        st.model_time_s += res.forward_s
        st.sample_time_s += t3 - t2
        st.step_time_s += time.perf_counter() - t0
        return outputs

    def _fail_step(self, out: SchedulerOutput, error: BaseException) -> None:
        """Execute or sample raised: the scheduler fails the step's requests (FAILED / ERROR,
        KV released, pending copies settled) and clears the step, so the engine keeps serving
        the other and new requests. The failed requests' final outputs (``finish_reason
        "error"``) come from the next :meth:`step`. A custom scheduler without ``fail_step``
        keeps the step in flight (the error is re-raised either way)."""
        fail = getattr(self.scheduler, "fail_step", None)
        if fail is not None:
            fail(out, f"step {out.step} failed: {type(error).__name__}: {error}")

    def _sample(self, request_ids: list[str], logits: torch.Tensor, now: float,
                touched: dict[str, _Group]) -> dict[str, int]:
        rows: list[int] = []
        pairs: list[tuple[_Group, _Sequence]] = []
        forked = False
        for row, rid in enumerate(request_ids):
            group, seq = self._seq_owner[rid]
            if group.params.n > 1 and not group.forked:
                self._fork(group)  # the samples all draw from this row
                forked = True
                for s in group.seqs:
                    rows.append(row)
                    pairs.append((group, s))
                continue
            rows.append(row)
            pairs.append((group, seq))
        if not pairs:
            return {}
        picked = logits[torch.tensor(rows, device=logits.device)] if forked else logits
        result = sample(picked, [s.sampler for _, s in pairs])
        sampled: dict[str, int] = {}
        for (group, seq), token, logprob, top in zip(
                pairs, result.token_ids, result.logprobs, result.top_logprobs, strict=True):
            sampled[seq.seq_id] = token
            seq.cumulative_logprob += logprob
            if seq.logprobs is not None:
                seq.logprobs.append(top)
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            touched[group.request_id] = group
        return sampled

    def _fork(self, group: _Group) -> None:
        """Create samples 1..n-1 sharing the parent's KV (after its prompt's last chunk ran)."""
        parent = group.seqs[0]
        for i in range(1, group.params.n):
            seq = self._new_seq(group, i)
            self.scheduler.fork(parent.seq_id, self._runtime_request(group, seq.seq_id))
            group.seqs.append(seq)
            self._seq_owner[seq.seq_id] = (group, seq)
        group.forked = True

    # ------------------------------------------------------------------ outputs
    def _make_output(self, group: _Group, force_finished: bool = False) -> RequestOutput:
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        completions = []
        all_done = True
        for seq in group.seqs:
            req = self.scheduler.get_request(seq.seq_id)
            reason = req.finish_reason.value if req.finish_reason is not None else None
            if req.status is RequestStatus.CANCELLED or (force_finished and reason is None):
                reason = FinishReason.ABORT.value
            if reason is None:
                all_done = False
            completions.append(CompletionOutput(
                index=seq.index, token_ids=list(req.output_token_ids), finish_reason=reason,
                logprobs=None if seq.logprobs is None else list(seq.logprobs),
                cumulative_logprob=seq.cumulative_logprob, _decode=decode))
            if seq.index == 0:
                group.metrics.num_preemptions = req.num_preemptions
        finished = force_finished or all_done
        return RequestOutput(group.request_id, group.prompt, list(group.prompt_token_ids),
                             completions, finished, group.metrics, group.num_cached_tokens)

    # ------------------------------------------------------------------ inspection
    def check_invariants(self) -> None:
        """The scheduler's and KV manager's invariants, plus engine bookkeeping agreement."""
        self.scheduler.check_invariants()
        self.kv.check_invariants()
        for rid, (group, _seq) in self._seq_owner.items():
            assert self._groups.get(group.request_id) is group, f"orphan sequence {rid}"
            req = self.scheduler.get_request(rid)
            assert req.request_id == rid, f"scheduler lost {rid}"
        for group in self._groups.values():
            assert group.seqs, f"request {group.request_id} has no sequence"

    def snapshot(self):
        """Plain-data view of the engine (see :mod:`kvlab.engine.snapshot`)."""
        from .snapshot import take_snapshot

        return take_snapshot(self)
