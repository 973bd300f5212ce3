"""Chapter 4 figures: the radix prefix tree with a hit path highlighted, and hit-rate bars.

* :func:`radix_figure` — pure: a :class:`~kvlab.labs.kv_snapshot.RadixSnapshot` (a scope's tree)
  in, a Figure out. One row per cached block, indented by its depth (a file-tree layout, so a
  deep tree grows downwards and fits a phone's width): its tokens (or words) and physical block
  id; locked nodes (in use by a request) are drawn as *shared*, unlocked ones as *cached,
  evictable*; the blocks in ``highlight`` (a lookup's hit path) get a thick outline and edges.
* :func:`hit_rate_figure` — bars of prefill tokens computed with and without prefix caching.
* :class:`RadixView` — serve prompts of the reader's choosing into a prefix cache and look one
  up; the tree, the hit path and the lookup block by block. Its kernel-free twin precomputes
  every choice over a control grid.

Patches carry a ``gid`` (``"node-<block>"``) so tests can find them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvlab.labs.kv_snapshot import RadixSnapshot
from kvlab.viz._widgets import figure_widget
from kvlab.viz.style import BLOCK_STATE_COLORS, INK, MUTED

#: Figure geometry of :func:`radix_figure`, in inches (the axes span the figure 1:1).
_INDENT, _ROW, _BOX_H, _TEXT_PT = 0.24, 0.36, 0.27, 8.5


def _token_text(token: int, words: Callable[[int], str] | None) -> str:
    return str(token) if words is None else words(token)


def _chunk_label(chunk: Sequence[int], max_tokens: int,
                 words: Callable[[int], str] | None = None) -> str:
    shown = " ".join(_token_text(t, words) for t in chunk[:max_tokens])
    return shown + (" …" if len(chunk) > max_tokens else "")


def radix_figure(tree: RadixSnapshot, highlight: Iterable[int] = (), *,
                 max_tokens: int = 4, title: str | None = None,
                 words: Callable[[int], str] | None = None, width: float = 3.9):
    """Draw ``tree`` with the nodes whose block is in ``highlight`` emphasised.

    One row per node in depth-first order, indented by depth under ``root``, joined to its
    parent by an elbow. Node text: the block's first ``max_tokens`` tokens (``words(token)``
    when given, else the id), and ``#<block>`` with the lock count when locked. Node colour:
    ``shared`` when locked, ``cached`` when evictable. ``width`` is the figure's width in
    inches (the default fits a 390 px phone at legible text size).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    highlight = set(highlight)
    rows = {n.node_id: i + 1 for i, n in enumerate(tree.nodes)}   # row 0 is the root
    title_lines = (title or f"radix tree: {len(tree.nodes)} cached blocks of "
                            f"{tree.block_size} tokens").count("\n") + 1
    top = 0.22 + 0.19 * title_lines                     # inches above the root row
    legend = 0.42
    height = top + _ROW * (len(tree.nodes) + 1) + legend
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")

    def y_of(row: int) -> float:
        return height - top - _ROW * row - _ROW / 2

    x0 = 0.12
    ax.add_patch(FancyBboxPatch((x0, y_of(0) - _BOX_H / 2), 0.5, _BOX_H,
                                boxstyle="round,pad=0.02", facecolor="white", edgecolor=INK,
                                gid="node-root"))
    ax.text(x0 + 0.25, y_of(0), "root", ha="center", va="center", fontsize=_TEXT_PT)
    depth_of = {n.node_id: n.depth for n in tree.nodes}
    for n in tree.nodes:
        hot = n.block in highlight
        x, y = x0 + _INDENT * n.depth, y_of(rows[n.node_id])
        parent_row = 0 if n.parent_id is None else rows[n.parent_id]
        parent_depth = 0 if n.parent_id is None else depth_of[n.parent_id]
        stem = x0 + _INDENT * parent_depth + 0.1
        ax.plot([stem, stem, x], [y_of(parent_row) - _BOX_H / 2, y, y],
                color=INK if hot else MUTED, linewidth=2.4 if hot else 0.9, zorder=1,
                solid_capstyle="butt")
        state = "shared" if n.lock_ref > 0 else "cached"
        box_w = width - 0.1 - x
        ax.add_patch(FancyBboxPatch((x, y - _BOX_H / 2), box_w, _BOX_H,
                                    boxstyle="round,pad=0.02",
                                    facecolor=BLOCK_STATE_COLORS[state],
                                    edgecolor=INK, linewidth=2.4 if hot else 0.6, zorder=2,
                                    gid=f"node-{n.block}"))
        lock = f" lock {n.lock_ref}" if n.lock_ref else ""
        weight = "bold" if hot else "normal"
        ax.text(x + 0.07, y, _chunk_label(n.chunk, max_tokens, words), ha="left",
                va="center", fontsize=_TEXT_PT, zorder=3, fontweight=weight)
        ax.text(x + box_w - 0.06, y, f"#{n.block}{lock}", ha="right", va="center",
                fontsize=_TEXT_PT, color=INK, zorder=3, fontweight=weight)
    handles = [Patch(facecolor=BLOCK_STATE_COLORS["shared"], edgecolor=INK, label="locked"),
               Patch(facecolor=BLOCK_STATE_COLORS["cached"], edgecolor=INK, label="evictable"),
               Patch(facecolor="white", edgecolor=INK, linewidth=2.4, label="hit path")]
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.02), ncol=3,
              fontsize=_TEXT_PT, frameon=False, handlelength=1.2, columnspacing=0.9)
    # a suptitle, not axes text: it is what the figure's alt text is made from
    fig.suptitle(title or f"radix tree: {len(tree.nodes)} cached blocks of "
                          f"{tree.block_size} tokens",
                 x=0.12 / width, y=1 - 0.12 / height, ha="left", va="top", fontsize=9,
                 fontweight="bold", color=INK)
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


