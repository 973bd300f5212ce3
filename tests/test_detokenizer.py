"""Incremental detokenization and stop strings (kvlab.engine.detokenizer) against decoding
everything at once, with byte-level tokenizers that split CJK characters and emoji."""

from __future__ import annotations

import random

import pytest

from kvlab.core.sampling_params import check_stop
from kvlab.engine.detokenizer import (
    REPLACEMENT,
    IncrementalDetokenizer,
    StopStringMatcher,
    TextStream,
)

CJK = [chr(c) for c in range(0x4E00, 0x4E00 + 400)]
EMOJI = [chr(c) for c in range(0x1F600, 0x1F640)]


def byte_level_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE trained on CJK, emoji and a few words: many of its tokens are parts
    of a character (the first two bytes of 中, an emoji's tail and the next one's head)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["the", "river", "town", "é", "naïve", "ß"]
    lines = []
    for _ in range(400):
        parts = []
        for _ in range(20):
            r = rng.random()
            if r < 0.5:
                parts.append("".join(rng.choice(CJK) for _ in range(rng.randint(1, 4))))
            elif r < 0.75:
                parts.append("".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3))))
            else:
                parts.append(rng.choice(words))
        lines.append(" ".join(parts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return tok


@pytest.fixture(scope="module")
def tok():
    t = byte_level_tokenizer()
    partial = [i for i in range(t.get_vocab_size()) if REPLACEMENT in t.decode([i])]
    assert len(partial) > 100          # the point of this tokenizer: tokens split characters
    return t


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    pieces, at = [], 0
    while at < len(ids):
        k = rng.randint(1, 3)                 # a step may bring several tokens (speculation)
        pieces.append(detok.push(ids[at:at + k]))
        at += k
    return pieces


@pytest.mark.parametrize("source", ["random_ids", "encoded_text"])
def test_streamed_text_equals_decoding_everything(tok, source):
    decode = _decode(tok)
    vocab = tok.get_vocab_size()
    split_chars = 0
    for seed in range(200):
        rng = random.Random(seed)
        if source == "random_ids":            # what a sampling model emits: any token anywhere
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        else:
            text = "".join(rng.choice(CJK + EMOJI + [" the", " river", "é"])
                           for _ in range(rng.randint(1, 30)))
            ids = tok.encode(text).ids
            assert decode(ids) == text
        detok = IncrementalDetokenizer(decode)
        pieces = _stream(detok, ids, rng)
        tail = detok.flush()
        assert "".join(pieces) + tail == decode(ids), seed
        # a piece never ends in half a character: that text is held back until it completes
        assert not any(p.endswith(REPLACEMENT) for p in pieces)
        split_chars += sum(decode(ids[:i]).endswith(REPLACEMENT) for i in range(1, len(ids)))
        if source == "encoded_text":           # real text: never a U+FFFD anywhere
            assert REPLACEMENT not in "".join(pieces) + tail
            assert detok.pending == 0
    assert split_chars > 50                    # many prefixes did end inside a character


def test_window_stays_short_on_valid_text(tok):
    """Each update decodes a few tokens, not the whole output (O(1) per token)."""
    calls = []
    decode = _decode(tok)

    def counting(ids):
        calls.append(len(ids))
        return decode(ids)

    text = "".join(random.Random(1).choice(CJK + EMOJI) for _ in range(300))
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(counting)
    out = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert out == text
    assert max(calls) <= 8                     # a character is at most 4 byte tokens


def test_sentencepiece_style_decoder_keeps_its_spaces():
    """Metaspace drops the leading space of the *first* token only: decoding a window of
    already-sent tokens with the new ones keeps every later space."""
    from tokenizers import Tokenizer, decoders, models

    words = ["▁the", "▁river", "town", "▁", "s", "▁a", "<unk>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    decode = _decode(tok)
    for seed in range(100):
        rng = random.Random(seed)
        ids = [rng.randrange(len(words) - 1) for _ in range(rng.randint(1, 20))]
        detok = IncrementalDetokenizer(decode)
        assert "".join(_stream(detok, ids, rng)) + detok.flush() == decode(ids)


def _reference_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    _, at, s = min(hits)
    return text[:at], s


def test_stop_strings_match_across_deltas_and_never_leak():
    alphabet = "ab中😀 "
    for seed in range(500):
        rng = random.Random(seed)
        stops = tuple(dict.fromkeys("".join(rng.choice(alphabet) for _ in range(
            rng.randint(1, 4))) for _ in range(rng.randint(1, 3))))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        m = StopStringMatcher(list(stops))
        sent, at = "", 0
        while at < len(text) and m.matched is None:
            k = rng.randint(1, 4)
            sent += m.feed(text[at:at + k])
            at += k
            # what was sent is final: a prefix of the answer, holding no stop string
            assert _reference_stop(text, stops)[0].startswith(sent), (seed, sent)
            assert not any(s in sent for s in stops)
        sent += m.flush()
        want, matched = _reference_stop(text, stops)
        assert (sent, m.matched) == (want, matched), seed


def test_text_stream_stops_inside_a_split_character(tok):
    decode = _decode(tok)
    text = "the river 中文😀 town 😀 end"
    ids = tok.encode(text).ids
    ts = TextStream(decode, stop=["文😀", "zzz"])
    out = ""
    for i in ids:
        out += ts.push([i])
        if ts.stopped:
            break
    assert ts.stopped and ts.stop_reason == "文😀"
    assert out == ts.text == "the river 中"
    plain = TextStream(decode, stop="absent")
    assert "".join(plain.push([i]) for i in ids) + plain.finish() == text
    assert not plain.stopped and plain.stop_reason is None


def test_check_stop_names_the_problem():
    assert check_stop(None) == ()
    assert check_stop("x") == ("x",)
    assert check_stop(["a", "b", "a"]) == ("a", "b")
    for bad in (5, ["a", 3], {"a": 1}, [""]):
        with pytest.raises(ValueError, match="stop"):
            check_stop(bad)


def _reference_cut(text: str, stops: tuple[str, ...], include: bool,
                   armed_from: int) -> tuple[str, str | None]:
    """The answer when stop strings count only if they end past ``armed_from`` characters
    (vLLM's min_tokens rule), cut before the match or, with ``include``, after it."""
    hits = []
    for s in stops:
        at = text.find(s, max(0, armed_from - len(s) + 1))
        if at >= 0:
            hits.append((at + len(s), at, s))
    if not hits:
        return text, None
    end, at, s = min(hits)
    return text[:end if include else at], s


def test_stop_strings_included_and_held_back_until_armed():
    """``include`` keeps the match and holds nothing back; text fed unarmed (the first
    min_tokens tokens') is never matched alone, but a match may start in it and end after."""
    alphabet = "ab中 "
    for seed in range(400):
        rng = random.Random(seed)
        stops = tuple(dict.fromkeys("".join(rng.choice(alphabet) for _ in range(
            rng.randint(1, 3))) for _ in range(rng.randint(1, 3))))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        include, armed_from = rng.random() < 0.5, rng.randint(0, len(text))
        m = StopStringMatcher(list(stops), include=include)
        sent, at = "", 0
        while at < len(text) and m.matched is None:
            k = rng.randint(1, 4)
            if at < armed_from < at + k:
                k = armed_from - at          # a delta ends where arming starts
            sent += m.feed(text[at:at + k], armed=at >= armed_from)
            at += k
            if include:
                assert m.held == ""           # nothing held back
            want = _reference_cut(text, stops, include, armed_from)[0]
            assert want.startswith(sent), (seed, sent, want)
        sent += m.flush()
        assert (sent, m.matched) == _reference_cut(text, stops, include, armed_from), seed
