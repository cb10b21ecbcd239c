"""The trade-off figure (issue 33, item 2): per dataset family, held-out accuracy against the strongest leakage of
each harm, one point per method in its fixed colour (``plots.colors``), labelled with the channel that leaks."""
from __future__ import annotations

from pathlib import Path

from ..metrics.registry import info
from . import tables as T
from .formatting import num, slug
from .plots import _fig, _save, colors


TRADE_HARMS = ("reconstruction", "membership")


def _point(ax, r: dict, a: dict, color, label: str) -> None:
    """One method in a trade-off panel: its cell's value (x) against held-out accuracy (y), 95% intervals both ways,
    labelled with the channel, and the cell's baseline as a grey bar on the same row."""
    x, y = num(r["value"]), num(a["value"])
    err = lambda v, lo, hi: [[0 if lo != lo else max(0.0, v - lo)], [0 if hi != hi else max(0.0, hi - v)]]  # noqa
    ax.errorbar(x, y, xerr=err(x, num(r["ci_low"]), num(r["ci_high"])),
                yerr=err(y, num(a["ci_low"]), num(a["ci_high"])), fmt="o", ms=7, color=color, capsize=3, label=label)
    ax.annotate(r["artifact"] + (f" ({r['adversary']})" if r["adversary"] != "server" else ""), (x, y),
                xytext=(6, 6), textcoords="offset points", fontsize=8, color=color)
    b = num(r["baseline"])
    if b == b:
        ax.plot([b], [y], "|", color="0.45", ms=16, mew=2.5, label="the cell's trivial baseline")


def tradeoff(res: T.Results, card: list[dict], out: Path) -> list[tuple[str, str]]:
    """One figure per dataset family (issue 33, item 2): one panel per harm (reconstruction, membership), one point per
    method: y = held-out accuracy, x = the harm's scorecard cell (the strongest attack over every channel the method
    sends; of the adversaries' cells the one beyond its baseline by most, as on page one), 95% Student-t intervals
    both ways (scorecard.csv), the point labelled with its channel, its baseline marked. A family with fewer than two methods gets no figure (one
    point shows no trade-off). Returns (dataset, file) pairs."""
    from .pageone import _main
    files, col = [], colors(res)
    for ds in dict.fromkeys(g[0] for g in res.groups()):
        gs = [g for g in res.groups() if g[0] == ds and _main(card, *g, "accuracy")]
        harms = [h for h in TRADE_HARMS if any(_main(card, *g, h) for g in gs)]
        if len(gs) < 2 or not harms:
            continue
        fig = _fig(4.6 * len(harms) + 1.6, 3.9)
        axes = fig.subplots(1, len(harms), sharey=True, squeeze=False)[0]
        for ax, harm in zip(axes, harms):
            metric = ""
            for g in gs:
                r = _main(card, *g, harm)
                if r is None or num(r["value"]) != num(r["value"]):
                    continue
                metric = metric or r["metric"].split("|")[0]
                _point(ax, r, _main(card, *g, "accuracy"), col[g], res.label(g))
            mi = info(metric) if metric else None
            ax.set_xlabel(f"{harm}: {mi.label if mi else '—'}{f' ({mi.unit})' if mi and mi.unit else ''}  "
                          + ("→ more leakage" if not mi or mi.higher else "← more leakage"), fontsize=9)
            ax.set_title(f"{harm} (strongest attack over every channel)", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("held-out accuracy (mean over runs)")
        n = sorted({int(num(_main(card, *g, "accuracy")["n_runs"])) for g in gs})
        fig.suptitle(f"{ds}: held-out accuracy against leakage, one point per method (label: the leaking channel); "
                     f"bars: 95% Student-t intervals over {n[0]}{f'–{n[-1]}' if len(n) > 1 else ''} runs",
                     fontsize=9)
        handles = {}
        for ax in axes:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
        fig.legend(list(handles.values()), list(handles), fontsize=8, loc="outside lower center",
                   ncol=min(4, len(handles)), frameon=False)
        files.append((ds, _save(fig, out, f"tradeoff_{slug(ds)}.png")))
    return files
