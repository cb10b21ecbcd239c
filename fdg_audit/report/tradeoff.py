"""The trade-off figure (issue 33, item 2): per dataset family, held-out accuracy against the strongest leakage of
each harm, one point per method in its fixed colour (``plots.colors``), labelled with the channel that leaks."""
from __future__ import annotations

from pathlib import Path

from ..metrics.registry import info
from . import tables as T
from .curves import HEADLINE, smallest_point
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


def _smallest(curve: list[dict], g: tuple) -> dict | None:
    """``curves.smallest_point`` as a scorecard-like row (value, interval, baseline, channel)."""
    c = smallest_point(curve, g)
    if c is None:
        return None
    v, b = c["value"], c["baseline"]
    return dict(value=v["mean"], ci_low=v["lo"], ci_high=v["hi"], baseline=b["mean"], artifact=c["artifact"],
                adversary="server", metric=HEADLINE, size=c["size"])


def tradeoff(res: T.Results, card: list[dict], out: Path, curve: list[dict] = ()) -> list[tuple[str, str]]:
    """One figure per dataset family (issue 33, item 2): one panel per harm (reconstruction, membership), one point per
    method: y = held-out accuracy, x = the harm's scorecard cell (the strongest attack over every channel the method
    sends; of the adversaries' cells the one beyond its baseline by most, as on page one), 95% Student-t intervals
    both ways (scorecard.csv), the point labelled with its channel, its baseline marked. Where the family's clients
    have fixed sizes (``curve``), reconstruction is the smallest size's point. A panel needs two methods with a
    number and a figure a panel (one point shows no trade-off). Returns (dataset, file) pairs."""
    from .pageone import _main
    files, col = [], colors(res)
    for ds in dict.fromkeys(g[0] for g in res.groups()):
        gs = [g for g in res.groups() if g[0] == ds and _main(card, *g, "accuracy")]
        cell = lambda g, h: (_smallest(curve, g) if h == "reconstruction" else None) or _main(card, *g, h)  # noqa
        has = lambda r: r is not None and num(r["value"]) == num(r["value"])  # noqa: E731
        harms = [h for h in TRADE_HARMS if sum(has(cell(g, h)) for g in gs) >= 2]
        if len(gs) < 2 or not harms:
            continue
        fig = _fig(4.6 * len(harms) + 1.6, 3.9)
        axes = fig.subplots(1, len(harms), sharey=True, squeeze=False)[0]
        for ax, harm in zip(axes, harms):
            metric = ""
            sizes = set()
            for g in gs:
                r = cell(g, harm)
                if not has(r):
                    continue
                sizes.add(r.get("size"))
                metric = metric or r["metric"].split("|")[0]
                _point(ax, r, _main(card, *g, "accuracy"), col[g], res.label(g))
            mi = info(metric) if metric else None
            ax.set_xlabel(f"{harm}: {mi.label if mi else '—'}{f' ({mi.unit})' if mi and mi.unit else ''}  "
                          + ("→ more leakage" if not mi or mi.higher else "← more leakage"), fontsize=9)
            at = "" if sizes == {None} else f", clients of {min(x for x in sizes if x)} image(s)"
            ax.set_title(f"{harm} (strongest attack over every channel{at})", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("held-out accuracy (mean over runs)")
        n = sorted({int(num(_main(card, *g, "accuracy")["n_runs"])) for g in gs})
        over = "runs" if not curve or not any(c["key"] in gs for c in curve) else "runs (x at a client size: victims)"
        fig.suptitle(f"{ds}: held-out accuracy against leakage, one point per method (label: the leaking channel); "
                     f"bars: 95% Student-t intervals over {n[0]}{f'–{n[-1]}' if len(n) > 1 else ''} {over}",
                     fontsize=9)
        handles = {}
        for ax in axes:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
        fig.legend(list(handles.values()), list(handles), fontsize=8, loc="outside lower center",
                   ncol=min(4, len(handles)), frameon=False)
        files.append((ds, _save(fig, out, f"tradeoff_{slug(ds)}.png")))
    return files
