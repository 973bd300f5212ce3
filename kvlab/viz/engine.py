"""Chapter 7 figures: one engine step — the batch, the block tables it wrote through, the pool.

* :func:`engine_step_figure` — pure: an engine snapshot (``LLMEngine.snapshot()``, plain data) in,
  a matplotlib Figure out. Three panels: the flat batch of the last step (one bar per chunk,
  width = tokens, hatched for prefill), every live request's block table (cells written this
  step outlined in black), and the KV pool coloured by block state with refcounts.
* :class:`EngineStepper` — a thin ipywidgets wrapper: a button that calls ``engine.step()`` and
  redraws the figure of the new snapshot.

The snapshot is read by attribute only (duck typing), so this module never imports torch.
"""

from __future__ import annotations

from kvlab.viz._widgets import chapter_box, figure_output
from kvlab.viz.style import (
    BLOCK_STATE_COLORS,
    BLOCK_STATE_LABELS,
    BLOCK_STATE_ORDER,
    INK,
    MUTED,
    PHONE,
    layout,
    phone_aware,
    request_color,
)

__all__ = ["EngineStepper", "engine_step_figure", "request_order"]


def _dark(state: str) -> bool:
    return state in ("exclusive", "pending_copy")


def request_order(snapshot, order: list[str] | None = None) -> list[str]:
    """``order`` (a new list when None) extended, in place, by the request ids of ``snapshot``
    it lacks: live requests, then those of the last batch. Passing one list through a run's
    snapshots gives each request a colour it keeps in every frame."""
    order = [] if order is None else order
    ids = [r.request_id for r in snapshot.requests] + [e.request_id for e in snapshot.last_batch]
    order += [rid for rid in dict.fromkeys(ids) if rid not in order]
    return order


