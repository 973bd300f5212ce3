"""Chapter 2 figures: block tables mapped onto the physical pool, and where KV memory goes.

* :func:`block_table_figure` — each request's logical blocks, the physical block each maps to,
  and the physical pool coloured by owner (shared blocks marked).
* :func:`waste_figure` — stacked bars of used / reserved / over-reserved / internal /
  external / free memory per allocation policy (a :mod:`kvlab.labs.fragmentation` result).
* :func:`waste_timeline_figure` — the same categories over the steps of one run.
* :class:`BlockTableView` — an ipywidgets playground over a real ``BlockTable`` and allocator.
* :func:`block_table_explorer` — chapter 2's widget: the prompt length and the block size of one
  scripted run on a real allocator (kernel-free twin: :func:`block_table_kernel_free`).

Figure functions are pure: plain data in, a new matplotlib Figure out. Patches carry a
``gid`` (``"phys-7"``, ``"log-r0-2"``, ``"waste-paged-used"``) so tests can find them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvlab.core.block_pool import OutOfBlocks
from kvlab.labs.fragmentation import CATEGORIES, WasteReport
from kvlab.viz._widgets import chapter_box, figure_output, figure_widget
from kvlab.viz.blocks import table_colors
from kvlab.viz.style import (
    BLOCK_STATE_COLORS,
    INK,
    MUTED,
    PHASE_COLORS,
    REQUEST_PALETTE,
)

#: Colour of each waste category (taken from the book's palette).
WASTE_COLORS: dict[str, str] = {
    "used": BLOCK_STATE_COLORS["exclusive"],
    "reserved": PHASE_COLORS["prefill"],
    "over_reserved": PHASE_COLORS["decode"],
    "internal": BLOCK_STATE_COLORS["pending_copy"],
    "external": REQUEST_PALETTE[7],
    "free": BLOCK_STATE_COLORS["free"],
}
WASTE_LABELS: dict[str, str] = {
    "used": "token states",
    "reserved": "reserved (written later)",
    "over_reserved": "over-reserved (never written)",
    "internal": "internal (rounding/tail)",
    "external": "external (holes too small)",
    "free": "free",
}

#: Share of KV memory holding token states in the PagedAttention paper's Figure 2 (percent).
PAPER_TOKEN_STATES = {"max": 20.4, "pow2": 26.8, "oracle": 38.2, "paged": 96.3}


def _owners(tables: Mapping[str, Sequence[int]], num_blocks: int) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for rid, table in tables.items():
        for block in table:
            if not 0 <= block < num_blocks:
                raise ValueError(f"table {rid!r} names block {block}, pool has {num_blocks}")
            owners.setdefault(block, []).append(rid)
    return owners


#: Inches per block cell of :func:`block_table_figure`, and its smallest font (points): with
#: at most :data:`PHONE_COLUMNS` cells across, the figure fits a phone's column (about 340 CSS
#: px inside a widget's frame) with its smallest text at 9 px or more.
CELL_IN = 0.42
FONT_PT = 9.0
PHONE_COLUMNS = 8


def block_table_figure(
    tables: Mapping[str, Sequence[int]],
    num_blocks: int,
    block_size: int,
    token_counts: Mapping[str, int],
    *,
    per_row: int = PHONE_COLUMNS,
    order: Sequence[str] | None = None,
    note: str = "",
):
    """Draw block tables over a pool of ``num_blocks`` physical blocks.

    Args:
        tables: request id -> its block table (physical block ids, in logical order).
        num_blocks: size of the physical pool.
        block_size: tokens per block (fills are drawn to scale).
        token_counts: request id -> tokens stored; must fit the request's table.
        per_row: physical blocks per row of the pool drawing.
        order: request ids in colour order (default: ``tables``' order); pass the same list
            to every figure of a sequence and each request keeps its colour in all of them.
        note: one line printed under the title (what just happened).

    Top: the physical pool, one cell per block, coloured by its owner's
    :func:`request_color` (free blocks grey; a block in more than one table is drawn in the
    ``shared`` colour, hatched, and labelled ``×n``; :func:`table_colors` keeps the requests
    clear of that colour); the dark bar along a block's bottom
    edge shows how many of its slots hold tokens. Below: one row per request, its logical
    blocks ``0, 1, 2, ...`` left to right, each showing the physical block it maps to, shaded
    as far as it is filled and joined to that block by a line. Narrow by design: with at most
    :data:`PHONE_COLUMNS` cells across it fits a phone at :data:`FONT_PT` points.
    Raises ValueError for a block outside the pool or a token count that does not fit.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if num_blocks <= 0 or block_size <= 0 or per_row <= 0:
        raise ValueError("num_blocks, block_size and per_row must be positive")
    rows = list(tables)
    order = rows if order is None else list(order)
    colors = table_colors(order + [r for r in rows if r not in order])
    for rid in rows:
        count = token_counts.get(rid, 0)
        if not 0 <= count <= len(tables[rid]) * block_size:
            raise ValueError(f"request {rid!r}: {count} tokens do not fit "
                             f"{len(tables[rid])} blocks of {block_size}")
    owners = _owners(tables, num_blocks)

    def fill(rid: str, logical: int) -> int:
        return int(np.clip(token_counts.get(rid, 0) - logical * block_size, 0, block_size))

    block_fill = {}
    for rid in rows:
        for logical, block in enumerate(tables[rid]):
            block_fill[block] = max(block_fill.get(block, 0), fill(rid, logical))

    cols = min(per_row, num_blocks)
    pool_rows = -(-num_blocks // cols)
    longest = max((len(t) for t in tables.values()), default=0)
    width = max(cols, longest)
    label_w = 2.1                      # cells of room for the row labels on the left
    height = pool_rows * 1.25 + 1.0 + len(rows) * 1.1 + 0.6
    fig, ax = plt.subplots(figsize=(CELL_IN * (width + label_w) + 0.15,
                                    CELL_IN * height + 0.75))
    top = height

    def pool_xy(block: int) -> tuple[float, float]:
        row, col = divmod(block, cols)
        return col, top - 1.0 - row * 1.25

    for block in range(num_blocks):
        x, y = pool_xy(block)
        who = owners.get(block, [])
        if not who:
            color, hatch = BLOCK_STATE_COLORS["free"], None
        elif len(who) == 1:
            color, hatch = colors[who[0]], None
        else:
            color, hatch = BLOCK_STATE_COLORS["shared"], "//"
        ax.add_patch(Rectangle((x + 0.05, y), 0.9, 0.9, facecolor=color, edgecolor=INK,
                               linewidth=0.6, hatch=hatch, gid=f"phys-{block}"))
        if who:
            frac = block_fill.get(block, 0) / block_size
            ax.add_patch(Rectangle((x + 0.05, y), 0.9 * frac, 0.14, facecolor=INK,
                                   edgecolor="none", gid=f"fill-{block}"))
        label = f"{block}" if len(who) < 2 else f"{block}×{len(who)}"
        ax.text(x + 0.5, y + 0.52, label, ha="center", va="center", fontsize=FONT_PT,
                color="white" if len(who) == 1 else INK)
    ax.text(-0.15, top - 0.55, "physical", ha="right", va="center", fontsize=FONT_PT)

    base = top - 1.0 - (pool_rows - 1) * 1.25 - 1.75
    if rows:
        ax.text(0.05, base + 1.0, "logical blocks 0, 1, 2 ... → physical id", ha="left",
                va="bottom", fontsize=FONT_PT, color=MUTED)
    for r, rid in enumerate(rows):
        y = base - r * 1.1
        color = colors[rid]
        ax.text(-0.15, y + 0.45, f"{rid}: {token_counts.get(rid, 0)} tok", ha="right",
                va="center", fontsize=FONT_PT, color=INK)
        for logical, block in enumerate(tables[rid]):
            ax.add_patch(Rectangle((logical + 0.05, y), 0.9, 0.9, facecolor="white",
                                   edgecolor=color, linewidth=1.6, gid=f"log-{rid}-{logical}"))
            frac = fill(rid, logical) / block_size
            ax.add_patch(Rectangle((logical + 0.05, y), 0.9 * frac, 0.9, facecolor=color,
                                   alpha=0.35, edgecolor="none"))
            ax.text(logical + 0.5, y + 0.45, f"{block}", ha="center", va="center",
                    fontsize=FONT_PT)
            px, py = pool_xy(block)
            ax.plot([logical + 0.5, px + 0.5], [y + 0.9, py], color=color, linewidth=0.7,
                    alpha=0.5, zorder=0.5, gid=f"map-{rid}-{logical}")  # behind the cells
    ax.set_xlim(-label_w, width + 0.1)
    ax.set_ylim(base - (len(rows) - 1) * 1.1 - 0.2 if rows else top - height, top + 0.1)
    ax.axis("off")
    shared = sum(1 for who in owners.values() if len(who) > 1)
    title = (f"block size {block_size}: {len(owners)}/{num_blocks} blocks in use"
             f"{f', {shared} shared' if shared else ''}")
    ax.set_title(title + (f"\n{note}" if note else ""), loc="left", fontsize=FONT_PT + 1)
    fig.tight_layout(pad=0.3)
    return fig


def _fractions(reports: Mapping[str, WasteReport | Mapping[str, float]]) -> dict[str, dict]:
    out = {}
    for name, rep in reports.items():
        fractions = rep.fractions if isinstance(rep, WasteReport) else dict(rep)
        missing = set(CATEGORIES) - set(fractions)
        if missing:
            raise ValueError(f"{name!r} lacks categories {sorted(missing)}")
        out[name] = fractions
    return out


def waste_figure(
    reports: Mapping[str, WasteReport | Mapping[str, float]],
    *,
    paper: Mapping[str, float] | None = PAPER_TOKEN_STATES,
    title: str = "Where KV memory goes (share of the arena)",
):
    """Stacked bars, one per policy, of the waste categories (percent of the arena).

    ``reports`` maps a policy name to a :class:`WasteReport` or to a ``{category: fraction}``
    dict covering :data:`~kvlab.labs.fragmentation.CATEGORIES`. Each bar is labelled with its
    token-state share; when ``paper`` gives a token-state percentage for a policy, a black
    diamond marks it for comparison. Pure; one axes, one patch per (policy, category) with
    a non-zero share.
    """
    import matplotlib.pyplot as plt

    data = _fractions(reports)
    names = list(data)
    fig, ax = plt.subplots(figsize=(8.0, 3.8))
    x = np.arange(len(names))
    bottoms = np.zeros(len(names))
    for cat in CATEGORIES:
        values = np.array([100 * data[n][cat] for n in names])
        for i, (name, v) in enumerate(zip(names, values, strict=True)):
            if v <= 0:
                continue
            ax.bar(x[i], v, bottom=bottoms[i], width=0.6, color=WASTE_COLORS[cat],
                   edgecolor=INK, linewidth=0.5, gid=f"waste-{name}-{cat}",
                   label=WASTE_LABELS[cat])
        bottoms += values
    for i, name in enumerate(names):
        used = 100 * data[name]["used"]
        ax.text(x[i], used / 2, f"{used:.1f}%", ha="center", va="center", color="white",
                fontsize=9, fontweight="bold")
    if paper:
        px = [i for i, n in enumerate(names) if n in paper]
        if px:
            ax.scatter(px, [paper[names[i]] for i in px], marker="D", color=INK, zorder=5,
                       s=28, label="paper: token states")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5),
              fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylim(0, 100)
    ax.set_ylabel("% of KV arena")
    ax.set_title(title, loc="left", fontsize=11)
    fig.tight_layout()
    return fig


def waste_timeline_figure(report: WasteReport, *, steps: int | None = None):
    """Stacked area of the waste categories over the steps of one run (first ``steps``).

    Pure. One axes with one filled area per category (:func:`matplotlib.axes.Axes.stackplot`)
    and a muted line for the number of running requests on a twin axis.
    """
    import matplotlib.pyplot as plt

    n = report.steps if steps is None else min(steps, report.steps)
    t = np.arange(n)
    fig, ax = plt.subplots(figsize=(8.0, 3.2))
    layers = [100 * report.trace[c][:n] / report.arena_tokens for c in CATEGORIES]
    ax.stackplot(t, *layers, colors=[WASTE_COLORS[c] for c in CATEGORIES],
                 labels=[WASTE_LABELS[c] for c in CATEGORIES], linewidth=0)
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_ylim(0, 100)
    ax.set_xlabel("step")
    ax.set_ylabel("% of KV arena")
    twin = ax.twinx()
    twin.plot(t, report.trace["running"][:n], color=MUTED, linewidth=0.8, label="running")
    twin.set_ylabel("running requests", color=MUTED)
    twin.spines["right"].set_visible(True)
    ax.legend(loc="center left", bbox_to_anchor=(1.12, 0.5), fontsize=8)
    ax.set_title(f"{report.policy} ({report.arena}), {report.arena_tokens:,} slots",
                 loc="left", fontsize=11)
    fig.tight_layout()
    return fig


class BlockTableView:
    """Interactive page tables over a real allocator: add requests, append tokens, finish.

    Holds a :class:`kvlab.reference.BlockAllocator` of ``num_blocks`` blocks and one
    :class:`kvlab.labs.paging.BlockTable` per request; each button press calls the real
    methods and redraws :func:`block_table_figure` from a snapshot. Out-of-memory shows the
    allocator's error and changes nothing (``append_tokens`` is all-or-nothing).
    """

    def __init__(self, num_blocks: int = 16, block_size: int = 4):
        from kvlab.reference import BlockAllocator

        self.num_blocks, self.block_size = num_blocks, block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict = {}
        self._next = 0
        #: (what happened, snapshot after it), one entry per successful call: the frames of the
        #: kernel-free version (:meth:`kernel_free`).
        self.history: list[tuple[str, tuple[dict, dict]]] = [("empty pool", self.snapshot())]

    def snapshot(self) -> tuple[dict[str, list[int]], dict[str, int]]:
        """(request id -> block table, request id -> tokens), plain data for the figure."""
        return ({rid: list(t.blocks) for rid, t in self.tables.items()},
                {rid: len(t) for rid, t in self.tables.items()})

    def figure(self, index: int | None = None, *, note: str = ""):
        """The figure of the current state, or of ``history[index]``; a request's colour is
        fixed by its creation order, so it is the same in every frame. ``note`` is printed
        under the title."""
        tables, counts = self.snapshot() if index is None else self.history[index][1]
        created = [f"r{i}" for i in range(self._next)]
        return block_table_figure(tables, self.num_blocks, self.block_size, counts,
                                  order=created, note=note)

    def _record(self, what: str) -> None:
        self.history.append((what, self.snapshot()))

    def add_request(self, prompt_tokens: int) -> str:
        from kvlab.labs.paging import BlockTable

        rid = f"r{self._next}"
        table = BlockTable(self.block_size, self.allocator)
        table.append_tokens(prompt_tokens)       # raises before anything is registered
        self.tables[rid] = table
        self._next += 1
        self._record(f"new request {rid} ({prompt_tokens} tokens)")
        return rid

    def append(self, rid: str, tokens: int = 1) -> None:
        self.tables[rid].append_tokens(tokens)
        self._record(f"append {tokens} token{'s' * (tokens != 1)} to {rid}")

    def finish(self, rid: str) -> None:
        self.tables.pop(rid).release()
        self._record(f"finish {rid}")

    def kernel_free(self, max_frames: int = 24):
        """A slider over :attr:`history` (the actions taken so far), opening at the latest."""
        from kvlab.viz.kernel_free import slider, spread, static_widget

        n = len(self.history)
        keep = spread(n, max_frames)
        return static_widget(
            self.figure,
            {"index": slider(keep, label="action",
                             labels=[f"{i}: {self.history[i][0]}" for i in keep])},
            default={"index": keep[-1]}, title="block tables after each action",
            caption=lambda index: (f"after: {self.history[index][0]} - "
                                   f"{self._free_after(index)} of {self.num_blocks} blocks free"))

    def _free_after(self, index: int) -> int:
        tables, _ = self.history[index][1]
        return self.num_blocks - sum(len(t) for t in tables.values())

    def widget(self):
        """The ipywidgets front end (buttons + figure)."""
        import ipywidgets as w

        out, show = figure_output(self.figure)
        who = w.Dropdown(options=[], description="request")
        tokens = w.BoundedIntText(value=5, min=1, max=self.num_blocks * self.block_size,
                                  description="tokens")
        message = w.Label()
        buttons = {name: w.Button(description=name) for name in ("new request", "append",
                                                                  "finish")}

        def redraw(note: str = "") -> None:
            who.options = list(self.tables)
            message.value = note or (f"{len(self.allocator.free)} of {self.num_blocks} "
                                     "blocks free")
            show()

        def act(name):
            def handler(_):
                try:
                    if name == "new request":
                        rid = self.add_request(tokens.value)
                        redraw()
                        who.value = rid
                        return
                    if who.value is None:
                        redraw("no request selected")
                        return
                    if name == "append":
                        self.append(who.value, tokens.value)
                    else:
                        self.finish(who.value)
                    redraw()
                except OutOfBlocks as exc:
                    redraw(f"OutOfBlocks: {exc} (nothing changed)")
            return handler

        for name, button in buttons.items():
            button.on_click(act(name))
        redraw()
        return chapter_box([w.HBox([who, tokens, *buttons.values()]), message, out],
                           what="block-table playground (new request, append, finish)",
                           kernel_free=self.kernel_free)


#: The explorer's knobs: the new request's prompt length and the block size. Its kernel-free
#: twin precomputes every pair (15 frames); the live widget offers any prompt of 1-32 tokens.
EXPLORER_PROMPTS = (3, 8, 10, 16, 24)
EXPLORER_BLOCK_SIZES = (2, 4, 8)
#: Blocks in the explorer's pool (its token capacity is this times the block size).
EXPLORER_POOL = 16


def block_table_scenario(prompt_len: int, block_size: int,
                         num_blocks: int = EXPLORER_POOL) -> tuple[BlockTableView, str]:
    """Chapter 2's script on a real allocator, and one line saying what happened to the new
    request: r0 (6 tokens), r1 (9) and r2 (3) arrive; r1 finishes, leaving holes; a new
    request of ``prompt_len`` tokens arrives (refused, with nothing changed, when the pool
    has too few free blocks: allocation is all or nothing); r0 appends 3 tokens."""
    view = BlockTableView(num_blocks=num_blocks, block_size=block_size)
    for prompt in (6, 9, 3):
        view.add_request(prompt)
    view.finish("r1")
    try:
        rid = view.add_request(prompt_len)
        table = view.tables[rid]
        note = (f"new {rid}: {prompt_len} tokens in {len(table.blocks)} blocks, "
                f"{table.tail_slots} slot{'s' * (table.tail_slots != 1)} unwritten")
    except OutOfBlocks as exc:
        note = (f"new request ({prompt_len} tokens) refused: needs {exc.needed} blocks, "
                f"{exc.available} free")
    try:
        view.append("r0", 3)
    except OutOfBlocks:
        note += "; r0 cannot grow"
    return view, note


def explorer_figure(prompt_len: int, block_size: int):
    """The figure of :func:`block_table_scenario` with its note under the title."""
    view, note = block_table_scenario(prompt_len, block_size)
    return view.figure(note=note)


def block_table_explorer(prompt_len: int = 10, block_size: int = 4):
    """Chapter 2's widget: move the new request's prompt length and the block size, and see
    where :func:`block_table_scenario`'s blocks land (kernel-free twin:
    :func:`block_table_kernel_free`)."""
    import ipywidgets as w

    controls = {
        "prompt_len": w.IntSlider(value=prompt_len, min=1, max=32, description="new prompt"),
        "block_size": w.Dropdown(options=list(EXPLORER_BLOCK_SIZES), value=block_size,
                                 description="block size"),
    }
    return figure_widget(controls, explorer_figure, header=[w.HBox(list(controls.values()))],
                         what="block-table explorer (prompt length, block size)",
                         kernel_free=lambda: block_table_kernel_free(prompt_len, block_size))


def block_table_kernel_free(prompt_len: int = 10, block_size: int = 4):
    """The explorer without a kernel: every pair of :data:`EXPLORER_PROMPTS` and
    :data:`EXPLORER_BLOCK_SIZES` precomputed."""
    from kvlab.viz.kernel_free import dropdown, slider, static_widget

    return static_widget(
        explorer_figure,
        {"prompt_len": slider(EXPLORER_PROMPTS, label="new prompt (tokens)"),
         "block_size": dropdown(EXPLORER_BLOCK_SIZES, label="block size")},
        default={"prompt_len": prompt_len, "block_size": block_size},
        title=f"block tables on a pool of {EXPLORER_POOL} blocks")
