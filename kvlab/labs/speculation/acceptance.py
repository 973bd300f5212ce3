"""Plain-data record of a speculative run, for the chapter's AcceptanceView and its figure."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AcceptanceData", "run_acceptance"]

DEFAULT_PROMPTS = ("The town of Harrow is", "Once upon a time, the river",
                   "Question: where does the baker live?", "The festival of lanterns in")


@dataclass(frozen=True)
class AcceptanceData:
    """One run: ``k``, method, temperature; ``per_pos[i]`` = share of verifications whose
    draft ``i`` was accepted; ``lengths[rid]`` = tokens emitted per verification step of each
    request (``(step, accepted + 1)``); ``rejected`` = ``(p(x), q(x))`` of rejected drafts;
    ``alpha`` (ML estimate, see ``bench_speculative``) and ``mean_length``."""

    method: str
    k: int
    temperature: float
    per_pos: tuple[float, ...]
    lengths: dict[str, tuple[tuple[int, int], ...]]
    rejected: tuple[tuple[float, float], ...]
    alpha: float
    mean_length: float


_ENGINES: dict[tuple[str, int], object] = {}


def run_acceptance(method: str = "draft_model", k: int = 4, temperature: float = 0.0,
                   prompt: str = DEFAULT_PROMPTS[0], max_tokens: int = 32, seed: int = 0,
                   engines: dict | None = None) -> AcceptanceData:
    """Generate with speculation for ``prompt`` and three fixed prompts; record acceptance.
    Engines are cached per (method, k), so a widget can re-run quickly; a cached engine's
    prefix cache and history carry over, so a repeated run may measure differently. ``engines``
    (a dict, initially empty) replaces the module's cache: runs there leave the shared engines
    untouched (the widget's kernel-free twin precomputes its frames that way)."""
    from kvlab.core.sampling_params import SamplingParams
    from kvlab.engine.llm import LLM

    cache = _ENGINES if engines is None else engines
    key = (method, k)
    if key not in cache:
        spec = ({"method": "draft_model", "model": "kvlab-tiny-draft"} if method == "draft_model"
                else {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3})
        cache[key] = LLM("kvlab-tiny", num_blocks=256, max_num_seqs=8, seed=0,
                         speculative_config={**spec, "num_speculative_tokens": k})
    llm = cache[key]
    metrics = llm.engine.speculator.metrics
    metrics.reset()
    prompts = [prompt, *DEFAULT_PROMPTS[1:]]
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                        ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    names = {o.request_id: f"req {i}" for i, o in enumerate(outs)}
    hist = [r for r in metrics.history if r.num_draft_tokens]
    lengths: dict[str, list[tuple[int, int]]] = {n: [] for n in names.values()}
    for r in hist:
        lengths[names[r.request_id]].append((r.step, r.num_accepted + 1))
    accepted = sum(r.num_accepted for r in hist)
    rejections = sum(1 for r in hist if r.num_accepted < r.num_draft_tokens)
    n = metrics.num_drafts
    return AcceptanceData(
        method, k, temperature,
        tuple(c / n if n else 0.0 for c in metrics.accepted_per_pos),
        {name: tuple(v) for name, v in lengths.items()},
        tuple((r.rejected[2], r.rejected[3]) for r in hist if r.rejected is not None),
        accepted / (accepted + rejections) if accepted + rejections else 0.0,
        metrics.mean_accepted_length)
