"""Chapter 4 figures: the radix prefix tree with a hit path highlighted, and hit-rate curves.

* :func:`radix_figure` — pure: a :class:`~kvlab.labs.kv_snapshot.RadixSnapshot` (a scope's tree) in,
  a Figure out. One box per cached block (its tokens and physical block id), laid out root to
  leaves left to right; locked nodes (in use by a request) are drawn as *shared*, unlocked
  ones as *cached, evictable*; the blocks in ``highlight`` (a lookup's hit path) get a thick
  outline and thick edges.
* :func:`hit_rate_figure` — bars of prefill tokens computed with and without prefix caching.

Patches carry a ``gid`` (``"node-<block>"``) so tests can find them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvlab.labs.kv_snapshot import RadixSnapshot
from kvlab.viz._widgets import figure_widget
from kvlab.viz.style import BLOCK_STATE_COLORS, INK, MUTED


def _chunk_label(chunk: tuple, max_tokens: int) -> str:
    shown = " ".join(str(t) for t in chunk[:max_tokens])
    return shown + (" …" if len(chunk) > max_tokens else "")


def radix_figure(tree: RadixSnapshot, highlight: Iterable[int] = (), *,
                 max_tokens: int = 4, title: str | None = None):
    """Draw ``tree`` with the nodes whose block is in ``highlight`` emphasised.

    Node text: the block's first ``max_tokens`` tokens, and ``#<block>`` with the lock count
    when locked. Node colour: ``shared`` when locked, ``cached`` when evictable.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    highlight = set(highlight)
    nodes = {n.node_id: n for n in tree.nodes}
    children: dict[int | None, list[int]] = {}
    for n in tree.nodes:  # depth-first order: children appear in drawing order
        children.setdefault(n.parent_id, []).append(n.node_id)
    # y position: leaves get consecutive rows, a parent sits at the mean of its children
    ypos: dict[int, float] = {}
    next_row = [0]

    def place(node_id: int) -> float:
        kids = children.get(node_id, [])
        if not kids:
            ypos[node_id] = -next_row[0]
            next_row[0] += 1
        else:
            ys = [place(k) for k in kids]
            ypos[node_id] = sum(ys) / len(ys)
        return ypos[node_id]

    roots = children.get(None, [])
    for r in roots:
        place(r)
    depth = max((n.depth for n in tree.nodes), default=0)
    rows = max(next_row[0], 1)
    fig, ax = plt.subplots(figsize=(min(1.9 * (depth + 1) + 1.0, 12.0), 0.62 * rows + 1.4))
    box_w, box_h = 1.45, 0.62

    def xy(node_id: int | None) -> tuple[float, float]:
        if node_id is None:
            ys = [ypos[r] for r in roots] or [0.0]
            return 0.0, sum(ys) / len(ys)
        return 1.9 * nodes[node_id].depth, ypos[node_id]

    ax.add_patch(FancyBboxPatch((-0.25, xy(None)[1] - 0.2), 0.5, 0.4,
                                boxstyle="round,pad=0.02", facecolor="white", edgecolor=INK,
                                gid="node-root"))
    ax.text(0, xy(None)[1], "root", ha="center", va="center", fontsize=8)
    for n in tree.nodes:
        x, y = xy(n.node_id)
        px, py = xy(n.parent_id)
        hot = n.block in highlight
        start_x = px + (0.25 if n.parent_id is None else box_w / 2)
        ax.plot([start_x, x - box_w / 2], [py, y], color=INK if hot else MUTED,
                linewidth=2.6 if hot else 0.9, zorder=1)
        state = "shared" if n.lock_ref > 0 else "cached"
        ax.add_patch(FancyBboxPatch((x - box_w / 2, y - box_h / 2), box_w, box_h,
                                    boxstyle="round,pad=0.02",
                                    facecolor=BLOCK_STATE_COLORS[state],
                                    edgecolor=INK, linewidth=2.6 if hot else 0.6, zorder=2,
                                    gid=f"node-{n.block}"))
        lock = f" lock={n.lock_ref}" if n.lock_ref else ""
        ax.text(x, y + 0.1, _chunk_label(n.chunk, max_tokens), ha="center", va="center",
                fontsize=7.5, zorder=3)
        ax.text(x, y - 0.17, f"#{n.block}{lock}", ha="center", va="center", fontsize=7,
                color=INK, zorder=3, fontweight="bold" if hot else "normal")
    ax.set_xlim(-0.6, 1.9 * depth + box_w / 2 + 0.3)
    ax.set_ylim(-rows + 0.35, 0.75)
    ax.axis("off")
    handles = [Patch(facecolor=BLOCK_STATE_COLORS["shared"], edgecolor=INK,
                     label="locked (in use)"),
               Patch(facecolor=BLOCK_STATE_COLORS["cached"], edgecolor=INK,
                     label="unlocked (evictable)"),
               Patch(facecolor="white", edgecolor=INK, linewidth=2.6, label="hit path")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8)
    ax.set_title(title or f"radix tree: {len(tree.nodes)} cached blocks of "
                          f"{tree.block_size} tokens", fontsize=10)
    fig.tight_layout()
    return fig


def hit_rate_figure(results: Mapping[str, Mapping[str, float]], *, title: str | None = None):
    """Bars of prefill tokens computed per workload, with and without prefix caching.

    ``results[workload] = {"computed_off": ..., "computed_on": ..., "hit_rate": ...}``.
    """
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    xs = range(len(names))
    off = [results[n]["computed_off"] for n in names]
    on = [results[n]["computed_on"] for n in names]
    ax.bar([x - 0.2 for x in xs], off, width=0.4, color=MUTED, label="no prefix cache")
    ax.bar([x + 0.2 for x in xs], on, width=0.4, color=BLOCK_STATE_COLORS["cached"],
           label="radix prefix cache")
    for x, n in zip(xs, names, strict=True):
        ax.text(x + 0.2, on[x], f"hit {results[n]['hit_rate']:.0%}", ha="center",
                va="bottom", fontsize=9)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("prefill tokens computed")
    ax.legend()
    ax.set_title(title or "prefill work with and without prefix reuse")
    fig.tight_layout()
    return fig


class RadixView:
    """Pick a lookup from a dropdown and see its hit path; drawing is :func:`radix_figure`.

    ``lookups`` maps a label to ``(matched_tokens, blocks)`` for queries against ``tree``
    (e.g. from ``RadixCache.match``). Plain data only: the view never touches a cache.
    """

    def __init__(self, tree: RadixSnapshot, lookups: Mapping[str, tuple[int, tuple]]):
        if not lookups:
            raise ValueError("RadixView needs at least one lookup")
        self.tree = tree
        self.lookups = dict(lookups)
        self.start = next(iter(self.lookups))

    def figure(self, label: str | None = None):
        label = self.start if label is None else label
        tokens, blocks = self.lookups[label]
        return radix_figure(self.tree, highlight=blocks,
                            title=f"{label}: {tokens} cached tokens in {len(blocks)} blocks")

    def widget(self):
        """A dropdown of the lookups above :meth:`figure` of the chosen one."""
        import ipywidgets as w

        pick = w.Dropdown(options=list(self.lookups), value=self.start, description="lookup")
        return figure_widget({"label": pick}, self.figure,
                             what="radix tree view (pick a lookup to see its hit path)",
                             kernel_free=self.kernel_free)

    def kernel_free(self):
        """Every lookup precomputed, switched by a plain dropdown."""
        from kvlab.viz.kernel_free import dropdown, static_widget

        return static_widget(self.figure, {"label": dropdown(self.lookups, label="lookup")},
                             default={"label": self.start}, title="radix tree lookups")
