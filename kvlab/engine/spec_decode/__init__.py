"""Speculative decoding in the engine (chapter 9).

- :mod:`.config`: ``speculative_config`` validated (``draft_model`` / ``ngram``);
- :mod:`.proposers`: n-gram prompt lookup and a draft model over its own paged KV;
- :mod:`.verifier`: the exact rejection sampler (float64), processed probabilities;
- :mod:`.rng`: counter-based random streams per (seed, position);
- :mod:`.executor`: :class:`SpecExecutor`, the engine core's executor when speculating;
- :mod:`.metrics`: vLLM-named counters and a per-step history;
- :mod:`.setup`: :class:`Speculator`, what the engine builds from the config.

The scheduler's half (lookahead slots, multi-token results, rollback of block tables) is
torch-free, in :mod:`kvlab.core.spec_plan`.
"""

from kvlab.engine.spec_decode.config import SpeculativeConfig
from kvlab.engine.spec_decode.executor import SpecExecutor, SpecStepInfo
from kvlab.engine.spec_decode.metrics import SpecDecodeMetrics, SpecRecord
from kvlab.engine.spec_decode.proposers import DraftModelProposer, NgramProposer, ngram_lookup
from kvlab.engine.spec_decode.setup import Speculator
from kvlab.engine.spec_decode.verifier import Verdict, processed_probs, verify

__all__ = ["DraftModelProposer", "NgramProposer", "SpecDecodeMetrics", "SpecExecutor",
           "SpecRecord", "SpecStepInfo", "SpeculativeConfig", "Speculator", "Verdict",
           "ngram_lookup", "processed_probs", "verify"]
