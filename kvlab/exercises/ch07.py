"""Chapter 7 exercises: debug a colleague's attention step on two backends, derive decode
attention's arithmetic intensity, predict how a step's chunks split into paged rows and dense
chunks, and design a configuration that preempts yet generates the same tokens.

A check with one right answer compares against its sealed truth (``_common.sealed``; the
instructor edition computes it); the other checks run the reader's code or choice on
:mod:`kvlab.engine` (the executor's own attention and metadata, the engine's sampler, real
engine runs). Each raises ``AssertionError`` saying what is wrong, never the expected answer.
Exercise 1's check draws new hidden chunks on every call and gives one verdict for all of
them, and exercise 3's pair is one prediction, graded once per session
(``_common.earlier_prediction``), so neither answer can be found by calling its check in a loop.
(``check_slot_mapping``, ``check_kv_bytes_per_token``, ``check_top_p`` and
``check_logprob_temperature`` are kept for teachers who want them; the chapter no longer asks
them: the first two repeat chapters 1 and 2, the top-p set is off the engine's path, and which
distribution logprobs describe is a convention, not something a reader can derive.)
"""

from __future__ import annotations

import functools
import random
import secrets

from kvlab.exercises._common import earlier_prediction, graded_once, require_answer, sealed


def check_slot_mapping(fn) -> str:
    """``fn(block_table, start_pos, num_tokens, block_size) -> list[int]``: the flat KV slots
    positions ``start_pos .. start_pos + num_tokens - 1`` are written to. Compared with the
    slot mapping the engine's executor builds, on random chunks."""
    require_answer(fn, "your slot-mapping function")
    if not callable(fn):
        raise AssertionError("pass a function (block_table, start_pos, num_tokens, block_size)")
    from kvlab.engine.attention_metadata import ChunkSpec, build_metadata

    rng = random.Random(7)
    for trial in range(200):
        bs = rng.choice([1, 2, 4, 16])
        start = rng.randint(0, 40)
        n = rng.randint(1, 20)
        table = rng.sample(range(64), -(-(start + n) // bs))
        want = build_metadata([ChunkSpec([0] * n, start, table)], bs).slot_mapping.tolist()
        got = list(fn(list(table), start, n, bs))
        if got != want:
            bad = next(i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w) \
                if len(got) == len(want) else None
            where = (f"the slot of position {start + bad} is wrong" if bad is not None
                     else f"{len(got)} slots for {n} positions")
            raise AssertionError(
                f"trial {trial}: table={table}, start={start}, n={n}, block_size={bs}: {where}. "
                "Position p lives in logical block p // block_size, at offset p % block_size of "
                "the physical block the table names.")
    return "Correct: your slot mapping matches the executor's on 200 random chunks."


def check_top_p(fn) -> str:
    """``fn(probs: list[float], top_p: float) -> set[int]``: the token ids kept by nucleus
    sampling (the smallest set of most likely tokens whose mass reaches ``top_p``; ties broken
    by the lower id). Compared with kvlab's sampler filter."""
    require_answer(fn, "your top-p function")
    if not callable(fn):
        raise AssertionError("pass a function (probs, top_p) -> set of kept token ids")
    import torch

    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.sampler import filter_logits

    rng = random.Random(11)
    for trial in range(100):
        v = rng.randint(2, 12)
        raw = [rng.random() ** 3 for _ in range(v)]
        probs = [x / sum(raw) for x in raw]
        top_p = rng.choice([0.3, 0.5, 0.8, 0.9, 0.95])
        logits = torch.tensor(probs, dtype=torch.float64).log()[None, :]
        kept = filter_logits(logits, [SamplingParams(temperature=1.0, top_p=top_p)])[0]
        want = {i for i in range(v) if kept[i] > float("-inf")}
        got = set(fn(list(probs), top_p))
        if got != want:
            how = ("too many tokens" if len(got) > len(want) else "too few tokens"
                   if len(got) < len(want) else "the right number of tokens, but not the "
                   "most likely ones")
            raise AssertionError(
                f"trial {trial}: probs={[round(p, 3) for p in probs]}, top_p={top_p}: you kept "
                f"{how}.")
    return "Correct: your nucleus matches kvlab's sampler on 100 random distributions."


def check_kv_bytes_per_token(answer, model: str = "kvlab-tiny") -> str:
    """Bytes of K and V one token occupies in ``model``'s cache, all layers, float32
    (``kvlab-tiny``'s answer is sealed; another model, a teacher's own, is computed)."""
    require_answer(answer, "KV bytes per token")
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        raise AssertionError(f"KV bytes per token: expected a number, got {answer!r}")
    if model == "kvlab-tiny":
        way = sealed("ch07.kv_bytes_per_token").direction(answer)
    else:
        from kvlab.engine.checkpoint import resolve_model_path
        from kvlab.engine.config import ModelConfig

        want = ModelConfig.from_dir(resolve_model_path(model)).kv_bytes_per_token(4)
        way = None if answer == want else "too high" if answer > want else "too low"
    if way:
        raise AssertionError(
            f"{answer!r} is not the KV bytes per token. Use spec rule 1 with "
            "B = T = 1: 2 (K and V) x layers x KV heads x head_dim x 4 bytes. Query heads do "
            "not count: only KV heads are cached.")
    return f"Correct: {answer} bytes per token, {answer * 16} bytes per 16-token block."


def check_logprob_temperature(letter) -> str:
    """Which distribution do kvlab's ``logprobs`` describe?

    (a) the temperature-scaled, top-k/top-p-filtered distribution that was sampled from,
    (b) the model's raw ``log_softmax(logits)`` before temperature and filters,
    (c) the temperature-scaled distribution before the filters,
    (d) greedy decoding's distribution whatever the parameters.
    """
    require_answer(letter, "your letter")
    choice = str(letter).strip().lower()
    if choice not in ("a", "b", "c", "d"):
        raise AssertionError(f"answer with one letter, a to d (got {letter!r})")
    truth = sealed("ch07.logprob_temperature")     # each option's verdict is sealed under it
    if not truth.is_answer(choice):
        raise AssertionError(truth.note(choice))
    return truth.note(choice)


# -- exercise 1: a colleague's attention step -------------------------------------------------

def suspect_attention_step(backend, q, k, v, kv, meta, scale):
    """Exercise 1: a layer's attention step, as a colleague rewrote it (``backend`` an
    :class:`~kvlab.engine.attention.AttentionBackend`, ``kv`` a
    :class:`~kvlab.engine.kv_cache.KVLayer`)."""
    k_cache, v_cache, seen = kv.view(meta)
    out = backend.attend(q, k, v, k_cache, v_cache, seen, scale, kv.exact)
    kv.write(k, v, meta.slot_mapping)
    return out


def _engine_attention_step(backend, q, k, v, kv, meta, scale):
    """The layer's attention step as the engine runs it: ``AttentionBackend.forward``."""
    return backend.forward(q, k, v, kv, meta, scale)


@functools.cache
def _backend(name: str):
    """The attention backend called ``name`` (``"torch"`` or ``"cpu"``), or None where the
    compiled build is missing."""
    import torch

    from kvlab.engine.attention_cpu import CpuAttention
    from kvlab.engine.attention_torch import TorchAttention

    return TorchAttention() if name == "torch" else CpuAttention.create(torch.float32)


def _attention_outputs(step, backend, start_pos: int, num_tokens: int):
    """Run ``step`` with ``backend`` on one chunk of a fresh random 2-head GQA layer whose cache
    holds the chunk's prefix (written by "earlier steps") and random values everywhere else;
    the metadata is built as the runner builds it for that backend."""
    import torch

    from kvlab.engine.attention_metadata import ChunkSpec, build_metadata
    from kvlab.engine.kv_cache import PagedKVLayer

    gen = torch.Generator().manual_seed(5)
    block_size, kv_heads, heads, dim = 4, 2, 4, 8
    total = start_pos + num_tokens
    table = list(range(-(-total // block_size)))[::-1]       # blocks in reverse order
    layer = PagedKVLayer(  # stale data in every slot
        torch.randn(len(table), block_size, kv_heads, dim, generator=gen),
        torch.randn(len(table), block_size, kv_heads, dim, generator=gen))
    if start_pos:                               # the cached prefix, written by earlier steps
        prefix = build_metadata([ChunkSpec([0] * start_pos, 0, table)], block_size)
        layer.write(torch.randn(start_pos, kv_heads, dim, generator=gen),
                    torch.randn(start_pos, kv_heads, dim, generator=gen), prefix.slot_mapping)
    meta = build_metadata([ChunkSpec([0] * num_tokens, start_pos, table)], block_size,
                          paged_max_tokens=backend.paged_max_tokens)
    q = torch.randn(num_tokens, heads, dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, dim, generator=gen)
    v = torch.randn(num_tokens, kv_heads, dim, generator=gen)
    return step(backend, q, k, v, layer, meta, dim ** -0.5)


def _steps_differ(backend, start_pos: int, num_tokens: int) -> bool:
    """Whether the colleague's step and the engine's give different outputs for this chunk on
    ``backend`` (both run, nothing looked up)."""
    import torch

    want = _attention_outputs(_engine_attention_step, backend, start_pos, num_tokens)
    got = _attention_outputs(suspect_attention_step, backend, start_pos, num_tokens)
    return not torch.allclose(want, got)


def _hidden_chunks(rng: random.Random) -> list[tuple[int, int]]:
    """The chunks ``(start_pos, num_tokens)`` one check tries on each backend, drawn afresh
    every time: every kind of chunk a runner can see (the one-token prompt; fresh prompts of
    several tokens; one-token chunks, short chunks and long chunks behind a cached prefix)
    twice or more, then shuffled."""
    chunks = [(0, 1)]
    for _ in range(2):
        chunks += [(0, rng.randint(2, 40)), (rng.randint(1, 40), 1),
                   (rng.randint(1, 40), rng.randint(2, 16)),
                   (rng.randint(1, 40), rng.randint(17, 40))]
    chunks += [(rng.choice((0, rng.randint(1, 40))), rng.randint(1, 40)) for _ in range(3)]
    rng.shuffle(chunks)
    return chunks


def check_suspect_rule(fn) -> str:
    """Exercise 1: ``fn(start_pos, num_tokens, backend) -> bool``, whether
    :func:`suspect_attention_step` computes a different output from the engine's step
    (``AttentionBackend.forward``) for a chunk of ``num_tokens`` at ``start_pos`` behind a
    cached prefix, on the ``backend`` named ``"torch"`` (``TorchAttention``) or ``"cpu"``
    (``CpuAttention``). Each call draws new chunks the reader does not see (the ``"cpu"`` ones
    only where the compiled build is available), asks ``fn`` about all of them, runs both steps
    on each, and gives one verdict for them all."""
    require_answer(fn, "your function")
    if not callable(fn):
        raise AssertionError("pass a function (start_pos, num_tokens, backend) -> bool")
    rng = random.Random(secrets.randbits(64))
    cases = [(name, start, n) for name in ("torch", "cpu") if _backend(name) is not None
             for start, n in _hidden_chunks(rng)]
    rng.shuffle(cases)
    said = []
    for name, start, n in cases:
        try:
            answer = fn(start, n, name)
        except Exception as err:  # the reader's code: say where it failed
            raise AssertionError(f"your function raised {type(err).__name__}: {err} on "
                                 f"start_pos={start}, num_tokens={n}, "
                                 f"backend={name!r}") from None
        if not isinstance(answer, bool):
            raise AssertionError(f"return True or False, got {answer!r}")
        said.append(answer)
    truth = [_steps_differ(_backend(name), start, n) for name, start, n in cases]
    if said != truth:
        raise AssertionError(
            f"your function is wrong for at least one of the {len(cases)} chunks tried. "
            "Revisit which chunks each backend's attention reads back from the cache "
            "(AttentionBackend.forward, and each backend's attend_rows and attend_chunks).")
    return (f"Correct on {len(cases)} chunks. Whatever attention reads from the cache must be "
            "written first. On the torch backend only a fresh prompt of several tokens "
            "attends the new K/V it was handed; a one-token chunk is a paged row and a chunk "
            "behind a prefix reads its own tokens back through its table, so both see the "
            "slots' stale contents. The compiled CPU backend reads every chunk from the cache, "
            "fresh prompts included, so there even the colleague's prefill tests fail.")


# -- exercise 2: decode attention's arithmetic intensity -----------------------------------

def intensity_trials() -> list[dict]:
    """The 60 random model shapes :func:`check_attention_intensity` tries (seeded)."""
    rng = random.Random(13)
    trials = []
    for _ in range(60):
        kv_heads = rng.choice([1, 2, 4, 8, 16])
        trials.append(dict(num_layers=rng.randint(1, 80),
                           num_heads=kv_heads * rng.choice([1, 2, 4, 8]),
                           num_kv_heads=kv_heads, head_dim=rng.choice([32, 64, 80, 128, 256]),
                           dtype_bytes=rng.choice([1, 2, 4]), context_len=rng.randint(1, 8192)))
    return trials


def check_attention_intensity(fn) -> str:
    """Exercise 2: ``fn(num_layers, num_heads, num_kv_heads, head_dim, dtype_bytes,
    context_len) -> float``, the FLOPs one decoding token's attention does per byte of K and V
    it reads from ``context_len`` cached positions. Compared on random model shapes with the
    engine's own FLOP and KV-byte accounting (``kvlab.engine.config.ModelConfig``)."""
    require_answer(fn, "your intensity function")
    if not callable(fn):
        raise AssertionError("pass a function (num_layers, num_heads, num_kv_heads, head_dim, "
                             "dtype_bytes, context_len) -> FLOP per byte")
    for trial, shape in enumerate(intensity_trials()):
        truth = sealed(f"ch07.attention_intensity.{trial}")   # the engine's accounting
        try:
            got = fn(*shape.values())
        except Exception as err:  # the reader's code: say where it failed
            raise AssertionError(f"trial {trial}: your function raised "
                                 f"{type(err).__name__}: {err} on {shape}") from None
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise AssertionError(f"trial {trial}: expected a number, got {got!r}")
        if truth.direction(got, tolerance=1e-9 * truth.value()) is not None:
            raise AssertionError(
                f"trial {trial}: on {shape} your intensity is not the engine's accounting. "
                "Revisit what one cached position costs: the FLOPs of its scores and of its "
                "weighted values, over the bytes of its K and V.")
    return ("Correct: your intensity matches the engine's accounting on 60 random shapes. "
            "Layers, head size and context cancel; what is left is the query heads per KV head "
            "over the bytes per element, so a step's batch size cannot raise it: each request "
            "reads its own context.")


# -- exercise 3: paged rows and dense chunks ------------------------------------------------

#: Exercise 3's step, in the flat batch's order: chunk name -> (start_pos, num_tokens).
ROWS_STEP = {"A": (40, 1), "B": (20, 12), "C": (0, 10), "D": (32, 24), "E": (0, 1)}


def check_paged_rows(num_paged_rows, dense_chunks) -> str:
    """Exercise 3: for :data:`ROWS_STEP` on an engine whose attention backend is the compiled
    ``CpuAttention``, how many token rows are paged rows, and which chunks (letters) are dense?
    The pair is graded together, as one prediction, once per session
    (``_common.earlier_prediction``): after a wrong first answer, later ones are not graded.
    The truth is what ``flat_metadata`` builds with that backend's ``paged_max_tokens``."""
    require_answer(num_paged_rows, "the number of paged rows")
    require_answer(dense_chunks, "the dense chunks")
    if isinstance(num_paged_rows, bool) or not isinstance(num_paged_rows, int):
        raise AssertionError(f"the number of paged rows must be a whole number, got "
                             f"{num_paged_rows!r}")
    if isinstance(dense_chunks, str):
        dense_chunks = [c for c in dense_chunks if not c.isspace() and c != ","]
    try:
        chosen = {str(c).strip().upper() for c in dense_chunks}
    except TypeError:
        raise AssertionError("give the dense chunks as letters, e.g. {'A', 'B'} or 'AB' "
                             "(an empty set if none)") from None
    if not chosen <= set(ROWS_STEP):
        raise AssertionError(f"the chunks are {', '.join(ROWS_STEP)}; got {sorted(chosen)}")
    # one answer, graded as a whole (separate verdicts would let a loop find each half) and
    # once: the first answer is the prediction, so trying others one after another learns
    # nothing
    answer = [num_paged_rows, sorted(chosen)]
    right = sealed("ch07.paged_rows").is_answer(answer)
    earlier = earlier_prediction("ch07.paged_rows", answer, right)
    if earlier is not None:
        return graded_once(earlier)
    if not right:
        raise AssertionError("that is not how the runner lays out this step. Revisit what "
                             "makes a chunk's tokens paged rows rather than a dense chunk (the "
                             "metadata section), and which backend this runner has; then "
                             "build the step with build_metadata to see.")
    return (f"Correct: {num_paged_rows} paged rows and dense chunks {sorted(chosen)}. A row "
            "re-reads its whole context, so only one-token chunks and short chunks behind KV "
            "already cached go row by row; a fresh prompt has nothing cached to read. With the "
            "torch backend (paged_max_tokens 0) only the one-token chunks would be rows: its "
            "gather would copy a chunk's context once per row.")


# -- exercise 4: preempt, and still generate the same tokens ----------------------------------

#: The requests of :func:`check_preemption_design`: 4 story prompts, 24 greedy tokens each.
PREEMPT_DESIGN = {"model": "kvlab-tiny", "prompts_seed": 5, "num_prompts": 4, "max_tokens": 24,
                  "block_sizes": (1, 2, 4, 8, 16), "schedulers": ("baseline", "production")}


def _preempt_run(block_size: int, num_blocks: int, max_num_batched_tokens: int,
                 scheduler: str) -> tuple[list[list[int]], int]:
    import torch

    from kvlab.engine import LLMEngine, SamplingParams
    from kvlab.engine.engine_args import EngineArgs
    from kvlab.models.corpus import sample_prompts

    d = PREEMPT_DESIGN
    torch.set_num_threads(1)
    engine = LLMEngine(EngineArgs(d["model"], block_size=block_size, num_blocks=num_blocks,
                       max_num_batched_tokens=max_num_batched_tokens, scheduler=scheduler,
                       seed=0))
    prompts = sample_prompts(d["prompts_seed"], d["num_prompts"])
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=d["max_tokens"],
                                                           temperature=0, ignore_eos=True))
    outputs, preemptions = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        preemptions += len(engine.last_trace.scheduler_output.preempted)
    return [outputs[f"r{i}"] for i in range(len(prompts))], preemptions


def check_preemption_design(config) -> str:
    """Exercise 4: an engine configuration (dict with ``block_size``, ``num_blocks``,
    ``max_num_batched_tokens``, ``scheduler``) under which :data:`PREEMPT_DESIGN`'s requests are
    preempted at least once and still generate exactly the tokens of a roomy run."""
    require_answer(config, "your configuration")
    d = PREEMPT_DESIGN
    keys = {"block_size", "num_blocks", "max_num_batched_tokens", "scheduler"}
    if not isinstance(config, dict) or set(config) != keys:
        raise AssertionError(f"give a dict with exactly the keys {sorted(keys)}")
    if config["block_size"] not in d["block_sizes"]:
        raise AssertionError(f"block_size must be one of {d['block_sizes']}")
    if config["scheduler"] not in d["schedulers"]:
        raise AssertionError(f"scheduler must be one of {d['schedulers']}")
    for key in ("num_blocks", "max_num_batched_tokens"):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
            raise AssertionError(f"{key} must be a whole number from 1 to 4096")
    try:
        got, preemptions = _preempt_run(**config)
    except ValueError as err:
        raise AssertionError(f"the engine refused this configuration: {err}") from None
    roomy, _ = _preempt_run(16, 256, 512, "production")
    if got != roomy:
        first = next(i for i, (a, b) in enumerate(zip(got, roomy, strict=True)) if a != b)
        raise AssertionError(f"request r{first} generated different tokens from a roomy run: "
                             "that would be a bug in kvlab; please report it.")
    if preemptions == 0:
        raise AssertionError("nothing was preempted under this configuration. Revisit what "
                             "makes a scheduler preempt (chapter 6), and what each admission "
                             "policy promises a request when it admits it.")
    return (f"Correct: {preemptions} preemption(s), and every request generated exactly the "
            "tokens of a roomy run. Recompute preemption re-feeds prompt and outputs, writes the "
            "same KV and continues each request's own random stream.")
