"""Chapter 3 figures: the KV pool coloured by block state, with refcounts, step by step.

* :func:`pool_figure` — pure: a :class:`~kvlab.labs.kv_snapshot.KVSnapshot` in, a Figure out. The
  pool is drawn one cell per physical block, coloured by state (free / exclusive / shared /
  cached / pending copy), with its refcount; below it, every request's block table.
* :func:`fork_scenario` — a scripted run of a real :class:`KVCacheManager`: parallel sampling
  (prefill, fork, copy-on-write of the partial last block, optionally an abort mid-copy, decode,
  release), returning ``(caption, snapshot)`` pairs.
* :func:`fork_explorer` — chapter 3's widget: n, prompt length, block size and an abort
  mid-copy switch over :func:`fork_scenario`, with a step slider (kernel-free twin:
  :func:`fork_kernel_free`).
* :class:`RefcountView` — a slider over a fixed list of steps (thin glue over pool_figure).

Patches carry a ``gid`` (``"block-7"``, ``"table-p-1"``) so tests can find them.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlab.core.kv_cache_manager import KVCacheManager
from kvlab.labs.invariants import check_kv_manager
from kvlab.labs.kv_snapshot import KVSnapshot, snapshot_of
from kvlab.viz._widgets import figure_widget
from kvlab.viz.kernel_free import COLUMN_PX, CSS_DPI
from kvlab.viz.style import (
    BLOCK_STATE_COLORS,
    BLOCK_STATE_LABELS,
    BLOCK_STATE_ORDER,
    INK,
    MUTED,
    REQUEST_PALETTE,
    request_color,
)

#: The smallest text a book figure may show, in CSS px, with a margin over the site check's 9.
READABLE_CSS_PX = 9.8


def text_scale(width_in: float, smallest_pt: float, *,
               min_css_px: float = READABLE_CSS_PX) -> float:
    """Factor (>= 1) by which to enlarge every font of a figure ``width_in`` inches wide whose
    smallest text is ``smallest_pt`` points, so that text shows at ``min_css_px`` or more when
    the figure is displayed as the book does (:data:`CSS_DPI` px per inch, at most
    :data:`COLUMN_PX` wide; see :func:`kvlab.viz.kernel_free.display_dpi`)."""
    if width_in <= 0 or smallest_pt <= 0:
        raise ValueError(f"text_scale needs a positive width and size, got {width_in}, "
                         f"{smallest_pt}")
    dpi = min(float(CSS_DPI), COLUMN_PX / width_in)
    return max(1.0, min_css_px * 72 / (dpi * smallest_pt))


def table_colors(order: Sequence[str]) -> dict[str, str]:
    """Request colours of a block-table figure: the book's palette in ``order``, without its
    two oranges, which would read as the colour of a shared block, and with the sky blue after
    the colours that differ most from the first request's blue."""
    palette = [REQUEST_PALETTE[i] for i in (0, 2, 3, 7, 8, 4, 9, 6)]
    return {rid: palette[i % len(palette)] for i, rid in enumerate(order)}


#: The narrow layout of :func:`pool_figure` (``phone=True``): blocks per row, inches per cell
#: and the smallest font, so that the figure fits a phone's column (about 340 CSS px inside a
#: widget's frame) with its smallest text at 9 px or more.
PHONE_PER_ROW = 8
PHONE_CELL_IN = 0.44
PHONE_FONT_PT = 9.0


