"""LLM: the offline, batch API (``generate``) over :class:`~kvlab.engine.llm_engine.LLMEngine`."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from tqdm import tqdm

from kvlab.core.scheduler_api import RequestStatus
from kvlab.engine.engine_args import EngineArgs

from .llm_engine import LLMEngine, Prompt
from .metrics import Counter, Gauge, Metric, Vector
from .outputs import RequestOutput
from .params import SamplingParams

__all__ = ["LLM"]


class LLM:
    """Load a model and generate for many prompts at once (continuous batching underneath).

    ``model`` is a shipped model name (``"kvlab-tiny"``) or a local Hugging Face directory. The
    keyword arguments are :class:`LLMEngine`'s (others: ``max_prefill_chunk``,
    ``max_model_len``, ``kv_cache_memory``, ``security_domain``, ``tokenizer``).
    """

    def __init__(
        self,
        model,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        device=None,
        dtype=None,
        seed: int = 0,
        scheduler="baseline",
        **engine_kwargs,
    ):
        self.engine = LLMEngine(EngineArgs(
            model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, device=device, dtype=dtype, seed=seed,
            scheduler=scheduler, **engine_kwargs))
        self._counter = 0

    def get_metrics(self) -> list[Metric]:
        """The engine's counters in vLLM's shape (:mod:`kvlab.engine.metrics`): ``Counter`` s
        ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:prefix_cache_queries`` /
        ``_hits`` (prompt tokens looked up / served by the cache), ``vllm:request_success`` per
        ``finished_reason`` label, ``Gauge`` s ``vllm:num_requests_running`` / ``_waiting``
        and ``vllm:kv_cache_usage_perc`` (a fraction, as in vLLM); when speculating,
        ``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` and
        the ``Vector`` ``vllm:spec_decode_num_accepted_tokens_per_pos``."""
        engine = self.engine
        with engine.core.lock:
            st = engine.stats
            labels = {"engine": "0"}
            out: list[Metric] = [
                Counter("vllm:prompt_tokens", dict(labels), st.prompt_tokens),
                Counter("vllm:generation_tokens", dict(labels), st.generated_tokens),
                Counter("vllm:prefix_cache_queries", dict(labels), st.prompt_tokens),
                Counter("vllm:prefix_cache_hits", dict(labels), st.cached_prompt_tokens),
            ]
            out += [Counter("vllm:request_success", {**labels, "finished_reason": reason}, n)
                    for reason, n in sorted(st.finished_by_reason.items())]
            live = [r.status for r in engine.scheduler.requests() if not r.status.is_terminal]
            running = sum(status is RequestStatus.RUNNING for status in live)
            waiting = len(live) - running
            kv = engine.kv
            out += [Gauge("vllm:num_requests_running", dict(labels), float(running)),
                    Gauge("vllm:num_requests_waiting", dict(labels), float(waiting)),
                    Gauge("vllm:kv_cache_usage_perc", dict(labels),
                          1.0 - kv.num_allocatable_blocks() / kv.num_blocks)]
            if engine.speculator is not None:
                m = engine.speculator.metrics
                out += [Counter("vllm:spec_decode_num_drafts", dict(labels), m.num_drafts),
                        Counter("vllm:spec_decode_num_draft_tokens", dict(labels),
                                m.num_draft_tokens),
                        Counter("vllm:spec_decode_num_accepted_tokens", dict(labels),
                                m.num_accepted_tokens),
                        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                               list(m.accepted_per_pos))]
        return out

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def quantization_report(self):
        """Spec rule 7's five facts and the weight / KV bytes (see
        :meth:`LLMEngine.quantization_report`)."""
        return self.engine.quantization_report()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``.

        ``prompts``: one prompt or a list; a prompt is a str or a list of token ids.
        ``sampling_params``: one for all prompts, or one per prompt. Every prompt is validated
        before any is queued (a bad one raises and nothing runs). Requests added to
        ``self.engine`` directly keep running alongside; their outputs produced meanwhile are
        returned by the engine's next ``step()``. ``use_tqdm``: a progress bar on a terminal
        (tqdm's convention: shown only when stderr is a TTY).
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        for p, sp in zip(prompts, params, strict=True):  # validate all before queueing any
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
            engine.validate_request(p, sp)
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="Processed prompts", unit="req",
                   disable=None if use_tqdm else True)
        try:
            for p, sp in zip(prompts, params, strict=True):
                rid = self._next_id()
                engine.add_request(rid, p, sp)
                ids.append(rid)
            mine = set(ids)
            while len(done) < len(ids):
                foreign = []
                for out in engine.step(only_finished=True):
                    if out.request_id in mine:
                        done[out.request_id] = out
                        bar.update(1)
                    else:
                        foreign.append(out)
                if foreign:
                    engine.defer_outputs(foreign)
        except BaseException:
            for rid in ids:  # leave the engine clean if interrupted
                if rid not in done:
                    with contextlib.suppress(KeyError):   # it ended in the step that raised
                        engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    def _next_id(self) -> str:
        """A request id no request in the engine uses (users may add their own, even gen-N)."""
        while True:
            rid = f"gen-{self._counter}"
            self._counter += 1
            if not self.engine.has_request(rid):
                return rid