@phone_aware
def engine_step_figure(snapshot, *, max_pool_blocks: int = 48, per_row: int = 16,
                       title: str | None = None, order: list[str] | None = None):
    """Draw ``snapshot`` (an :class:`~kvlab.engine.snapshot.EngineSnapshot`).

    ``max_pool_blocks`` caps the pool panel (blocks ``0 .. max_pool_blocks-1``; the remainder is
    summarised in the panel title). ``order``: request ids in colour order (default:
    :func:`request_order` of this snapshot alone). Raises ValueError for non-positive sizes.
    In a phone's layout the pool has 8 blocks a row and each block table's label sits above it.
    """
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if max_pool_blocks <= 0 or per_row <= 0:
        raise ValueError("max_pool_blocks and per_row must be positive")
    phone = layout().phone
    if phone:
        per_row = min(per_row, 8)
    reqs = [r for r in snapshot.requests if r.block_table]
    order = request_order(snapshot) if order is None else order
    batch = list(snapshot.last_batch)
    bs = snapshot.block_size
    shown = min(snapshot.num_blocks, max_pool_blocks)
    pool_rows = -(-shown // per_row)
    longest = max((len(r.block_table) for r in reqs), default=1)
    width = max(per_row, longest + 1)
    pitch = 1.6 if phone else 1.0          # a table row, in block heights (its label above)
    left = -0.2 if phone else -6.5         # room left of the tables for their labels
    if phone:
        unit = PHONE.width_in / (width - left)   # inches per block (aspect equal)
        heights = [1.9, (max(len(reqs), 1) * pitch + 0.6) * unit + 0.8,
                   (pool_rows + 0.4) * unit + 0.5]
        size = (PHONE.width_in, sum(heights) + 1.6)
    else:
        heights = [1.3, max(len(reqs), 1) * 0.55 + 0.4, pool_rows * 0.55 + 0.4]
        size = (min(0.55 * width + 2.8, 12.0), sum(heights) + 1.6)
    fig, axes = plt.subplots(3, 1, figsize=size, gridspec_kw={"height_ratios": heights})
    ax_batch, ax_tables, ax_pool = axes

    # 1. the batch: one bar per chunk, laid end to end as the flat batch
    total = sum(e.num_tokens for e in batch)
    x = 0
    for e in batch:
        color = request_color(e.request_id, order)
        ax_batch.add_patch(Rectangle((x, 0), e.num_tokens, 1, facecolor=color, alpha=0.85,
                                     edgecolor=INK, linewidth=0.6,
                                     hatch="//" if e.is_prefill else None,
                                     gid=f"chunk-{e.request_id}"))
        end = e.start_pos + e.num_tokens - 1
        label = (f"{e.request_id}\nprefill {e.start_pos}..{end}" if e.is_prefill
                 else f"{e.request_id}\ndecode @{e.start_pos}")
        if e.sampled_token is not None:
            label += f"\n\u2192 {e.sampled_token}"
        if e.num_tokens >= (0.2 if phone else 0.06) * max(total, 1):
            ax_batch.text(x + e.num_tokens / 2, 0.5, label, ha="center", va="center",
                          fontsize=8 if phone else 9, color="white")
        x += e.num_tokens
    ax_batch.set_xlim(0, max(total, 1))
    ax_batch.set_ylim(0, 1)
    ax_batch.set_yticks([])
    ax_batch.set_xlabel("flat batch (tokens)" if phone else "position in the flat batch (tokens)")
    n_pre = sum(e.is_prefill for e in batch)
    heading = title or (f"step {snapshot.step}: {len(batch)} chunks, {total} tokens "
                        f"({n_pre} prefill, {len(batch) - n_pre} decode)")
    ax_batch.set_title(textwrap.fill(heading, 36) if phone else heading)

    # 2. block tables of live requests; cells written this step outlined
    written: dict[str, set[int]] = {e.request_id: {s // bs for s in e.slots} for e in batch}
    for row, r in enumerate(reqs):
        y = -row * pitch
        color = request_color(r.request_id, order)
        ax_tables.text(0 if phone else -0.3, y + (1.25 if phone else 0.45),
                       f"{r.request_id}: {r.status}, {r.num_computed_tokens} tok",
                       ha="left" if phone else "right", va="center", fontsize=9.5,
                       color=color, fontweight="bold")
        for i, block in enumerate(r.block_table):
            state = snapshot.block_states[block]
            hit = block in written.get(r.request_id, ())
            ax_tables.add_patch(Rectangle(
                (i, y), 0.9, 0.9, facecolor=BLOCK_STATE_COLORS[state],
                edgecolor=INK if hit else color, linewidth=2.6 if hit else 1.4,
                gid=f"table-{r.request_id}-{i}"))
            ax_tables.text(i + 0.45, y + 0.45, str(block), ha="center", va="center",
                           fontsize=9, color="white" if _dark(state) else INK)
    if not reqs:
        ax_tables.text(0, 0.4, "no request holds KV", fontsize=10, color=MUTED)
    ax_tables.set_xlim(left, width)
    ax_tables.set_ylim(-(max(len(reqs), 1) - 1) * pitch - 0.2, 1.1 + (0.7 if phone else 0))
    ax_tables.set_aspect("equal")
    ax_tables.axis("off")
    tables = "block tables in logical order (black edge: written this step)"
    ax_tables.set_title(textwrap.fill(tables, 40) if phone else tables, fontsize=10,
                        fontweight="normal")

    # 3. the pool, coloured by state, with refcounts
    for b in range(shown):
        x, y = b % per_row, -(b // per_row)
        state = snapshot.block_states[b]
        ax_pool.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=BLOCK_STATE_COLORS[state],
                                    edgecolor=INK, linewidth=0.5, gid=f"block-{b}"))
        rc = snapshot.refcounts[b]
        ink = "white" if _dark(state) else INK
        ax_pool.text(x + 0.06, y + 0.84, str(b), va="top", fontsize=9.5, color=ink)
        if rc:
            ax_pool.text(x + 0.5, y + 0.36, f"rc={rc}", ha="center", va="center", fontsize=9.5,
                         color=ink)
    ax_pool.set_xlim(left, width)
    ax_pool.set_ylim(-pool_rows + 0.8, 1.1)
    ax_pool.set_aspect("equal")
    ax_pool.axis("off")
    counts = {s: sum(1 for st in snapshot.block_states if st == s) for s in BLOCK_STATE_ORDER}
    more = f" (first {shown} of {snapshot.num_blocks} shown)" if shown < snapshot.num_blocks else ""
    pool = ("KV pool: block id, refcount" + more + "; "
            + ", ".join(f"{counts[s]} {s}" for s in BLOCK_STATE_ORDER if counts[s]))
    ax_pool.set_title(textwrap.fill(pool, 40) if phone else pool, fontsize=10,
                      fontweight="normal")
    handles = [Patch(facecolor=BLOCK_STATE_COLORS[s], edgecolor=INK, linewidth=0.5,
                     label=BLOCK_STATE_LABELS[s]) for s in BLOCK_STATE_ORDER]
    handles += [Patch(facecolor="white", edgecolor=INK, hatch="//", label="prefill chunk")]
    fig.legend(handles=handles, loc="lower center", ncol=2 if phone else 3,
               fontsize=8.5 if phone else 9.5, frameon=False)
    fig.tight_layout(rect=(0, 1.3 / size[1] if phone else 0.07, 1, 1))
    return fig


class EngineStepper:
    """A "step" button over a live ``LLMEngine``; each click runs one step and redraws.

    ``display()`` shows the widget. The drawing is :func:`engine_step_figure` of
    ``engine.snapshot()``; this class only wires the button to it.

    ``replay``, when given, is a zero-argument function returning a fresh engine in the same
    state as ``engine`` (same requests, same steps taken, same seeds): the kernel-free version
    (:meth:`kernel_free`) steps that copy ahead to precompute the next snapshots, leaving
    ``engine`` itself untouched. Without it the widget has no kernel-free twin.
    """

    def __init__(self, engine, *, replay=None, **figure_kwargs):
        import ipywidgets as widgets

        self.engine = engine
        self.replay = replay
        self.figure_kwargs = figure_kwargs
        self.order: list[str] = []    # every request seen, in colour order
        self.button = widgets.Button(description="step", icon="play")
        self.status = widgets.Label()
        self.output, self._draw = figure_output(lambda: self.figure(self.engine.snapshot()))
        self.button.on_click(lambda _: self.step())
        self.widget = chapter_box([widgets.HBox([self.button, self.status]), self.output],
                                  what="engine stepper (each click runs engine.step())",
                                  kernel_free=None if replay is None else self.kernel_free)
        self._draw()

    def figure(self, snapshot):
        """:func:`engine_step_figure` of ``snapshot``, its requests added to :attr:`order`."""
        return engine_step_figure(snapshot, order=request_order(snapshot, self.order),
                                  **self.figure_kwargs)

    def kernel_free(self, max_steps: int = 12):
        """The current snapshot and up to ``max_steps`` more, stepped on ``replay()``'s copy."""
        from kvlab.viz.kernel_free import slider, static_widget

        if self.replay is None:
            raise ValueError("EngineStepper.kernel_free needs replay= (a fresh-engine factory)")
        copy = self.replay()
        snapshots, notes = [copy.snapshot()], ["now"]
        while len(snapshots) <= max_steps and copy.has_unfinished_requests():
            finished = [o.request_id for o in copy.step() if o.finished]
            snapshots.append(copy.snapshot())
            notes.append(f"+{len(notes)} steps" + (f", finished: {', '.join(finished)}"
                                                   if finished else ""))
        for snapshot in snapshots:       # colours fixed before the first frame is drawn
            request_order(snapshot, self.order)
        return static_widget(
            lambda i: self.figure(snapshots[i]),
            {"i": slider(range(len(snapshots)), label="step", labels=notes)},
            title="engine steps, precomputed")

    def step(self) -> None:
        if not self.engine.has_unfinished_requests():
            self.status.value = "all requests finished"
            return
        finished = [o.request_id for o in self.engine.step() if o.finished]
        self.status.value = f"finished: {', '.join(finished)}" if finished else ""
        self._draw()

    def display(self):
        from IPython.display import display

        display(self.widget)
        return self
