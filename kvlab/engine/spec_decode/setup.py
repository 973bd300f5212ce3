"""Loading a speculator for an engine: the validated config, the draft model, its executor."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvlab.engine.checkpoint import LoadedCheckpoint, load_checkpoint, tokenizer_hash
from kvlab.engine.config import ModelConfig
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.model import LlamaModel
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.ops import Kernels
from kvlab.engine.spec_decode.config import SpeculativeConfig
from kvlab.engine.spec_decode.executor import SpecExecutor
from kvlab.engine.spec_decode.metrics import SpecDecodeMetrics
from kvlab.engine.spec_decode.proposers import DraftModelProposer, NgramProposer
from kvlab.engine.structured_outputs.manager import StructuredOutputManager

if TYPE_CHECKING:
    from kvlab.engine.tokenizer import Tokenizer

__all__ = ["Speculator"]


class Speculator:
    """A validated :class:`SpeculativeConfig` and, for ``draft_model``, the loaded draft."""

    def __init__(self, config: SpeculativeConfig, draft: LoadedCheckpoint | None) -> None:
        self.config = config
        self.draft = draft
        self.metrics = SpecDecodeMetrics(config.num_speculative_tokens)

    @classmethod
    def load(cls, value: object, target: ModelConfig, tokenizer: Tokenizer | None,
             device: torch.device, dtype: torch.dtype) -> Speculator | None:
        """None for ``value=None``; else validate it and load the draft model (ValueError /
        TypeError naming the problem: bad keys, a draft with another vocabulary or tokenizer)."""
        config = SpeculativeConfig.from_user(value)
        if config is None:
            return None
        draft = None
        if config.method == "draft_model":
            assert config.model is not None
            draft = load_checkpoint(config.model, dtype=dtype, device=device)
            if draft.config.vocab_size != target.vocab_size:
                raise ValueError(f"speculative_config: draft model {config.model!r} has "
                                 f"{draft.config.vocab_size} tokens, the target "
                                 f"{target.vocab_size}: they must share one vocabulary")
            file = Path(draft.path) / "tokenizer.json"
            theirs = tokenizer_hash(file) if file.is_file() else None
            if (tokenizer is None) != (theirs is None) or (
                    tokenizer is not None and tokenizer.hash != theirs):
                raise ValueError(f"speculative_config: draft model {config.model!r} does not "
                                 "share the target's tokenizer")
        return cls(config, draft)

    @property
    def num_lookahead(self) -> int:
        return self.config.num_speculative_tokens

    @staticmethod
    def kv_bytes(speculator: Speculator | None, itemsize: int) -> int:
        """Extra KV bytes per token slot (the draft's cache; 0 for n-gram or no speculator)."""
        if speculator is None or speculator.draft is None:
            return 0
        return speculator.draft.config.kv_bytes_per_token(itemsize)

    @staticmethod
    def make_executor(speculator: Speculator | None, model: LlamaModel, cache: PagedKVCache,
                      max_model_len: int, kernels: Kernels,
                      structured_outputs: StructuredOutputManager,
                      eos_token_ids: Sequence[int]) -> SpecExecutor | ModelRunner:
        """The engine's executor: :class:`ModelRunner` without a speculator, else a
        :class:`SpecExecutor` whose draft cache gets the target cache's geometry."""
        if speculator is None:
            return ModelRunner(model, cache, kernels, structured_outputs, eos_token_ids)
        return speculator.executor(model, cache, max_model_len, kernels, structured_outputs,
                                   eos_token_ids)

    def executor(self, model: LlamaModel, cache: PagedKVCache, max_model_len: int,
                 kernels: Kernels, structured_outputs: StructuredOutputManager,
                 eos_token_ids: Sequence[int]) -> SpecExecutor:
        """A :class:`SpecExecutor` for this config."""
        cfg = self.config
        if self.draft is not None:
            self.draft.model.prepare_rope(max_model_len)
            proposer: DraftModelProposer | NgramProposer = DraftModelProposer(
                self.draft.model, cache.num_blocks, cache.block_size, kernels)
        else:
            proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        return SpecExecutor(model, cache, kernels, proposer, self.metrics, structured_outputs,
                            eos_token_ids)
