"""The Vale: a seeded, procedurally generated English corpus for kvlab's shipped models.

The shipped models (``kvlab-tiny`` and its draft) are trained on text that this module writes
from scratch: no downloaded data, no network, no third-party text. A seed fixes a small *world*
(regions, towns, rivers, people with jobs, pets, friends and pronouns) and every document is
drawn from that world, so facts recur across documents (Mira Tallow always lives in the same
town and keeps the same dog) and the grammar agrees (``she lives`` / ``they live``, ``one goat
was`` / ``three goats were``, ``a`` / ``an``). Four kinds of document are written:

- encyclopedia entries about towns,
- encyclopedia entries about people,
- short stories in the past tense (lost things, storms, journeys, festivals),
- question-and-answer sessions that all open with the same :data:`SYSTEM_PROMPT`, which gives
  the book prompts sharing a long common prefix (handy for prefix caching).

Contract: everything here is pure Python (no torch), and output depends only on the arguments,
never on ``PYTHONHASHSEED``, dict order of other modules or the clock. Document ``i`` of seed
``s`` is drawn from its own generator, so ``generate_corpus(s, n)`` is a prefix of
``generate_corpus(s, n + k)`` and held-out documents are cheap to produce (``start=``).
"""

from __future__ import annotations

import random
import re

from kvlab.models.vale_documents import SYSTEM_PROMPT, Writer, generate_document, qa_pair
from kvlab.models.vale_world import Person, Town, World, build_world

__all__ = [
    "CORPUS_SEED",
    "SYSTEM_PROMPT",
    "Person",
    "Town",
    "World",
    "build_world",
    "corpus_words",
    "generate_corpus",
    "generate_document",
    "qa_examples",
    "sample_prompts",
    "shared_prefix_prompts",
]

#: Seed of the world and corpus the shipped models were trained on.
CORPUS_SEED = 0


def _check_counts(seed: int, num_docs: int, start: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if not isinstance(num_docs, int) or num_docs < 0:
        raise ValueError(f"num_docs must be a non-negative int, got {num_docs!r}")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")


def generate_corpus(seed: int, num_docs: int, *, start: int = 0) -> list[str]:
    """Documents ``start .. start + num_docs - 1`` of the corpus of ``seed``.

    Each document is plain English text (no special tokens), paragraphs separated by a blank
    line. Document ``i`` depends only on ``(seed, i)``: the world of ``seed`` and its own
    generator, so slices of the corpus can be produced independently.
    """
    _check_counts(seed, num_docs, start)
    world = build_world(seed)
    return [
        generate_document(world, random.Random(f"kvlab-doc:{seed}:{i}"))
        for i in range(start, start + num_docs)
    ]


_WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


def corpus_words(texts: list[str]) -> set[str]:
    """The lower-cased words (letters and apostrophes) occurring in ``texts``."""
    return {m.group(0).lower() for text in texts for m in _WORD.finditer(text)}


# --------------------------------------------------------------------------- prompts


def sample_prompts(seed: int, n: int, *, corpus_seed: int = CORPUS_SEED) -> list[str]:
    """``n`` prompts in the style of the corpus: the opening of a fresh document.

    Each is the first sentence (stories, Q&A) or the title and first clause (entries) of a
    document drawn from the world of ``corpus_seed`` with a generator separate from the
    training stream, cut at a word boundary, so a model trained on the corpus should continue
    it fluently. Deterministic in ``(seed, n, corpus_seed)``.
    """
    _check_counts(seed, n, 0)
    world = build_world(corpus_seed)
    prompts = []
    for i in range(n):
        doc = generate_document(world, random.Random(f"kvlab-prompt:{seed}:{i}"))
        prompts.append(_prompt_cut(doc))
    return prompts


def _prompt_cut(doc: str) -> str:
    if doc.startswith(SYSTEM_PROMPT):
        # keep the system prompt and the first question, up to the answer marker
        end = doc.index("\nArchivist:") + len("\nArchivist:")
        return doc[:end]
    body = doc.split("\n\n")
    if len(body) > 1 and "." not in body[0]:  # an entry: title + first words of the text
        words = body[1].split(" ")
        return body[0] + "\n\n" + " ".join(words[: max(3, len(words) // 4)])
    sentence_end = doc.find(". ")
    first = doc[: sentence_end + 1] if sentence_end > 0 else doc
    words = first.split(" ")
    return " ".join(words[: max(4, (2 * len(words)) // 3)])


def qa_examples(seed: int, n: int, *, corpus_seed: int = CORPUS_SEED) -> list[tuple[str, str]]:
    """``n`` (prompt, answer) pairs: a Q&A prompt as in :func:`shared_prefix_prompts` and the
    one-line answer the world of ``corpus_seed`` makes true (what the Archivist would say).

    Use it to measure how many facts of the world a model has learned: greedy-decode the
    prompt up to the first newline and compare with ``answer`` (which has no leading space).
    """
    _check_counts(seed, n, 0)
    world = build_world(corpus_seed)
    examples = []
    for i in range(n):
        question, answer = qa_pair(Writer(world, random.Random(f"kvlab-qa:{seed}:{i}")))
        examples.append((f"{SYSTEM_PROMPT}\n\nUser: {question}\nArchivist:", answer))
    return examples


def shared_prefix_prompts(seed: int, n: int, *, corpus_seed: int = CORPUS_SEED) -> list[str]:
    """``n`` Q&A prompts that all start with :data:`SYSTEM_PROMPT` and differ after it.

    Shape: ``SYSTEM_PROMPT + "\\n\\nUser: <question>\\nArchivist:"``; questions are about the
    world of ``corpus_seed``, so a trained model answers them in the corpus style. Useful for
    prefix-caching demonstrations: the shared prefix is identical token for token.
    """
    return [prompt for prompt, _ in qa_examples(seed, n, corpus_seed=corpus_seed)]
