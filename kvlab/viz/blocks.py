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


def pool_figure(snapshot: KVSnapshot, *, per_row: int = 12, title: str | None = None):
    """Draw the pool of ``snapshot`` coloured by block state, refcounts inside, tables below.

    Each pool cell shows its physical id (top left) and, when owned, ``rc=<refcount>``; a
    fenced block (pending copy) is red whatever its owners. Each table row lists the request's
    physical blocks in logical order, edged in the request's colour.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if per_row <= 0:
        raise ValueError("per_row must be positive")
    n = snapshot.num_blocks
    rows = -(-n // per_row)
    rids = list(snapshot.tables)
    longest = max((len(t) for t in snapshot.tables.values()), default=0)
    width = max(per_row, longest + 2)
    height = rows + (len(rids) + 0.8 if rids else 0)
    fig_width = min(0.62 * width + 1.2, 12.0)
    k = text_scale(fig_width, 7)  # wide pools are shown narrowed: their text grows to stay legible
    fig, ax = plt.subplots(figsize=(fig_width, 0.62 * height + 1.3))
    for b in range(n):
        x, y = b % per_row, -(b // per_row)
        state = snapshot.block_states[b]
        ax.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor=BLOCK_STATE_COLORS[state],
                               edgecolor=INK, linewidth=0.6, gid=f"block-{b}"))
        dark = state in ("exclusive", "pending_copy")
        ax.text(x + 0.06, y + 0.8, str(b), fontsize=7 * k, va="top",
                color="white" if dark else INK)
        if snapshot.refcounts[b]:
            ax.text(x + 0.46, y + 0.34, f"rc={snapshot.refcounts[b]}", ha="center",
                    va="center", fontsize=8 * k, color="white" if dark else INK)
    top = -rows - 0.6
    for r, rid in enumerate(rids):
        y = top - r
        color = request_color(rid, rids)
        ax.text(-0.2, y + 0.46, rid, ha="right", va="center", fontsize=9 * k, color=color,
                fontweight="bold")
        for i, block in enumerate(snapshot.tables[rid]):
            state = snapshot.block_states[block]
            ax.add_patch(Rectangle((i, y), 0.92, 0.92, facecolor=BLOCK_STATE_COLORS[state],
                                   edgecolor=color, linewidth=2.0, gid=f"table-{rid}-{i}"))
            ax.text(i + 0.46, y + 0.46, str(block), ha="center", va="center", fontsize=8 * k,
                    color="white" if state in ("exclusive", "pending_copy") else INK)
    if rids:
        ax.text(-0.2, top + 1.25, "block tables (logical order)", ha="left", fontsize=8 * k,
                color=MUTED)
    ax.set_xlim(-2.2, width)
    ax.set_ylim(top - len(rids) + 0.6 if rids else -rows + 0.6, 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [Patch(facecolor=BLOCK_STATE_COLORS[s], edgecolor=INK, linewidth=0.5,
                     label=BLOCK_STATE_LABELS[s]) for s in BLOCK_STATE_ORDER]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=5,
              fontsize=8 * k, handlelength=1.2, columnspacing=1.0)
    counts = ", ".join(f"{s.replace('_', ' ')} {snapshot.count(s)}" for s in BLOCK_STATE_ORDER)
    ax.set_title(title or f"KV pool: {counts}", fontsize=10 * k)
    fig.tight_layout()
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
        kv.free(victim)
        steps.append((f"{victim} aborted mid-copy: its copy target stays fenced, not free",
                      snapshot_of(kv)))
    kv.complete_copies(pending)
    steps.append(("copies complete: fences lifted"
                  + (", the aborted copy's block freed" if abort_mid_copy else ""),
                  snapshot_of(kv)))
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


#: The kernel-free explorer's grid (prompt length and block size at the live defaults).
FORK_GRID = {"n": (2, 3), "abort_mid_copy": (False, True)}

#: Steps of every :func:`fork_scenario` run without the prefix cache (``n >= 2``).
FORK_STEPS = 8


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
            runs[key] = fork_scenario(n=n, prompt_len=prompt_len, block_size=block_size,
                                      abort_mid_copy=abort_mid_copy,
                                      num_blocks=pool_size(n, prompt_len, block_size))
        return runs[key]

    def draw(step, **setting):
        steps = run(**setting)
        i = min(step, len(steps) - 1)
        return pool_figure(steps[i][1], title=f"step {i}: {steps[i][0]}")

    start = next(i for i, (_, s) in enumerate(run(n, prompt_len, block_size, abort_mid_copy))
                 if s.pending_copies)
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


def fork_kernel_free(*, prompt_len: int = 10, block_size: int = 4, start: int = 3):
    """The explorer without a kernel: :data:`FORK_GRID` x every step, precomputed."""
    from kvlab.viz.kernel_free import dropdown, slider, static_widget

    runs = {(k, a): fork_scenario(n=k, prompt_len=prompt_len, block_size=block_size,
                                  abort_mid_copy=a,
                                  num_blocks=pool_size(k, prompt_len, block_size))
            for k in FORK_GRID["n"] for a in FORK_GRID["abort_mid_copy"]}
    assert all(len(r) == FORK_STEPS for r in runs.values())

    def draw(n, abort_mid_copy, step):
        caption, snap = runs[n, abort_mid_copy][step]
        return pool_figure(snap, title=f"step {step}: {caption}")

    return static_widget(
        draw,
        {"n": dropdown(FORK_GRID["n"], label="n"),
         "abort_mid_copy": dropdown(FORK_GRID["abort_mid_copy"], label="abort a child mid-copy",
                                    labels=("no", "yes")),
         "step": slider(range(FORK_STEPS), label="step")},
        default={"n": 3, "abort_mid_copy": False, "step": start},
        title=f"forks for parallel sampling ({prompt_len}-token prompt, blocks of "
              f"{block_size})")


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
