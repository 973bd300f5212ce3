"""The engine's structured-outputs front: validation at ``add_request``, one grammar state per
sequence, and the bookkeeping invariant. Importing it loads neither xgrammar nor a compiler:
the compiler is built on the first constrained request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvlab.core.request import PLACEHOLDER
from kvlab.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvlab.engine.structured_outputs.grammar import GrammarCompiler, GrammarState
    from kvlab.engine.tokenizer import Tokenizer

__all__ = ["StructuredOutputManager", "grammar_mismatch"]


class StructuredOutputManager:
    """Compiles (and caches) the grammars of one engine's requests.

    ``tokenizer``: the engine's tokenizer (None: constrained requests are refused, since a
    grammar is a language of *text*). ``vocab_size``: the model's logits width.
    ``stop_token_ids``: the model's EOS ids, which end every grammar.
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler (built on first use). ValueError without tokenizer or EOS."""
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.structured_outputs needs the model's tokenizer "
                                 "(this model ships no tokenizer.json)")
            if not self.stop_token_ids:
                raise ValueError("SamplingParams.structured_outputs needs an EOS token to end "
                                 "the grammar (the model config names none)")
            from kvlab.engine.structured_outputs.grammar import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                             self.stop_token_ids)
        return self._compiler

    def validate(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` if set (cached): GrammarError / ValueError
        naming the problem when it does not compile. Changes nothing else."""
        if params.structured_outputs is not None:
            self.compiler.compile(params.structured_outputs)

    def new_state(self, params: SamplingParams) -> GrammarState | None:
        """A fresh grammar state for one sequence of ``params`` (None if unconstrained)."""
        if params.structured_outputs is None:
            return None
        return self.compiler.new_state(params.structured_outputs)

    def stop_token_ids_for(self, params: SamplingParams) -> frozenset[int]:
        """Extra stop tokens of a request: the grammar's end (EOS) ends a constrained request,
        even with ``ignore_eos``."""
        return frozenset(self.stop_token_ids if params.structured_outputs is not None else ())

    @staticmethod
    def check_states(sequences: Iterable[tuple[str, object, Sequence[int]]]) -> None:
        """AssertionError unless every ``(request id, sampler state, output_token_ids)`` with a
        grammar has accepted exactly its output tokens (the invariant of the engine); see
        :func:`grammar_mismatch` for the outputs of steps in flight (overlap scheduling)."""
        for rid, state, outputs in sequences:
            grammar = getattr(state, "grammar", None)
            problem = grammar_mismatch(grammar, outputs) if grammar is not None else None
            assert problem is None, f"{rid}: {problem}"


def grammar_mismatch(grammar: GrammarState, outputs: Sequence[int]) -> str | None:
    """Why ``grammar`` has not accepted exactly ``outputs`` (None when it has). A trailing
    :data:`~kvlab.core.request.PLACEHOLDER` is a token of a step in flight that the executor
    has already run: the grammar accepted some token there, unless it had terminated."""
    outputs = tuple(outputs)
    n = len(outputs) - outputs.count(PLACEHOLDER)         # the known outputs come first
    known, accepted = outputs[:n], grammar.accepted_token_ids
    whole = len(accepted) == len(outputs) or (grammar.is_terminated()
                                              and n <= len(accepted) <= len(outputs))
    if PLACEHOLDER not in known and accepted[:n] == known and whole:
        return None
    return (f"grammar state accepted {len(accepted)} tokens, the request has {n} outputs"
            + (f" and {len(outputs) - n} in flight" if len(outputs) > n else ""))
