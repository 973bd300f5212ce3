"""What a request asks of the engine: :class:`SamplingParams` (how to pick each next token and
when to stop, vLLM's names and meanings, validated when made) and its structured-outputs
parameter, :class:`StructuredOutputsParams`. Plain, torch-free data: the scheduler's output
carries them to the model runner, which owns the sampling state they seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import Enum

__all__ = ["KINDS", "MAX_SEED", "MIN_TEMPERATURE", "RequestOutputKind", "SamplingParams",
           "StructuredOutputsParams", "check_stop", "check_structured_outputs", "is_real"]

MIN_TEMPERATURE = 1e-5   # below it, greedy (vLLM's rule): a tinier divisor overflows float32
MAX_SEED = 2**64 - 1      # torch generators take a 64-bit unsigned seed


def _count(value: object, least: int) -> bool:
    """An int >= ``least`` that is not a bool (``True`` is an int, never a meaningful count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")


def is_real(value: object) -> bool:
    """A finite ``int`` or ``float``, not a ``bool`` (no NaN, no infinity, no int beyond float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float range
        return False


class RequestOutputKind(Enum):   # vLLM's: each output has all tokens so far, or the new ones
    CUMULATIVE, DELTA = 0, 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's names and meanings).

    ``max_tokens`` (>= 1); ``temperature`` (0, or below ``MIN_TEMPERATURE``: greedy); ``min_p``
    in [0, 1]: after temperature, drop tokens less likely than ``min_p`` times the most likely
    one (0: off; greedy ignores it); ``top_k`` (0 or -1: all); ``top_p`` in (0, 1], after
    min-p, top-k and temperature, always keeping the most likely token; ``seed`` in
    ``0 .. 2**64-1``: the request's own stream (sample ``i`` of ``n`` uses ``seed + i``; None:
    from the engine's seed and arrival order); ``stop_token_ids`` (kept
    in the output; stored as a tuple); ``ignore_eos``; ``n`` samples sharing the prompt's blocks;
    ``logprobs=k``: per token the k most likely and the sampled one, raw (``prompt_logprobs=k``:
    the same per prompt token after the first); ``structured_outputs``: exactly one of
    ``{"json"|"regex"|"choice"|"grammar": ...}``, as ``StructuredOutputsParams`` (the request
    ends when its grammar does). Penalties (OpenAI's and vLLM's): ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2] subtract, per token already generated, once and per
    occurrence; ``repetition_penalty`` > 0 divides positive (multiplies negative) logits of
    tokens in the prompt or the output; ``min_tokens``: EOS and the stop ids are masked until
    that many tokens were generated; ``stop``: strings the text ends before (the match is
    excluded, ``stop_reason`` is the string); ``output_kind=DELTA``: each output only the new
    tokens. A bad value raises ``ValueError`` naming ``SamplingParams.<field>``; any accepted
    value samples without error."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    stop: str | Sequence[str] = ()
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    min_p: float = 0.0

    def __post_init__(self) -> None:
        t, p, s, stops = self.temperature, self.top_p, self.seed, self.stop_token_ids
        _check(_count(self.max_tokens, 1), "max_tokens", "an int >= 1", self.max_tokens)
        _check(is_real(t) and t >= 0, "temperature", "a finite number >= 0", t)
        object.__setattr__(self, "temperature", float(t))
        _check(_count(self.top_k, -1), "top_k", "an int >= 1, or 0/-1 for all", self.top_k)
        _check(is_real(p) and 0 < p <= 1, "top_p", "a number in (0, 1]", p)
        object.__setattr__(self, "top_p", float(p))
        _check(is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]",
               self.min_p)
        object.__setattr__(self, "min_p", float(self.min_p))
        _check(s is None or (_count(s, 0) and s <= MAX_SEED), "seed",
               "None or an int in 0..2**64-1", s)
        _check(isinstance(stops, Iterable) and not isinstance(stops, (str, bytes, Mapping)),
               "stop_token_ids", "a sequence of token ids", stops)
        stops = tuple(stops)  # materialise once: checking would exhaust an iterator
        _check(all(_count(i, 0) for i in stops), "stop_token_ids", "token ids >= 0", stops)
        object.__setattr__(self, "stop_token_ids", stops)
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        _check(_count(self.n, 1), "n", "an int >= 1", self.n)
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind",
               "a RequestOutputKind", self.output_kind)
        for name in ("logprobs", "prompt_logprobs"):
            _check(getattr(self, name) is None or _count(getattr(self, name), 0), name,
                   "None or an int >= 0", getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(is_real(v) and -2 <= v <= 2, name, "a number in [-2, 2]", v)
            object.__setattr__(self, name, float(v))
        rp = self.repetition_penalty
        _check(is_real(rp) and rp > 0, "repetition_penalty", "a finite number > 0", rp)
        object.__setattr__(self, "repetition_penalty", float(rp))
        _check(_count(self.min_tokens, 0) and self.min_tokens <= self.max_tokens, "min_tokens",
               f"an int in 0..max_tokens ({self.max_tokens})", self.min_tokens)
        if self.stop != ():   # a str or strings, stored as a tuple (kvlab.engine.stop_strings)
            object.__setattr__(self, "stop", check_stop(self.stop, "SamplingParams.stop"))
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs",
                               check_structured_outputs(self.structured_outputs))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0.0

    @property
    def filtered(self) -> bool:
        """Whether min-p, top-k or top-p removes tokens (a random row's filters)."""
        return self.uses_min_p or self.uses_top_k or self.uses_top_p

    @property
    def penalized(self) -> bool:
        """Whether a penalty or ``min_tokens`` changes the logits (the sampler keeps history)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.min_tokens
                    or self.repetition_penalty != 1.0)

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError when a stop token id is outside the model's vocabulary."""
        bad = [s for s in self.stop_token_ids if s >= vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids {bad} outside vocabulary of "
                             f"{vocab_size} tokens")


def check_stop(stop: str | Sequence[str] | None, name: str = "stop") -> tuple[str, ...]:
    """``stop`` (None, a str, or a list of str) as a tuple; ValueError naming ``name`` for
    anything else or an empty string (it would match before the first character)."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"{name} must be a string or a list of strings, got {stop!r}")
    if any(not s for s in items):
        raise ValueError(f"{name} may not contain an empty string")
    return tuple(dict.fromkeys(items))


#: The supported keys, in vLLM's spelling.
KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of ``json`` (a schema, stored as its JSON text, key order kept), ``regex``,
    ``choice`` (a tuple of str) or ``grammar`` (EBNF text). Frozen and hashable: it is the key
    of the compiled-grammar cache. ValueError naming the field on a bad value."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) is not None]
        if len(given) != 1:
            raise ValueError(f"SamplingParams.structured_outputs needs exactly one of "
                             f"{', '.join(KINDS)}; got {given or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.regex is not None:
            _nonempty_str(self.regex, "regex")
        if self.grammar is not None:
            _nonempty_str(self.grammar, "grammar")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))

    @property
    def kind(self) -> str:
        """Which key is set: ``"json"``, ``"regex"``, ``"choice"`` or ``"grammar"``."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def value(self) -> str | tuple[str, ...]:
        """The value of :attr:`kind` (the schema as JSON text for ``json``)."""
        return getattr(self, self.kind)


def _nonempty_str(value: object, key: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"SamplingParams.structured_outputs[{key!r}] must be a non-empty str, "
                         f"got {value!r}")


def _schema_text(schema: object) -> str:
    """The schema as JSON text (key order kept: it fixes the order of the output's properties)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as err:
            raise ValueError(f"SamplingParams.structured_outputs['json']: not valid JSON text "
                             f"({err})") from None
    else:
        parsed = schema
    if not isinstance(parsed, Mapping):
        raise ValueError(f"SamplingParams.structured_outputs['json'] must be a JSON schema "
                         f"object (a dict or its JSON text), got {type(parsed).__name__}")
    try:
        return json.dumps(parsed, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"SamplingParams.structured_outputs['json']: schema is not "
                         f"JSON-serialisable ({err})") from None


def _choices(value: object) -> tuple[str, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"SamplingParams.structured_outputs['choice'] must be a list of str, "
                         f"got {value!r}")
    items = tuple(value)
    if not items or not all(isinstance(c, str) for c in items):
        raise ValueError(f"SamplingParams.structured_outputs['choice'] must be a non-empty list "
                         f"of str, got {value!r}")
    return items


def check_structured_outputs(value: object) -> StructuredOutputsParams | None:
    """``None``, a :class:`StructuredOutputsParams`, or a dict with exactly one of
    :data:`KINDS` -> the validated :class:`StructuredOutputsParams` (or None).
    ValueError naming the problem otherwise."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"SamplingParams.structured_outputs must be a dict with one of "
                         f"{', '.join(KINDS)}, got {type(value).__name__}")
    unknown = [k for k in value if k not in KINDS]
    if unknown:
        raise ValueError(f"SamplingParams.structured_outputs: unsupported key(s) {unknown}; "
                         f"kvlab supports {', '.join(KINDS)}")
    if len(value) != 1:
        raise ValueError(f"SamplingParams.structured_outputs needs exactly one of "
                         f"{', '.join(KINDS)}; got {sorted(value) or 'none'}")
    (key, item), = value.items()
    if item is None:
        raise ValueError(f"SamplingParams.structured_outputs[{key!r}] must not be None")
    return StructuredOutputsParams(**{key: item})