def pool_figure(snapshot: KVSnapshot, *, per_row: int = 12, title: str | None = None,
                phone: bool = False):
    """Draw the pool of ``snapshot`` coloured by block state, refcounts inside, tables below.

    Each pool cell shows its physical id (top left) and, when owned, ``rc=<refcount>``; a
    fenced block (pending copy) is red whatever its owners. Each table row lists the request's
    physical blocks in logical order, edged in the request's colour. ``phone`` draws the narrow
    layout (:data:`PHONE_PER_ROW` blocks a row whatever ``per_row`` says, fonts of at least
    :data:`PHONE_FONT_PT` points, the title wrapped, the legend in two columns, requests in
    :func:`table_colors`).
    """
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if per_row <= 0:
        raise ValueError("per_row must be positive")
    if phone:
        per_row = PHONE_PER_ROW
    n = snapshot.num_blocks
    rows = -(-n // per_row)
    rids = list(snapshot.tables)
    colors = table_colors(rids) if phone else {rid: request_color(rid, rids) for rid in rids}
    longest = max((len(t) for t in snapshot.tables.values()), default=0)
    width = max(per_row, longest + (0 if phone else 2))
    height = rows + (len(rids) + 0.8 if rids else 0)
    margin = 1.2 if phone else 2.2                 # cells of room left of the tables
    if phone:
        fig_width = PHONE_CELL_IN * (width + margin) + 0.15
        sizes = {"id": PHONE_FONT_PT, "rc": PHONE_FONT_PT, "label": PHONE_FONT_PT + 1,
                 "cell": PHONE_FONT_PT, "legend": PHONE_FONT_PT, "title": PHONE_FONT_PT + 1}
        fig_height = PHONE_CELL_IN * (height + 0.6) + 1.2
    else:
        fig_width = min(0.62 * width + 1.2, 12.0)
        k = text_scale(fig_width, 7)  # wide pools are shown narrowed: their text grows
        sizes = {"id": 7 * k, "rc": 8 * k, "label": 9 * k, "cell": 8 * k, "legend": 8 * k,
                 "title": 10 * k}
        fig_height = 0.62 * height + 1.3
    fig, ax = plt.subplots(figsize=(fig_width, fig_height))
    for b in range(n):
        x, y = b % per_row, -(b // per_row)
        state = snapshot.block_states[b]
        ax.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor=BLOCK_STATE_COLORS[state],
                               edgecolor=INK, linewidth=0.6, gid=f"block-{b}"))
        dark = state in ("exclusive", "pending_copy")
        ax.text(x + 0.06, y + (0.86 if phone else 0.8), str(b), fontsize=sizes["id"], va="top",
                color="white" if dark else INK)
        if snapshot.refcounts[b]:
            ax.text(x + 0.46, y + (0.26 if phone else 0.34), f"rc={snapshot.refcounts[b]}",
                    ha="center", va="center", fontsize=sizes["rc"],
                    color="white" if dark else INK)
    top = -rows - 0.6
    for r, rid in enumerate(rids):
        y = top - r
        color = colors[rid]
        ax.text(-0.2, y + 0.46, rid, ha="right", va="center", fontsize=sizes["label"],
                color=color, fontweight="bold")
        for i, block in enumerate(snapshot.tables[rid]):
            state = snapshot.block_states[block]
            ax.add_patch(Rectangle((i, y), 0.92, 0.92, facecolor=BLOCK_STATE_COLORS[state],
                                   edgecolor=color, linewidth=2.0, gid=f"table-{rid}-{i}"))
            ax.text(i + 0.46, y + 0.46, str(block), ha="center", va="center",
                    fontsize=sizes["cell"],
                    color="white" if state in ("exclusive", "pending_copy") else INK)
    if rids:
        ax.text(-0.2, top + 1.25, "block tables (logical order)", ha="left",
                fontsize=sizes["legend"], color=MUTED)
    ax.set_xlim(-margin, width)
    ax.set_ylim(top - len(rids) + 0.6 if rids else -rows + 0.6, 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [Patch(facecolor=BLOCK_STATE_COLORS[s], edgecolor=INK, linewidth=0.5,
                     label=BLOCK_STATE_LABELS[s]) for s in BLOCK_STATE_ORDER]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0),
              ncol=2 if phone else 5, fontsize=sizes["legend"], handlelength=1.2,
              columnspacing=1.0)
    counts = ", ".join(f"{s.replace('_', ' ')} {snapshot.count(s)}" for s in BLOCK_STATE_ORDER)
    text = title or f"KV pool: {counts}"
    if phone:
        text = "\n".join(textwrap.wrap(text, 44))
    ax.set_title(text, fontsize=sizes["title"], loc="left" if phone else "center")
    fig.tight_layout(pad=0.3 if phone else 1.08)
    return fig


