"""The structured-outputs request parameter, validated at the boundary (torch- and xgrammar-free).

``SamplingParams(structured_outputs=...)`` takes vLLM's keys, exactly one of them:

- ``{"json": schema}``: the output is a JSON document valid against ``schema`` (a dict, or a
  str holding a JSON object);
- ``{"regex": pattern}``: the output fully matches ``pattern``;
- ``{"choice": [s1, s2, ...]}``: the output is exactly one of the strings;
- ``{"grammar": ebnf}``: the output is a sentence of the EBNF grammar (xgrammar's GBNF dialect,
  start rule ``root``).

A :class:`StructuredOutputsParams` instance is accepted too. Here only the *shape* is checked
(one known key, a value of the right type); whether the pattern, schema or grammar compiles is
checked by the engine at ``add_request`` (it needs the tokenizer), see
:mod:`kvlab.engine.structured_outputs.grammar`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields

__all__ = ["KINDS", "StructuredOutputsParams", "check_structured_outputs"]

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
