"""Structured outputs: a request's grammar state (regex, JSON schema, choice, EBNF).

``SamplingParams(structured_outputs={"json": schema} | {"regex": r} | {"choice": [...]} |
{"grammar": ebnf})`` constrains a request's output to a formal language. The engine

1. validates the shape in ``SamplingParams`` (:mod:`kvlab.core.sampling_params`), and compiles it
   against the
   model's vocabulary at ``add_request`` (:class:`GrammarCompiler`, cached; a bad pattern raises
   :class:`GrammarError` before anything is queued);
2. gives every sequence (each of the ``n`` samples) its own :class:`GrammarState`, kept in
   ``SamplerState.grammar``, which the executor owns with the rest of the sampler state;
3. each step, masks the logits rows of constrained sequences with their allowed next tokens
   and advances each grammar by the sampled token (:func:`sample_with_grammars`, the executor's
   one hook); the grammar ends at EOS, which finishes the request with ``"stop"``.

**Preemption keeps the state.** kvlab's recompute keeps a preempted request's output tokens
and only rebuilds their KV, so the grammar state, which has accepted exactly those tokens,
stays valid; no replay is needed. :meth:`GrammarState.rebuild` replays tokens where a state
must be rebuilt from scratch; :meth:`GrammarState.rollback` undoes rejected speculative tokens.

The parameter (:class:`~kvlab.core.sampling_params.StructuredOutputsParams`) loads eagerly (no
torch, no xgrammar); the rest on first use.
"""

from __future__ import annotations

from kvlab._lazy import lazy_exports
from kvlab.core.sampling_params import (
    KINDS,
    StructuredOutputsParams,
    check_structured_outputs,
)

_LAZY = {
    "GrammarCompiler": ".grammar",
    "GrammarError": ".grammar",
    "GrammarState": ".grammar",
    "choice_ebnf": ".grammar",
    "allocate_bitmask": ".bitmask",
    "apply_bitmask": ".bitmask",
    "apply_token_bitmask": ".bitmask",
    "sample_with_grammars": ".bitmask",
    "unpack_bitmask": ".bitmask",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)

__all__ = ["KINDS", "StructuredOutputsParams", "check_structured_outputs", *_LAZY]