def fork_scenario(*, n: int = 3, num_blocks: int = 12, block_size: int = 4,
                  prompt_len: int = 10, decode_steps: int = 3,
                  enable_prefix_caching: bool = False,
                  abort_mid_copy: bool = False) -> list[tuple[str, KVSnapshot]]:
    """Parallel sampling on a real KVCacheManager; the snapshot after every step.

    Steps: admit and prefill the prompt; fork ``n - 1`` children; each sequence writes its first
    token (children copy-on-write the shared partial last block, the parent, last owner, writes
    in place); the copies complete; decode; one child finishes; all finish. With
    ``abort_mid_copy`` the last child is aborted while its copy is still pending (its new block
    stays fenced until the copy completes, then returns to the pool) and takes the place of the
    "one child finishes" step. With ``enable_prefix_caching`` (chapter 4) full blocks also go
    to the prefix cache, which holds a reference of its own, and the cached blocks stay,
    evictable, when all have finished. Raises ``ValueError`` for ``n < 2`` with
    ``abort_mid_copy``, and :class:`~kvlab.core.block_pool.OutOfBlocks` when the pool is too
    small for the run.
    """
    if n < 1 or prompt_len < 1 or decode_steps < 0:
        raise ValueError("need n >= 1, a non-empty prompt and decode_steps >= 0")
    if abort_mid_copy and n < 2:
        raise ValueError("abort_mid_copy needs a child to abort: n >= 2")
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    scope = ("demo-model", "tenant-a")
    prompt = list(range(100, 100 + prompt_len))
    steps: list[tuple[str, KVSnapshot]] = [("empty pool", snapshot_of(kv))]
    kv.admit("p", scope, prompt, prompt_len)
    steps.append((f"admit p: {prompt_len} prompt tokens in {kv.blocks_for(prompt_len)} blocks",
                  snapshot_of(kv)))
    if enable_prefix_caching:
        kv.commit("p", prompt)
        steps.append(("prefill done: full blocks cached (the cache is an owner, rc=2)",
                      snapshot_of(kv)))
    seqs = ["p"] + [f"s{i}" for i in range(1, n)]
    for child in seqs[1:]:
        kv.fork("p", child)
    children = "child" if n == 2 else "children"
    steps.append((f"fork {n - 1} {children} for n={n}: every block shared", snapshot_of(kv)))
    tokens = {rid: list(prompt) for rid in seqs}
    pending = []
    sample = {rid: 1000 * k for k, rid in enumerate(seqs)}  # each sequence samples its own
    for rid in reversed(seqs):  # children first: the parent ends as the last owner
        pending += kv.grow(rid, prompt_len + 1, prompt_len)
        tokens[rid].append(sample[rid] + len(tokens[rid]))
    steps.append((f"first token: copy-on-write of the partial block, copies {pending}"
                  if pending else "first token: nothing shared is written, no copy",
                  snapshot_of(kv)))
    if abort_mid_copy:
        victim = seqs.pop()
        in_flight = any(new in kv.block_table(victim) for _, new in pending)
        kv.free(victim)
        steps.append((f"{victim} aborted mid-copy: its copy target stays fenced, not free"
                      if in_flight else f"{victim} aborted: no copy in flight, its blocks "
                      "freed at once", snapshot_of(kv)))
    kv.complete_copies(pending)
    if pending:
        done = "copies complete: fences lifted" + (
            ", the aborted copy's block freed" if abort_mid_copy else "")
    else:
        done = "no copy to complete: nothing is fenced"
    steps.append((done, snapshot_of(kv)))
    for _ in range(decode_steps):
        for rid in seqs:
            length = len(tokens[rid])
            kv.grow(rid, length + 1, length)
            tokens[rid].append(sample[rid] + length)
            if enable_prefix_caching:
                kv.commit(rid, tokens[rid])
    steps.append((f"{decode_steps} decode steps: private tails grow", snapshot_of(kv)))
    if len(seqs) > 1 and not abort_mid_copy:
        kv.free(seqs[-1])
        steps.append((f"{seqs[-1]} finishes: its private blocks freed"
                      + (", its cached ones stay" if enable_prefix_caching else ""),
                      snapshot_of(kv)))
        seqs.pop()
    for rid in seqs:
        kv.free(rid)
    steps.append(("all finish: " + ("cached blocks evictable, everything else free"
                                    if enable_prefix_caching else "every block free"),
                  snapshot_of(kv)))
    check_kv_manager(kv)
    return steps


