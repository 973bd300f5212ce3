"""Chapter 7 figure and CLI: headless, from real engine snapshots."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest

pytest.importorskip("transformers")

from kvlab.core.sampling_params import SamplingParams
from kvlab.engine.engine_args import EngineArgs
from kvlab.engine.llm_engine import LLMEngine
from kvlab.labs.parity.hf import save_random_hf_model
from kvlab.viz.engine import engine_step_figure


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_random_hf_model(tmp_path_factory.mktemp("viz") / "m", "llama", seed=5)


@pytest.fixture(scope="module")
def engine(model_path):
    eng = LLMEngine(EngineArgs(model_path, block_size=4, num_blocks=32,
                               max_num_batched_tokens=16))
    eng.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=4, temperature=0))
    eng.add_request("b", list(range(5, 14)), SamplingParams(max_tokens=4, n=2, seed=0))
    eng.step()
    eng.step()
    return eng


def test_figure_shows_batch_tables_and_pool(engine):
    import matplotlib.pyplot as plt

    snap = engine.snapshot()
    fig = engine_step_figure(snap, max_pool_blocks=20)
    gids = {p.get_gid() for ax in fig.axes for p in ax.patches}
    assert {f"chunk-{e.request_id}" for e in snap.last_batch} <= gids
    assert {f"block-{b}" for b in range(20)} <= gids
    assert "block-20" not in gids  # capped
    for r in snap.requests:
        assert {f"table-{r.request_id}-{i}" for i in range(len(r.block_table))} <= gids
    assert "first 20 of 32" in fig.axes[2].get_title()
    plt.close(fig)
    with pytest.raises(ValueError):
        engine_step_figure(snap, max_pool_blocks=0)


def test_stepper_keeps_each_request_colour_in_every_frame(model_path, monkeypatch):
    from matplotlib.colors import to_rgb

    import kvlab.viz.engine as viz

    def make():      # "a" finishes first: the requests after it must not change colour
        eng = LLMEngine(EngineArgs(model_path, block_size=4, num_blocks=32,
                                   max_num_batched_tokens=16))
        eng.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=2, temperature=0))
        eng.add_request("b", list(range(5, 14)), SamplingParams(max_tokens=6, n=2, seed=0))
        return eng

    colours: dict[str, set] = {}
    draw = viz.engine_step_figure

    def recorded(snapshot, **kwargs):
        fig = draw(snapshot, **kwargs)
        for chunk in fig.axes[0].patches:
            colours.setdefault(chunk.get_gid(), set()).add(to_rgb(chunk.get_facecolor()))
        return fig

    monkeypatch.setattr(viz, "engine_step_figure", recorded)
    stepper = viz.EngineStepper(make(), replay=make)
    stepper.kernel_free()                                  # the precomputed frames
    while stepper.engine.has_unfinished_requests():        # and the live ones
        stepper.step()
    assert len(colours) >= 2 and all(len(c) == 1 for c in colours.values()), colours


def test_snapshot_is_plain_data(engine):
    snap = engine.snapshot()
    assert snap.step == 2 and snap.num_blocks == 32
    assert len(snap.block_states) == len(snap.refcounts) == 32
    for r in snap.requests:
        assert all(isinstance(b, int) for b in r.block_table)
    assert isinstance(snap.stats["prefix_hit_rate"], float)


def test_cli_demo_runs(capsys):
    from kvlab.__main__ import main
    from kvlab.models import shipped_model_path

    try:
        shipped_model_path("kvlab-tiny")
    except FileNotFoundError:
        pytest.skip("shipped weights not built")
    assert main(["--requests", "4", "--max-tokens", "4", "--show", "1", "--threads", "0"]) == 0
    out = capsys.readouterr().out
    assert "requests 4" in out and "prefix-cache hit rate" in out and "tokens/s" in out


def test_cli_reports_unknown_model(capsys):
    from kvlab.__main__ import main

    assert main(["--model", "/nonexistent/model"]) == 1
    assert "cannot load model" in capsys.readouterr().err
