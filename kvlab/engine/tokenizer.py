"""A thin wrapper over the ``tokenizers`` library's ``tokenizer.json`` (no network, no hub)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

__all__ = ["Tokenizer", "load_tokenizer"]


def _nonblank_path(value: str | Path, name: str) -> Path:
    """``value`` as a Path; ValueError naming ``name`` for a blank str (``Path("")`` would
    silently mean the current directory)."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{name} must name a file or a directory, got {value!r} "
                         "(pass '.' for the current directory)")
    return Path(value)


class Tokenizer:
    """Encode text to token ids and back; ``hash`` identifies it in prefix-cache scopes.

    ``path``: a ``tokenizer.json`` file or the directory holding it (a blank str: ValueError).
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _HFTokenizer

        file = _nonblank_path(path, "Tokenizer: path")
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {str(path)!r}")
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception subclass
            raise ValueError(f"{file}: cannot parse tokenizer ({err})") from None
        data = file.read_bytes()
        template = file.with_name("tokenizer_config.json")
        if template.is_file():  # chat template and special-token settings live here
            data += template.read_bytes()
        self.hash = hashlib.sha256(data).hexdigest()
        self.path = file

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included. Strings are in the tokenizer's own
        encoding (byte-level ``Ġthe`` for " the", sentencepiece ``▁the``, ``<0x0A>``)."""
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Ids of the added *special* tokens (BOS, EOS, ...): ``decode`` drops them from text."""
        added = self._tok.get_added_tokens_decoder()
        return tuple(sorted(i for i, t in added.items() if t.special))

    @property
    def decoder_config(self) -> dict | None:
        """The ``decoder`` section of ``tokenizer.json`` (how token strings turn into text)."""
        return json.loads(self._tok.to_str()).get("decoder")


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer of a model directory, or None when it ships no ``tokenizer.json``."""
    path = _nonblank_path(model_dir, "load_tokenizer: model_dir") / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else None