@dataclass(frozen=True)
class RadixLookup:
    """One lookup, as :class:`RadixView` draws it: the tree of the query's scope, the query's
    token ids, and the hit (``num_tokens`` cached tokens in ``blocks``, as ``match`` gives)."""

    tree: RadixSnapshot
    query: tuple[int, ...]
    num_tokens: int
    blocks: tuple[int, ...]


def describe_lookup(lookup: RadixLookup, words: Callable[[int], str] | None = None,
                    max_tokens: int = 4) -> str:
    """The lookup block by block, one short line each: which full blocks of the query hit,
    where the walk stopped, and what is never served (a partial block, the last token)."""
    bs = lookup.tree.block_size
    q = lookup.query
    full, hit = len(q) // bs, len(lookup.blocks)
    lines = [f"{lookup.num_tokens} of {len(q)} tokens cached"]
    for i in range(full):
        text = _chunk_label(q[i * bs:(i + 1) * bs], max_tokens, words)
        if i < hit:
            lines.append(f"  hit   {text}")
        elif i == full - 1 and len(q) % bs == 0:
            lines.append(f"  last  {text}")
            lines.append("        (its last token: always computed)")
        elif i == hit:
            lines.append(f"  miss  {text}")
        else:
            lines.append(f"  -     {text}")
    if len(q) % bs:
        lines.append(f"  + {len(q) % bs} token{'s' * (len(q) % bs != 1)} in a partial block")
    return "\n".join(lines)