def pool_size(n: int, prompt_len: int, block_size: int, decode_steps: int = 3) -> int:
    """Blocks :func:`fork_scenario` needs (every sequence's whole table, unshared), plus a
    spare row's worth, and at least 12: what :func:`fork_explorer` sizes its pool to."""
    per_sequence = -(-(prompt_len + 1 + decode_steps) // block_size)
    return max(12, n * per_sequence + 2)


#: The kernel-free explorer's grid: the controls chapter 3's "Things to try" names (a prompt
#: that fills its last block or not, block sizes 2 to 8, an abort mid-copy) for ``n = 3``, and
#: the steps from the fork to the one after the copies (:data:`FORK_TWIN_STEPS`): 48 frames.
FORK_GRID = {"prompt_len": (8, 10), "block_size": (2, 4, 8), "abort_mid_copy": (False, True)}
FORK_TWIN_STEPS = (2, 3, 4, 5)

#: Steps of every :func:`fork_scenario` run without the prefix cache (``n >= 2``), and the one
#: at which every sequence writes its first token (copy-on-write, when the prompt's last block
#: is partial).
FORK_STEPS = 8
FIRST_TOKEN_STEP = 3


def _fork_run(n: int, prompt_len: int, block_size: int, abort_mid_copy: bool):
    return fork_scenario(n=n, prompt_len=prompt_len, block_size=block_size,
                         abort_mid_copy=abort_mid_copy,
                         num_blocks=pool_size(n, prompt_len, block_size))


def fork_explorer(*, n: int = 3, prompt_len: int = 10, block_size: int = 4,
                  abort_mid_copy: bool = False):
    """Chapter 3's widget: set ``n``, the prompt length and the block size, choose whether a
    child is aborted mid-copy, and step through the run (:func:`fork_scenario` on a real
    ``KVCacheManager``, prefix cache off; pool sized by :func:`pool_size`)."""
    import ipywidgets as w

    runs: dict[tuple, list] = {}

    def run(n, prompt_len, block_size, abort_mid_copy):
        key = (n, prompt_len, block_size, abort_mid_copy)
        if key not in runs:
            runs[key] = _fork_run(*key)
        return runs[key]

    def draw(step, **setting):
        steps = run(**setting)
        i = min(step, len(steps) - 1)
        return pool_figure(steps[i][1], title=f"step {i}: {steps[i][0]}", phone=True)

    start = FIRST_TOKEN_STEP        # where copy-on-write happens, if it does
    controls = {
        "n": w.IntSlider(value=n, min=2, max=6, description="n"),
        "prompt_len": w.IntSlider(value=prompt_len, min=1, max=24, description="prompt"),
        "block_size": w.Dropdown(options=[2, 4, 8], value=block_size, description="block size"),
        "abort_mid_copy": w.Checkbox(value=abort_mid_copy, description="abort a child mid-copy"),
        "step": w.IntSlider(value=start, min=0, max=FORK_STEPS - 1, description="step",
                            continuous_update=False),
    }
    row = list(controls.values())
    return figure_widget(controls, draw, header=[w.HBox(row[:3]), w.HBox(row[3:])],
                         what="fork explorer (n, prompt length, block size, abort mid-copy, "
                              "step)",
                         kernel_free=lambda: fork_kernel_free(prompt_len=prompt_len,
                                                              block_size=block_size,
                                                              start=start))


def fork_kernel_free(*, prompt_len: int = 10, block_size: int = 4,
                     start: int = FIRST_TOKEN_STEP):
    """The explorer without a kernel, for ``n = 3``: every point of :data:`FORK_GRID` at each
    of :data:`FORK_TWIN_STEPS`, precomputed (``prompt_len``, ``block_size`` and ``start`` pick
    the frame shown first)."""
    from kvlab.viz.kernel_free import dropdown, slider, static_widget

    grid = FORK_GRID
    runs = {(p, q, a): _fork_run(3, p, q, a) for p in grid["prompt_len"]
            for q in grid["block_size"] for a in grid["abort_mid_copy"]}
    assert all(len(r) == FORK_STEPS for r in runs.values())

    def draw(prompt_len, block_size, abort_mid_copy, step):
        caption, snap = runs[prompt_len, block_size, abort_mid_copy][step]
        return pool_figure(snap, title=f"step {step}: {caption}", phone=True)

    return static_widget(
        draw,
        {"prompt_len": dropdown(grid["prompt_len"], label="prompt (tokens)"),
         "block_size": dropdown(grid["block_size"], label="block size"),
         "abort_mid_copy": dropdown(grid["abort_mid_copy"], label="abort a child mid-copy",
                                    labels=("no", "yes")),
         "step": slider(FORK_TWIN_STEPS, label="step")},
        default={"prompt_len": prompt_len, "block_size": block_size, "abort_mid_copy": False,
                 "step": start},
        title="forks for parallel sampling, n = 3")


class RefcountView:
    """Step through ``(caption, snapshot)`` pairs with a slider; drawing is :func:`pool_figure`."""

    def __init__(self, steps: Sequence[tuple[str, KVSnapshot]] | None = None, *,
                 start: int | None = None):
        self.steps = list(steps) if steps is not None else fork_scenario()
        if not self.steps:
            raise ValueError("RefcountView needs at least one step")
        if start is None:  # default: the first step with a pending copy, else the first
            start = next((i for i, (_, s) in enumerate(self.steps) if s.pending_copies), 0)
        if not 0 <= start < len(self.steps):
            raise ValueError(f"start {start} outside 0..{len(self.steps) - 1}")
        self.start = start

    def figure(self, index: int | None = None):
        """The pure figure of step ``index`` (default: the view's start step)."""
        index = self.start if index is None else index
        caption, snapshot = self.steps[index]
        return pool_figure(snapshot, title=f"step {index}: {caption}")

    def widget(self):
        """A step slider above :meth:`figure` of the selected step."""
        import ipywidgets as w

        slider = w.IntSlider(value=self.start, min=0, max=len(self.steps) - 1, description="step",
                             continuous_update=False)
        return figure_widget({"index": slider}, self.figure,
                             what="refcount view (a slider over the scenario's steps)",
                             kernel_free=self.kernel_free)

    def kernel_free(self):
        """Every step precomputed, switched by a plain range slider."""
        from kvlab.viz.kernel_free import slider, static_widget

        return static_widget(
            self.figure,
            {"index": slider(range(len(self.steps)), label="step",
                             labels=[f"{i}: {c}" for i, (c, _) in enumerate(self.steps)])},
            default={"index": self.start}, title="refcounts step by step")
