"""LLM: the offline, batch API (``generate``) over :class:`~kvlab.engine.llm_engine.LLMEngine`."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tqdm import tqdm

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine, Prompt, TokenizedPrompt
from kvlab.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from kvlab.engine.metrics import Metric

__all__ = ["LLM"]


class LLM:
    """Load a model (a shipped name such as ``"kvlab-tiny"`` or a Hugging Face directory) and
    generate for many prompts at once; keyword arguments are
    :class:`~kvlab.engine.engine_args.EngineArgs`' (``block_size``, ``max_num_seqs``, ...)."""

    def __init__(self, model, **engine_args):
        self.engine = LLMEngine(EngineArgs(model, **engine_args))
        self._counter = 0

    def get_metrics(self) -> list[Metric]:
        """The engine's counters in vLLM's shape (:func:`kvlab.engine.metrics.engine_metrics`)."""
        from kvlab.engine.metrics import engine_metrics

        return engine_metrics(self.engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def quantization_report(self):
        """Spec rule 7's five facts, weight and KV bytes (:mod:`kvlab.engine.quantization`)."""
        from kvlab.engine.quantization.report import engine_report

        return engine_report(self.engine)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt (str or token ids) to completion with one ``SamplingParams`` for all
        or one each; outputs in prompt order. All are validated before any is queued."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        sampling_params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        checked = []                  # validate (and encode) all before queueing any
        for p, sp in zip(prompts, params, strict=True):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
            text, token_ids, sp = engine.validate_request(p, sp)
            checked.append((TokenizedPrompt(text, token_ids), sp))
        ids, done = [], {}     # request ids in prompt order; their final outputs
        bar = tqdm(total=len(prompts), desc="Processed prompts", unit="req",
                   disable=None if use_tqdm else True)
        try:
            for prompt, sp in checked:
                rid = self._next_id()
                ids.append(rid)                      # aborted if anything below raises
                engine.add_request(rid, prompt, sp)
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