class RadixView:
    """Serve prompts into a prefix cache, then look one up: the tree of the lookup's scope with
    its hit path, and the lookup block by block.

    ``prompts`` maps a name to ``(scope, token ids)``: the prompts a reader can look up.
    ``servable`` names those that can be served first (each one on or off, served in the order
    listed). ``explore(served, query)`` does the work on a real cache and returns a
    :class:`RadixLookup`: ``served`` a tuple of ``(scope, token ids)``, ``query`` one of them.
    The view holds no cache: plain data in, figures out. ``tokenize(text)`` (optional) turns
    typed words into token ids, for a prompt of the reader's own in the live widget; ``words``
    turns a token id back into the text drawn.
    """

    def __init__(self, explore: Callable[[tuple, tuple], RadixLookup],
                 prompts: Mapping[str, tuple], servable: Sequence[str], *,
                 words: Callable[[int], str] | None = None,
                 tokenize: Callable[[str], tuple[int, ...]] | None = None,
                 served: Sequence[str] = (), lookup: str | None = None) -> None:
        if not prompts:
            raise ValueError("RadixView needs at least one prompt to look up")
        unknown = [n for n in (*servable, *served) if n not in prompts]
        if unknown or not set(served) <= set(servable):
            raise ValueError(f"servable and served must name prompts; unknown: {unknown}")
        if lookup is not None and lookup not in prompts:
            raise ValueError(f"lookup {lookup!r} is not one of the prompts")
        self.explore, self.prompts = explore, dict(prompts)
        self.servable, self.words, self.tokenize = list(servable), words, tokenize
        self.served = tuple(served)
        self.lookup = next(iter(self.prompts)) if lookup is None else lookup

    def _run(self, served: Sequence[str], lookup: str, typed: tuple = ()) -> RadixLookup:
        chosen = tuple(self.prompts[n] for n in self.servable if n in served) + typed
        return self.explore(chosen, self.prompts[lookup])

    def figure(self, served: Sequence[str] | None = None, lookup: str | None = None):
        """The tree after serving ``served`` (default: the view's), with ``lookup``'s hit."""
        served = self.served if served is None else served
        lookup = self.lookup if lookup is None else lookup
        served = [n for n in self.servable if n in served]
        return self._figure(self._run(served, lookup), served, lookup)

    def _figure(self, found: RadixLookup, served: Sequence[str], lookup: str):
        names = ", ".join(served) or "nothing"
        title = f"served: {names}\nlook up {lookup}: {found.num_tokens} of " \
                f"{len(found.query)} cached"
        return radix_figure(found.tree, highlight=found.blocks, title=title, words=self.words)

    def caption(self, served: Sequence[str] | None = None, lookup: str | None = None) -> str:
        served = self.served if served is None else served
        lookup = self.lookup if lookup is None else lookup
        return describe_lookup(self._run(served, lookup), self.words)

    def widget(self):
        """A checkbox per servable prompt, a text box to serve a prompt of your own, and a
        dropdown of lookups, above the figure and the lookup block by block."""
        import ipywidgets as w

        controls = {f"serve_{i}": w.Checkbox(value=name in self.served, description=name,
                                              indent=False)
                    for i, name in enumerate(self.servable)}
        if self.tokenize is not None:
            controls["typed"] = w.Text(value="", description="serve also",
                                       placeholder="words of your own prompt")
        controls["lookup"] = w.Dropdown(options=list(self.prompts), value=self.lookup,
                                        description="look up")

        def state(**values):
            served = [n for i, n in enumerate(self.servable) if values[f"serve_{i}"]]
            text = values.get("typed", "").strip()
            typed = ()
            if text and self.tokenize is not None:
                scope = self.prompts[self.servable[0] if self.servable else self.lookup][0]
                typed = ((scope, tuple(self.tokenize(text))),)
            found = self._run(served, values["lookup"], typed)
            return served + ["your prompt"] * bool(typed), found

        def draw(**values):
            served, found = state(**values)
            return self._figure(found, served, values["lookup"])

        return figure_widget(controls, draw,
                             caption=lambda **values: describe_lookup(state(**values)[1],
                                                                      self.words),
                             what="radix tree explorer (serve prompts, look one up)",
                             kernel_free=self.kernel_free)

    def kernel_free(self):
        """Every choice precomputed: each servable prompt served or not, every lookup."""
        from kvlab.viz.kernel_free import dropdown, static_widget

        controls = {f"serve_{i}": dropdown((False, True), labels=("no", "yes"),
                                           label=f"serve {name}")
                    for i, name in enumerate(self.servable)}
        controls["lookup"] = dropdown(list(self.prompts), label="look up")

        def chosen(values):
            return [n for i, n in enumerate(self.servable) if values[f"serve_{i}"]]

        default = {f"serve_{i}": name in self.served for i, name in enumerate(self.servable)}
        return static_widget(lambda **v: self.figure(chosen(v), v["lookup"]), controls,
                             default={**default, "lookup": self.lookup},
                             caption=lambda **v: self.caption(chosen(v), v["lookup"]),
                             title="radix tree explorer")
