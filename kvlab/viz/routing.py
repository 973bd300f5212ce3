"""Chapter 13's widget: a request stream routed across replicas, their prefix caches filling.

:func:`route_frames` runs the cluster simulator (:mod:`kvlab.sim.cluster`) with one router
policy on a small multi-tenant stream and records, as each request is routed, what every
replica's cache holds of each tenant's system prompt (read from the replica's KV-event index).
:func:`routing_figure` draws one frame; :func:`routing_explorer` is the live widget (policy and
request number), with a kernel-free twin that fits a phone's column.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvlab.sim.cluster import Replica, RoutedRecord, block_keys, simulate_cluster
from kvlab.sim.routers import make_policy
from kvlab.sim.workload import RequestSpec, to_request
from kvlab.viz.style import INK, MUTED, REQUEST_PALETTE

__all__ = ["POLICY_STYLE", "WIDGET_POLICIES", "RouteFrame", "StreamSetup", "route_frames",
           "routing_explorer", "routing_figure", "scale_figure"]

#: the policies the widget offers
WIDGET_POLICIES = ("round_robin", "approx_tree", "precise_index", "dynamo_cost")


@dataclass(frozen=True)
class StreamSetup:
    """The widget's cluster: ``replicas`` of ``num_blocks`` blocks; ``tenants`` whose system
    prompts are ``shared`` of each request's ``prompt_len`` tokens, popularity Zipf ``zipf``;
    ``n`` requests at ``rate``/s. Each replica holds the prompts of fewer than all tenants."""

    replicas: int = 4
    num_blocks: int = 40
    block_size: int = 16
    tenants: int = 8
    prompt_len: int = 144
    shared: int = 128
    output_len: int = 16
    n: int = 40
    rate: float = 6.0
    zipf: float = 0.8
    seed: int = 3


@dataclass(frozen=True)
class RouteFrame:
    """The cluster as request ``index`` (of ``tenant``) was routed to ``replica``: each
    replica's cached blocks of every tenant's prompt (``held[replica][tenant]``), its other
    cached blocks, its requests in flight; the request's cache hit (blocks) once admitted,
    and the running hit rate and requests per replica up to it."""

    index: int
    tenant: int
    replica: int
    hit_blocks: int
    prompt_blocks: int
    held: tuple[tuple[int, ...], ...]
    other: tuple[int, ...]
    in_flight: tuple[int, ...]
    hit_rate: float
    routed: tuple[int, ...]


def _workload(s: StreamSetup) -> list[RequestSpec]:
    from kvlab.labs.routing import tenant_workload

    return tenant_workload(s.n, s.tenants, s.rate, s.prompt_len, s.output_len, zipf=s.zipf,
                           seed=s.seed)


@functools.lru_cache(maxsize=8)
def route_frames(policy: str, setup: StreamSetup = StreamSetup()) -> tuple[RouteFrame, ...]:
    """One frame per request of the widget's stream under ``policy`` (computed once per
    policy and set-up)."""
    specs = _workload(setup)
    bs = setup.block_size
    tenant_keys = []
    for g in range(setup.tenants):
        tokens = to_request(RequestSpec("t", 0.0, setup.prompt_len, 1, prefix_group=g),
                            shared_prefix=setup.shared).prompt_token_ids
        tenant_keys.append(block_keys(tokens[:setup.shared], bs))
    snaps: list[tuple[RoutedRecord, tuple, tuple, tuple]] = []

    def observe(record: RoutedRecord, replicas: list[Replica]) -> None:
        held = tuple(tuple(r.index.overlap(keys) for keys in tenant_keys) for r in replicas)
        other = tuple(len(r.index.keys) - sum(h) for r, h in zip(replicas, held, strict=True))
        snaps.append((record, held, other, tuple(r.in_flight for r in replicas)))

    result = simulate_cluster(specs, make_policy(policy), replicas=setup.replicas,
                              num_blocks=setup.num_blocks, block_size=bs,
                              shared_prefix=setup.shared, observer=observe)
    frames, hits, total = [], 0, 0
    routed = [0] * setup.replicas
    for i, (record, held, other, flight) in enumerate(snaps):
        hits += record.hit_tokens
        total += record.prompt_len
        routed[record.replica] += 1
        frames.append(RouteFrame(i, record.tenant, record.replica, record.hit_tokens // bs,
                                 (record.prompt_len - 1) // bs, held, other, flight,
                                 hits / total, tuple(routed)))
    assert len(frames) == len(result.records)
    return tuple(frames)


def routing_figure(frame: RouteFrame, setup: StreamSetup = StreamSetup(), *, policy: str = ""):
    """One frame: a column per replica, its cache as stacked blocks coloured by tenant (grey:
    other cached blocks; the outline is the cache's size), the routed request marked over its
    replica. Sized for a phone's column (3.6 x 3.4 in)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(3.6, 3.4))
    width = 0.7
    for r in range(setup.replicas):
        y = 0
        for g in range(setup.tenants):
            n = frame.held[r][g]
            if n:
                ax.add_patch(Rectangle((r - width / 2, y), width, n,
                                       color=REQUEST_PALETTE[g % len(REQUEST_PALETTE)],
                                       lw=0))
                y += n
        if frame.other[r]:
            ax.add_patch(Rectangle((r - width / 2, y), width, frame.other[r], color="#ced4da",
                                   lw=0))
        edge = INK if r == frame.replica else MUTED
        ax.add_patch(Rectangle((r - width / 2, 0), width, setup.num_blocks, fill=False,
                               edgecolor=edge, lw=2.2 if r == frame.replica else 0.8))
    color = REQUEST_PALETTE[frame.tenant % len(REQUEST_PALETTE)]
    ax.annotate("", xy=(frame.replica, setup.num_blocks + 1),
                xytext=(frame.replica, setup.num_blocks + 9),
                arrowprops={"arrowstyle": "-|>", "color": color, "lw": 2.5})
    ax.set_xlim(-0.6, setup.replicas - 0.4)
    ax.set_ylim(0, setup.num_blocks + 10)
    ax.set_xticks(range(setup.replicas),
                  [f"R{r}\n{frame.routed[r]} req" for r in range(setup.replicas)])
    ax.set_yticks([0, setup.num_blocks // 2, setup.num_blocks])
    ax.set_ylabel("cached KV blocks")
    ax.spines["bottom"].set_visible(False)
    ax.tick_params(axis="x", length=0)
    ax.set_title(f"{policy or 'router'}, request {frame.index + 1}", fontsize=11)
    ax.set_xlabel(f"tenant {frame.tenant} → R{frame.replica}: hit {frame.hit_blocks} of "
                  f"{frame.prompt_blocks} blocks\nhit rate so far {frame.hit_rate:.0%}",
                  fontsize=9)
    fig.tight_layout()
    return fig


def routing_explorer(setup: StreamSetup = StreamSetup(), *, policy: str = "precise_index",
                     step: int | None = None):
    """The live widget: a policy dropdown and a request slider over :func:`route_frames`
    (all frames of the four policies computed once, in about a second)."""
    import ipywidgets as w

    from kvlab.viz._widgets import figure_widget

    frames = {p: route_frames(p, setup) for p in WIDGET_POLICIES}
    step = setup.n - 1 if step is None else step
    controls = {
        "policy": w.Dropdown(options=WIDGET_POLICIES, value=policy, description="router"),
        "step": w.IntSlider(value=step, min=0, max=setup.n - 1, description="request",
                            continuous_update=False),
    }
    return figure_widget(
        controls, lambda policy, step: routing_figure(frames[policy][step], setup,
                                                      policy=policy),
        caption=lambda policy, step: _caption(frames[policy][step]),
        what="requests routed across replicas (router policy, request number)",
        kernel_free=lambda: _kernel_free(frames, setup, policy, step))


def _caption(frame: RouteFrame) -> str:
    return (f"requests per replica {list(frame.routed)}; in flight {list(frame.in_flight)}; "
            f"hit rate so far {frame.hit_rate:.1%}")


def _kernel_free(frames: dict[str, tuple[RouteFrame, ...]], setup: StreamSetup, policy: str,
                 step: int):
    from kvlab.viz.kernel_free import dropdown, slider, spread, static_widget

    steps = spread(setup.n, 8)
    if step not in steps:   # 4 policies x 8 requests: 32 frames
        steps = spread(setup.n, 7, include=(step,))
    steps = tuple(steps)
    return static_widget(
        lambda policy, step: routing_figure(frames[policy][step], setup, policy=policy),
        {"policy": dropdown(WIDGET_POLICIES, label="router"),
         "step": slider(steps, label="request", labels=[str(s + 1) for s in steps])},
        default={"policy": policy, "step": step},
        caption=lambda policy, step: _caption(frames[policy][step]),
        title="requests routed across replicas (8 of the requests precomputed)")


#: colours and labels of the simulator's policies in the chapter's figures
POLICY_STYLE = {"round_robin": ("#868e96", "round robin"),
                "least_loaded": ("#56b4e9", "least loaded"),
                "approx_tree": ("#e69f00", "approximate tree"),
                "precise_index": ("#d55e00", "precise index"),
                "dynamo_cost": ("#009e73", "Dynamo's cost")}


def scale_figure(rows: list[dict]):
    """The scale study (rows of :func:`kvlab.labs.routing.scale_study`): hit rate, TTFT p99 and
    the busiest replica's share against the replica count, one line per policy; three panels
    stacked so the figure fits a phone's column."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(3.8, 6.6), sharex=True)
    counts = sorted({r["replicas"] for r in rows})
    panels = (("hit_rate", "prompt tokens\ncached", 1.0),
              ("ttft_p99_s", "TTFT p99 (ms)", 1e3),
              ("hot_spot", "busiest replica\n/ mean", 1.0))
    for ax, (field, label, scale) in zip(axes, panels, strict=True):
        for policy, (color, name) in POLICY_STYLE.items():
            ys = [next(r[field] for r in rows if r["replicas"] == n and r["policy"] == policy)
                  * scale for n in counts]
            ax.plot(counts, ys, marker="o", ms=3.5, color=color, label=name, lw=1.6)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.6)
    axes[1].set_yscale("log")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8, ncol=2, loc="lower left")
    axes[-1].set_xscale("log", base=2)
    axes[-1].set_xticks(counts, [str(n) for n in counts])
    axes[-1].minorticks_off()
    axes[-1].set_xlabel("replicas")
    fig.tight_layout()
    return fig
