"""Text to token ids and back over a Hugging Face ``tokenizer.json`` (no network), and the hash
that names a tokenizer in prefix-cache scopes."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from kvlab.engine.checkpoint import tokenizer_hash

__all__ = ["Tokenizer", "load_tokenizer"]


def _nonblank_path(value: str | Path, name: str) -> Path:
    """``value`` as a Path; ValueError for a blank str (``Path("")`` means the current dir)."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{name} must name a file or a directory, got {value!r} "
                         "(pass '.' for the current directory)")
    return Path(value)


class Tokenizer:
    """Text to token ids and back over a ``tokenizer.json`` (file or directory; no network);
    ``hash`` identifies it in prefix-cache scopes."""

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
        self.hash, self.path = tokenizer_hash(file), file

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Encoded through ``encode_batch``, which releases the GIL while
        it works (``encode`` holds it: a long text would stall every other Python thread)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        """Token string (its own encoding: ``Ġthe``, ``▁the``, ``<0x0A>``) -> id, added ones too."""
        return self._tok.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The longest token string of the vocabulary: no token covers more characters of a
        text, so a text longer than ``n * max_chars_per_token`` has more than ``n`` tokens."""
        return max(len(s) for s in self.get_vocab())

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Ids of the added special tokens (BOS, EOS, ...), which ``decode`` drops."""
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
