"""Models shipped inside the kvlab package (torch-free registry).

Two small Llama-architecture models live next to this file, each a directory in Hugging Face
layout (``config.json``, ``model.safetensors``, ``tokenizer.json``, ...):

- ``kvlab-tiny``: the target model used by the engine chapters;
- ``kvlab-tiny-draft``: a smaller model with the same tokenizer, the draft for speculative
  decoding.

Both were trained by ``tools/train_models.py`` on the procedural corpus of
:mod:`kvlab.models.corpus`; see ``README.md`` in this directory for their figures.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "DRAFT_FOR",
    "SHIPPED_MODELS",
    "is_shipped_model",
    "shipped_model_path",
]

_HERE = Path(__file__).resolve().parent

#: Shipped model name -> one-line description.
SHIPPED_MODELS: dict[str, str] = {
    "kvlab-tiny": "target model: Llama, 4 layers, hidden 192, 6 heads / 2 KV heads, "
                  "1.77 M parameters, byte-level BPE vocabulary of 1024",
    "kvlab-tiny-draft": "draft model for kvlab-tiny: Llama, 2 layers, hidden 128, "
                        "4 heads / 2 KV heads, 0.48 M parameters, same tokenizer",
}

#: Target model name -> the shipped draft model that shares its tokenizer.
DRAFT_FOR: dict[str, str] = {"kvlab-tiny": "kvlab-tiny-draft"}


def is_shipped_model(name: object) -> bool:
    """True when ``name`` is the name of a shipped model (any other value, any type: False)."""
    return isinstance(name, str) and name in SHIPPED_MODELS


def shipped_model_path(name: str) -> Path:
    """The directory of shipped model ``name`` (Hugging Face layout).

    Raises ``ValueError`` naming the known models when ``name`` is not one of them, and
    ``FileNotFoundError`` when the name is known but its weights are missing from this
    installation (regenerate them with ``python tools/train_models.py``).
    """
    if not is_shipped_model(name):
        known = ", ".join(sorted(SHIPPED_MODELS))
        raise ValueError(f"unknown shipped model {name!r}; known models: {known}")
    path = _HERE / name
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json")
               if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"shipped model {name!r} is incomplete at {path} (missing {', '.join(missing)}); "
            f"regenerate it with `python tools/train_models.py`"
        )
    return path
