"""Chapter 7 exercises: slot mappings, the top-p set, KV bytes of a real model, raw logprobs.

Each check computes the truth with :mod:`kvlab.engine` (the executor's own metadata builder, the
engine's sampler, the shipped model's config) and raises ``AssertionError`` with a hint when the
answer differs.
"""

from __future__ import annotations

import random

from ._common import require_answer


def check_slot_mapping(fn) -> str:
    """``fn(block_table, start_pos, num_tokens, block_size) -> list[int]``: the flat KV slots
    positions ``start_pos .. start_pos + num_tokens - 1`` are written to. Compared with the
    slot mapping the engine's executor builds, on random chunks."""
    require_answer(fn, "your slot-mapping function")
    if not callable(fn):
        raise AssertionError("pass a function (block_table, start_pos, num_tokens, block_size)")
    from kvlab.engine.attention import ChunkSpec, build_metadata

    rng = random.Random(7)
    for trial in range(200):
        bs = rng.choice([1, 2, 4, 16])
        start = rng.randint(0, 40)
        n = rng.randint(1, 20)
        table = rng.sample(range(64), -(-(start + n) // bs))
        want = build_metadata([ChunkSpec([0] * n, start, table)], bs).slot_mapping.tolist()
        got = list(fn(list(table), start, n, bs))
        if got != want:
            raise AssertionError(
                f"trial {trial}: table={table}, start={start}, n={n}, block_size={bs}: "
                f"expected {want}, got {got}. Position p lives in logical block p // block_size, "
                "at offset p % block_size of the physical block the table names.")
    return "Correct: your slot mapping matches the executor's on 200 random chunks."


def check_top_p(fn) -> str:
    """``fn(probs: list[float], top_p: float) -> set[int]``: the token ids kept by nucleus
    sampling (the smallest set of most likely tokens whose mass reaches ``top_p``; ties broken
    by the lower id). Compared with kvlab's sampler filter."""
    require_answer(fn, "your top-p function")
    if not callable(fn):
        raise AssertionError("pass a function (probs, top_p) -> set of kept token ids")
    import torch

    from kvlab.engine.params import SamplingParams
    from kvlab.engine.sampling import _filter

    rng = random.Random(11)
    for trial in range(100):
        v = rng.randint(2, 12)
        raw = [rng.random() ** 3 for _ in range(v)]
        probs = [x / sum(raw) for x in raw]
        top_p = rng.choice([0.3, 0.5, 0.8, 0.9, 0.95])
        logits = torch.tensor(probs, dtype=torch.float64).log()[None, :]
        kept = _filter(logits, [SamplingParams(temperature=1.0, top_p=top_p)])[0]
        want = {i for i in range(v) if kept[i] > float("-inf")}
        got = set(fn(list(probs), top_p))
        if got != want:
            raise AssertionError(
                f"trial {trial}: probs={[round(p, 3) for p in probs]}, top_p={top_p}: expected "
                f"{sorted(want)}, got {sorted(got)}. Sort by probability, keep tokens while the "
                "mass *before* them is below top_p.")
    return "Correct: your nucleus matches kvlab's sampler on 100 random distributions."


def check_kv_bytes_per_token(answer, model: str = "kvlab-tiny") -> str:
    """Bytes of K and V one token occupies in ``model``'s cache, all layers, float32."""
    require_answer(answer, "KV bytes per token")
    from kvlab.engine.checkpoint import resolve_model_path
    from kvlab.engine.config import ModelConfig

    cfg = ModelConfig.from_dir(resolve_model_path(model))
    want = cfg.kv_bytes_per_token(4)
    if answer != want:
        raise AssertionError(
            f"{answer!r} is not it. Use spec rule 1 with B = T = 1: 2 (K and V) x layers "
            f"({cfg.num_layers}) x KV heads ({cfg.num_kv_heads}) x head_dim ({cfg.head_dim}) "
            "x 4 bytes. Query heads do not count: only KV heads are cached.")
    return f"Correct: {want} bytes per token, {want * 16} bytes per 16-token block."


def check_logprob_temperature(letter) -> str:
    """Which distribution do kvlab's ``logprobs`` describe?

    (a) the temperature-scaled, top-k/top-p-filtered distribution that was sampled from,
    (b) the model's raw ``log_softmax(logits)`` before temperature and filters,
    (c) the temperature-scaled distribution before the filters,
    (d) greedy decoding's distribution whatever the parameters.
    """
    require_answer(letter, "your letter")
    if str(letter).strip().lower() != "b":
        raise AssertionError(
            "Not that one: generate with temperature=2.0 and logprobs=3, then compare the values "
            "with log_softmax of the model's logits (chapter 7 does it against transformers).")
    return ("Correct: (b), the raw model log-probabilities, as vLLM returns them by default; "
            "they do not depend on temperature, top-k or top-p.")
