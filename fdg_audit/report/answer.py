"""The answer figure and the truth / reconstruction strips of page one (issue 46, item 3), from the results model.

``answer_figure``: one panel per data-set family kind (e.g. rotated: rotated_small's fixed client sizes and rotated's
whole-domain clients on one axis), re-identification against the client's size, one line per method (its colour,
``plots.colors``, the same in every figure) and channel (line style: the reference method's channel solid, others
dashed, never a colour), 95% intervals over runs (the scorecard's cells: the same numbers, unit and rule), chance
or the free guess as a grey band, and a cross at the bottom where a method's channel was not attacked at that size.
Beside them, held-out accuracy per family and method with the chance line. ``strips``: per channel, 4 of the
victim's images over their reconstructions, from the method whose cell of that channel is highest.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..attack import ORACLE
from . import threat as TH
from .formatting import colors, legend_label, method_words, slug, words
from .model import WHOLE, Cell, Model
from .plots import _fig, _save, _show

STYLES = ("-", "--", ":", "-.")


def line_styles(channels: list, ref: list) -> dict:
    """{channel: line style} over a panel: the reference method's channels first (solid first), then the others by
    name, so two channels never share a style, even where the reference itself sends both (a Flower app's one
    strategy sent its bank and its weights as two solid lines of one colour)."""
    order = sorted({c for cs in channels for c in cs}, key=lambda c: (c not in ref, c))
    return {c: STYLES[i % len(STYLES)] for i, c in enumerate(order)}


def _point(m: Model, kin: list, x: int, ch: str) -> Cell | None:
    """A method's point of channel ``ch`` at size ``x``, None where it was not attacked: of its cells of that channel
    (the channel's own cell first, else a cell over every channel that chose it, or one outside DP), against any
    adversary, a measured one first, then by ``Cell.rank`` (``Model.main``'s rule). A cell that is not measurable is
    neither drawn nor crossed out as not attacked."""
    cs = [c for c in m.cells if c.group in kin and c.harm == "reconstruction" and (c.size or WHOLE) == x
          and (c.channel == ch or (not c.channel and c.artifact == ch))]
    return min(cs, key=lambda c: (not c.measurable, not c.channel, *c.rank), default=None)


def _panel(ax, m: Model, kind: str, col: dict) -> bool:
    dss = [ds for ds in m.families() if m.kind(ds) == kind]
    sizes = sorted({c.size or WHOLE for c in m.cells if c.group[0] in dss and c.harm == "reconstruction"})
    if not sizes:
        return False
    xs = {n: i for i, n in enumerate(sizes)}
    ref = [g for g in m.groups() if g[1] == m.reference]
    ref_ch = m.channels(ref[0]) if ref else []
    lines = list(dict.fromkeys(g[1:] for g in m.groups() if g[0] in dss))
    style = line_styles([m.channels(g) for g in m.groups() if g[0] in dss], ref_ch)
    width = min(0.5, 0.1 * len(lines)) / max(1, len(lines) - 1)   # methods side by side at one size
    band, seen = (0.25 if len(lines) == 1 else width / 2), set()
    for i, key in enumerate(lines):
        kin = [h for h in m.groups() if h[0] in dss and h[1:] == key]
        g, dx = kin[0], (i - (len(lines) - 1) / 2) * width
        for ch in m.channels(g):
            at = {n: _point(m, kin, n, ch) for n in sizes}
            pts = [(xs[n] + dx, c) for n, c in at.items() if c and c.measurable]
            missing = [xs[n] + dx for n, c in at.items() if c is None]
            if pts:
                x = [p[0] for p in pts]
                y = np.array([p[1].value for p in pts])
                err = [[max(0, p[1].value - p[1].lo) if p[1].lo == p[1].lo else 0 for p in pts],
                       [max(0, p[1].hi - p[1].value) if p[1].hi == p[1].hi else 0 for p in pts]]
                ax.errorbar(x, y, yerr=err, color=col[g], ls=style[ch], marker="o", ms=5, capsize=3, lw=1.8,
                            label=f"{method_words(g)}, {words(ch)}")
                for xx, c in pts:
                    ax.fill_between([xx - band, xx + band], c.b_lo if c.b_lo == c.b_lo else c.baseline,
                                    c.b_hi if c.b_hi == c.b_hi else c.baseline, color="0.6", alpha=0.35, lw=0)
            if missing:
                ax.plot(missing, [0.02] * len(missing), "x", color=col[g], ms=9, mew=2,
                        label="not attacked" if "na" not in seen else None)
                seen.add("na")
    split = max([(r.get("data") or {}).get("clients_per_domain") or 1 for r in m.res.runs if r.get("dataset") in dss]
                or [1])   # the runs' own clients: a domain split among several is not a whole domain
    whole = f"1/{split} of\na domain" if split > 1 else "whole\ndomain"
    ax.set_xticks(list(xs.values()), [whole if n == WHOLE else str(n) for n in xs])
    ax.set_xlabel("client size (training images)", fontsize=11)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{words(kind)}: re-identification", fontsize=13)
    ax.grid(alpha=0.3)
    return True


def _accuracy(ax, m: Model, col: dict) -> None:
    dss = [ds for ds in m.families() if not m.sized(ds)] or m.families()
    width = 0.8 / max(1, len({g[1:] for g in m.groups()}))
    methods = list(dict.fromkeys(g[1:] for g in m.groups()))
    for i, ds in enumerate(dss):
        for g in m.groups(ds):
            c = m.main(g, "accuracy")
            if c is None:
                continue
            x = i + (methods.index(g[1:]) - (len(methods) - 1) / 2) * width
            ax.errorbar([x], [c.value], yerr=[[c.value - c.lo], [c.hi - c.value]] if c.lo == c.lo else None,
                        fmt="o", color=col[g], capsize=3, ms=6, label=method_words(g))
            ax.plot([i - 0.4, i + 0.4], [c.baseline] * 2, ls=":", color="0.3", lw=1.5)
    ax.set_xticks(range(len(dss)), [words(d) for d in dss])
    ax.set_ylim(0, 1)
    ax.set_title("held-out accuracy (dotted: chance)", fontsize=13)
    ax.grid(alpha=0.3, axis="y")


def answer_figure(m: Model, out: Path) -> str | None:
    """plots/answer.png (module doc); without a reconstruction cell, the accuracy panel alone (and its title says
    that no reconstruction attack ran); None without accuracy either."""
    kinds = list(dict.fromkeys(m.kind(ds) for ds in m.families() if any(
        c.harm == "reconstruction" and c.group[0] == ds for c in m.cells)))
    if not kinds and not any(c.harm == "accuracy" for c in m.cells):
        return None
    col = colors(m.res)
    fig = _fig(4.2 * len(kinds) + 3.6 if kinds else 6.4, 4.4)
    axes = list(np.atleast_1d(fig.subplots(1, len(kinds) + 1, width_ratios=[4.2] * len(kinds) + [3.0])))
    for ax, k in zip(axes[:-1], kinds):
        _panel(ax, m, k, col)
    if kinds:
        axes[0].set_ylabel("re-identified (95% CI over runs;\none run: over its images)", fontsize=11)
    _accuracy(axes[-1], m, col)
    if not kinds:
        axes[-1].set_title("held-out accuracy (dotted: chance)\nno reconstruction attack ran", fontsize=12)
    handles = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    for lab in [x for x in handles if any(y.startswith(x + ", ") for y in handles)]:
        del handles[lab]   # a method's accuracy point: its colour is already named by its lines
    if handles:
        fig.legend(list(handles.values()), [legend_label(x) for x in handles], fontsize=10, loc="outside lower center",
                   ncol=min(4, len(handles)), frameon=False)
    return _save(fig, out, "answer.png")


def strips(m: Model, out: Path, n: int = 4) -> list[str]:
    """Per channel, one PNG of ``n`` truth images over their reconstructions (module doc)."""
    files, gof = [], m.res.group_of()
    best = {}
    for c in m.cells:
        if c.harm == "reconstruction" and c.measurable and c.attack and "|" not in c.artifact:
            if c.artifact not in best or c.value > best[c.artifact].value:
                best[c.artifact] = c
    for ch, c in best.items():
        desc = m.res.attacks.get(c.attack.split("|")[0], {})
        ex = sorted((r for r in m.res.recon if r["attack"] == c.attack.split("|")[0] and gof.get(r["run"]) == c.group
                     and TH.prior(desc, r["variant"] or "") != ORACLE), key=lambda r: (r["run"], r["victim"]))
        if not ex:
            continue
        with np.load(ex[0]["path"]) as z:
            truth, rec = z["truth"][:n], z["recon"][:n]
        fig = _fig(1.1 * len(truth) + 0.4, 2.6)
        axes = fig.subplots(2, len(truth), squeeze=False)
        for j in range(len(truth)):
            _show(axes[0, j], truth[j])
            _show(axes[1, j], rec[j])
        fig.suptitle(f"{method_words(c.group)}, {words(ch)}", fontsize=11)
        files.append(_save(fig, out, f"strip_{slug(ch)}.png"))
    return files
