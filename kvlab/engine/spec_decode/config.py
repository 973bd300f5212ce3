"""``speculative_config``: validated at the engine's boundary (the same keys as vLLM's)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvlab.core.checks import is_int

__all__ = ["MAX_SPECULATIVE_TOKENS", "SpeculativeConfig"]

#: Largest ``num_speculative_tokens`` accepted (acceptance of a long run decays like alpha^k).
MAX_SPECULATIVE_TOKENS = 16

_KEYS = {
    "draft_model": {"method", "model", "num_speculative_tokens"},
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate.

    - ``method="draft_model"``: a smaller model with the same tokenizer (``model``: a shipped
      name such as ``"kvlab-tiny-draft"`` or a local directory) proposes ``k`` tokens;
    - ``method="ngram"``: prompt lookup: the latest earlier occurrence of the context's last
      ``n`` tokens (``prompt_lookup_max >= n >= prompt_lookup_min``, longest first) proposes
      the ``k`` tokens that followed it (no second model).

    ``num_speculative_tokens = k`` in ``1..16``. :meth:`from_user` raises ValueError naming
    the key for anything else (unknown keys included).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3

    @classmethod
    def from_user(cls, value: object) -> SpeculativeConfig | None:
        """Validate ``LLM(speculative_config=...)``: None, a mapping, or a SpeculativeConfig."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative_config must be a dict or None, got "
                            f"{type(value).__name__}")
        method = value.get("method")
        if method not in _KEYS:
            raise ValueError(f"speculative_config['method'] must be 'draft_model' or 'ngram', "
                             f"got {method!r}")
        unknown = set(value) - _KEYS[method]
        if unknown:
            raise ValueError(f"speculative_config: unknown keys for method {method!r}: "
                             f"{sorted(unknown)} (allowed: {sorted(_KEYS[method])})")
        k = value.get("num_speculative_tokens")
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config['num_speculative_tokens'] must be an int in "
                             f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if method == "draft_model":
            model = value.get("model")
            if not isinstance(model, str) or not model.strip():
                raise ValueError(f"speculative_config['model'] must name the draft model "
                                 f"(e.g. 'kvlab-tiny-draft'), got {model!r}")
            return cls(method, k, model=model)
        lo = value.get("prompt_lookup_min", 1)
        hi = value.get("prompt_lookup_max", max(3, lo) if is_int(lo) else 3)
        if not is_int(lo) or lo < 1:
            raise ValueError(f"speculative_config['prompt_lookup_min'] must be an int >= 1, "
                             f"got {lo!r}")
        if not is_int(hi) or hi < lo:
            raise ValueError(f"speculative_config['prompt_lookup_max'] must be an int >= "
                             f"prompt_lookup_min={lo}, got {hi!r}")
        return cls(method, k, prompt_lookup_min=lo, prompt_lookup_max=hi)
