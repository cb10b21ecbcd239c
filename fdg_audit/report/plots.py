"""The report's figures (matplotlib, Agg, no pyplot state). Each function writes PNGs into ``out`` and returns
their file names; every figure states its units, the number of seeds and what the baseline is."""
from __future__ import annotations

import io
import math
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.stats import t as t_dist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .. import metrics as M
from ..metrics.registry import info
from ..store.ledger import load_npz
from ..store.runfolder import victim_tag
from ..store.safe import write_in
from . import tables as T
from .curves import domain_of
from .formatting import ARROW, colors, human_bytes, legend_label, slug

DPI = 110


def _fig(w, h):
    fig = Figure(figsize=(w, h), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, out: Path, name: str) -> str:
    """Write the figure as ``out/name`` inside the report folder (fdg_audit.store.safe); the name written."""
    buf = io.BytesIO()
    with warnings.catch_warnings():     # tall grids of tiny panels: matplotlib falls back to its default layout
        warnings.filterwarnings("ignore", message="constrained_layout not applied")
        fig.savefig(buf, bbox_inches="tight", format="png")
    return write_in(out.parent, out / name, buf.getvalue()).name


def line_styles(res: T.Results) -> dict:
    """{group: line style}: one per dataset (solid, dashed, dotted, dash-dot, in the order the datasets first
    appear), so that one method's curves on two datasets, which share its colour, stay apart."""
    datasets = list(dict.fromkeys(g[0] for g in res.groups()))
    return {g: ("-", "--", ":", "-.")[datasets.index(g[0]) % 4] for g in res.groups()}


def _legend(ax, **kw):
    """A legend with each label once (repeated artists of one method draw one entry), each cut (``legend_label``)."""
    h, labels = ax.get_legend_handles_labels()
    keep = dict(zip(labels, h))
    if keep:
        ax.legend(list(keep.values()), [legend_label(x) for x in keep], **kw)


def _seeds(rows) -> str:
    n = sorted({len(r["seeds"]) for r in rows})
    return f"{n[0]} seed{'s' * (n[0] != 1)}" if len(n) == 1 else f"{n[0]}–{n[-1]} seeds"


def accuracy(res: T.Results, acc: list[dict], out: Path) -> list[str]:
    """Grouped bars per dataset: held-out accuracy per target and mean over targets, 95% Student-t intervals over
    seeds (the scorecard's)."""
    files, col = [], colors(res)
    for ds in dict.fromkeys(r["dataset"] for r in acc):
        rows = [r for r in acc if r["dataset"] == ds]
        targets = list(dict.fromkeys(t for r in rows for t in r["targets"]))
        xs = targets + ["mean over targets"] * (len(targets) > 1)   # one target: its bar is the mean
        width = 0.8 / len(rows)
        fig = _fig(max(6.0, 1.5 + len(xs) * (0.45 + 0.22 * len(rows))), 4.2)
        ax = fig.subplots()
        for i, r in enumerate(rows):
            cells = [r["targets"].get(t, T.stat([])) for t in targets] + [r["mean"]] * (len(targets) > 1)
            x = np.arange(len(xs)) + (i - (len(rows) - 1) / 2) * width
            err = [0 if math.isnan(c["std"]) or c["n"] < 2 else   # the 95% Student-t half-width, as the scorecard
                   float(t_dist.ppf(0.975, c["n"] - 1)) * c["std"] / math.sqrt(c["n"]) for c in cells]
            ax.bar(x, [c["mean"] for c in cells], width, color=col[r["key"]], label=res.label(r["key"]),
                   yerr=err if any(err) else None, capsize=2, error_kw=dict(lw=0.8))
        k = {r["num_classes"] for r in rows if r.get("num_classes")}
        if len(k) == 1:
            k = k.pop()
            ax.axhline(1 / k, color="k", ls="--", lw=1, label=f"chance (1/{k} classes)")
        ax.set_xticks(range(len(xs)), xs, rotation=20 if len(xs) > 4 else 0, ha="right" if len(xs) > 4 else "center")
        ax.set_ylim(0, 1)
        ax.set_ylabel("held-out-domain accuracy (fraction correct)")
        ax.set_xlabel("held-out (target) domain")
        one = all(len(r["seeds"]) == 1 for r in rows)
        ax.set_title(f"{ds}: accuracy on the unseen domain at the round chosen on source validation\n"
                     + ("1 seed (no error bars)" if one else f"bars: mean over {_seeds(rows)}, error bars: 95% "
                        "Student-t intervals"), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        _legend(ax, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
        files.append(_save(fig, out, f"accuracy_{slug(ds)}.png"))
    return files


def sweep(res: T.Results, acc: list[dict], out: Path) -> list[str]:
    """Mean-over-targets accuracy against each numeric sweep parameter, one line per method (and the
    values of the other sweep parameters)."""
    files, keys = [], T.sweep_keys(res)
    for ds in dict.fromkeys(r["dataset"] for r in acc):
        rows = [r for r in acc if r["dataset"] == ds]
        for key in keys:
            vals = {r["sweep"].get(key) for r in rows}
            if len(vals) < 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
                continue
            lines = defaultdict(list)
            for r in rows:
                rest = ",".join(f"{k.split('.')[-1]}={v}" for k, v in r["sweep"].items() if k != key)
                lines[r["method"] + (f" [{rest}]" if rest else "")].append(r)
            fig = _fig(6.4, 4.0)
            ax = fig.subplots()
            col = colors(res)
            for name, rs in lines.items():
                rs = sorted(rs, key=lambda r: r["sweep"][key])
                ax.errorbar([r["sweep"][key] for r in rs], [r["mean"]["mean"] for r in rs], marker="o", capsize=3,
                            yerr=[0 if math.isnan(r["mean"]["std"]) else r["mean"]["std"] for r in rs], label=name,
                            color=col[rs[0]["key"]] if len(lines) == len({r["method"] for r in rows}) else None)
            pos = [v for v in vals if v > 0]
            if len(pos) == len(vals) and max(pos) / min(pos) >= 100:
                ax.set_xscale("log")
            k = {r["num_classes"] for r in rows if r.get("num_classes")}
            if len(k) == 1:
                ax.axhline(1 / k.pop(), color="k", ls="--", lw=1, label="chance (1/classes)")
            ax.set_xlabel(f"sweep parameter {key}")
            ax.set_ylabel("held-out accuracy, mean over targets")
            ax.set_title(f"{ds}: accuracy vs {key}; mean ± std over {_seeds(rows)}", fontsize=10)
            ax.grid(alpha=0.3)
            _legend(ax, fontsize=8, frameon=False)
            files.append(_save(fig, out, f"sweep_{slug(ds)}_{slug(key)}.png"))
    return files


def _unit(b: float) -> tuple[str, float]:
    return next(((u, f) for u, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if b >= f), ("B", 1.0))


def bytes_per_round(res: T.Results, by: dict, out: Path) -> list[str]:
    """Horizontal stacked bars: one-time (round 0) and per-round bytes per run, by artifact kind (colour) and
    direction (hatching)."""
    if not by:
        return []
    import matplotlib
    from matplotlib.patches import Patch
    gs = list(by)
    parts = list(dict.fromkeys(k for g in gs for k in by[g]["kinds"]))
    kinds = list(dict.fromkeys(k for k, _ in parts))
    cmap = matplotlib.colormaps["Greys"]   # channels in greys: colours belong to methods in every figure
    kc = {k: cmap(0.25 + 0.6 * i / max(1, len(kinds) - 1)) for i, k in enumerate(kinds)}
    hatch = {"up": "", "down": "///", "peer": ".."}
    fig = _fig(11, 2.2 + 0.4 * len(gs))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, field, title in ((axes[0], "once", "one-time set-up (round 0)"),
                             (axes[1], "per_round", "per training round (mean over rounds 1..T)")):
        tot = [by[g][field] for g in gs]
        unit, f = _unit(max(tot))
        left = np.zeros(len(gs))
        for part in parts:
            v = np.array([by[g]["kinds"].get(part, {}).get(field, 0.0) for g in gs]) / f
            if v.any():
                ax.barh(range(len(gs)), v, left=left, color=kc[part[0]], hatch=hatch[part[1]], edgecolor="white",
                        lw=0.5)
                left += v
        for i, x in enumerate(left):
            ax.text(x, i, f" {human_bytes(x * f)}", va="center", fontsize=8)
        ax.set_xlim(0, max(left.max(), 1e-9) * 1.25)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"{unit} per run (encoded wire bytes; 1 kB = 10³ B)")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(gs)), [legend_label(res.label(g)) for g in gs])
    axes[0].invert_yaxis()
    handles = [Patch(color=kc[k], label=legend_label(k)) for k in kinds] + \
        [Patch(facecolor="white", edgecolor="0.3", hatch=hatch[d], label=f"{ARROW[d]} {d}")
         for d in dict.fromkeys(d for _, d in parts)]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(7, len(handles)), fontsize=8, frameon=False)
    n = sorted({by[g]["runs"] for g in gs})
    fig.suptitle(f"Bytes on the bus per run by artifact kind (colour) and direction (↑ client→server, ↓ server→client);"
                 " "
                 f"mean over {n[0] if len(n) == 1 else f'{n[0]}–{n[-1]}'} runs per method; no baseline (raw bus "
                 "bytes)", fontsize=10)
    return [_save(fig, out, "bytes.png")]


def privacy(res: T.Results, acc: list[dict], eps: dict, out: Path) -> list[str]:
    """ε (from privacy.csv) against mean held-out accuracy; methods without DP as horizontal lines."""
    if not eps:
        return []
    col, accs = colors(res), {r["key"]: r for r in acc}
    fig = _fig(8.4, 4.4)
    ax = fig.subplots()
    for g, r in accs.items():
        if not r["mean"]["n"]:
            continue
        a = r["mean"]
        if g in eps:
            e = eps[g]["epsilon"]
            ax.errorbar(e["mean"], a["mean"], yerr=0 if math.isnan(a["std"]) else a["std"], fmt="o", capsize=3,
                        color=col[g], label=f"{res.label(g)} (δ={eps[g]['delta']:.0e})")
        else:
            ax.axhline(a["mean"], color=col[g], ls="--", lw=1, label=f"{res.label(g)}: no DP (ε = ∞)")
    e = [v["epsilon"]["mean"] for v in eps.values() if math.isfinite(v["epsilon"]["mean"])]
    if e and min(e) > 0 and max(e) / min(e) >= 20:
        ax.set_xscale("log")
    ax.set_xlabel("ε spent by the end of training (privacy.csv; lower = more private)")
    ax.set_ylabel("held-out accuracy, mean over targets")
    ax.set_title(f"Privacy vs accuracy; mean ± std over {_seeds(list(accs.values()))}\n"
                 "baseline: the same methods without DP (dashed)", fontsize=10)
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    return [_save(fig, out, "privacy_vs_accuracy.png")]


MAX_CURVES = 6


def _roc_curves(pooled: dict) -> list[tuple]:
    """Per method (group) its strongest output variant by AUC, the strongest MAX_CURVES methods:
    [(group, variant, data, auc)]."""
    best = {}
    for (g, var), d in pooled.items():
        if d["labels"].min() == d["labels"].max():
            continue
        a = M.auc(d["scores"], d["labels"])
        if g not in best or a > best[g][3]:
            best[g] = (g, var, d, a)
    return sorted(best.values(), key=lambda c: -c[3])[:MAX_CURVES]


def roc(res: T.Results, out: Path) -> list[str]:
    """Log-log ROC per membership attack (as ML Privacy Meter draws it): per method its strongest output variant (its
    colour; the dataset's line style), at most MAX_CURVES curves, AUC and TPR at 1% and 0.1% FPR in the legend (ties
    broken at random, as the scorecard's); scores calibrated within each target model and pooled over each method's
    runs and victims (``tables.membership_scores``); the dashed grey diagonal is random guessing."""
    files, col, ls = [], colors(res), line_styles(res)
    for attack, pooled in T.membership_scores(res).items():
        curves = _roc_curves(pooled)
        if not curves:
            continue
        fig = _fig(6.4, 5.2)
        ax = fig.subplots()
        lo = 1.0
        for g, var, d, a in curves:
            s, y = d["scores"], d["labels"]
            fpr, tpr, _ = M.roc(s, y)
            n0 = int((y == 0).sum())
            lo = min(lo, 1 / n0)
            t = [M.tpr_at_fpr(s, y, f, ties="interpolate") for f in (0.01, 0.001)]   # NaN where not resolvable
            tx = ["n/a" if math.isnan(v) else f"{v:.3f}" for v in t]
            name = res.label(g) + ("" if var == "main" else f" ({var})")
            ax.plot(np.maximum(fpr, 1 / n0 / 2), np.maximum(tpr, 1 / n0 / 2), color=col[g], ls=ls[g], lw=1.6,
                    drawstyle="steps-post", label=f"{name}: AUC {a:.3f}, TPR@1%FPR {tx[0]}, TPR@0.1%FPR {tx[1]}\n"
                                                  f"    {int(y.sum())} members, {n0} non-members")
        ax.plot([lo / 2, 1], [lo / 2, 1], color="0.5", lw=1, ls="--", label="baseline: random guess (TPR = FPR)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo / 2, 1)
        ax.set_ylim(lo / 2, 1.3)
        ax.set_xlabel("false positive rate (log scale)")
        ax.set_ylabel("true positive rate (log scale)")
        ax.set_title(f"{attack}: membership ROC, strongest variant per method (last round attacked), scores\n"
                     "calibrated within each target model and pooled over runs and victims, as the scorecard's; "
                     "rates\nbelow 1/non-members are not resolvable (drawn at the edge)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        _legend(ax, fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.17), frameon=False)
        files.append(_save(fig, out, f"roc_{slug(attack)}.png"))
    return files


def _show(ax, img):
    img = np.clip(np.asarray(img, dtype=float), 0, 1)
    if img.shape[0] == 1:
        ax.imshow(img[0], cmap="gray", vmin=0, vmax=1)
    else:
        ax.imshow(np.moveaxis(img[:3], 0, -1))
    ax.set_xticks([])
    ax.set_yticks([])


def recon(res: T.Results, out: Path, n: int = 8) -> list[str]:
    """One grid per reconstruction attack, paged (PER_PAGE blocks of at most ``n`` images a page): per group and
    output variant its first saved example, then the first example of each victim domain not shown yet (a grid per
    domain), rows truth / attack / baseline, with the example's PSNR and re-identification in the block title."""
    files = []
    gof = res.group_of()
    psnr = {(r["metric"], r["attack"], r["run"], victim_tag(r["victim"]), r.get("output") or "main"): r
            for r in res.leakage if r["metric"] in ("psnr", "reid")}
    for attack in dict.fromkeys(m["attack"] for m in res.recon):
        pick, mine = {}, sorted((m for m in res.recon if m["attack"] == attack and m["run"] in gof),
                                key=lambda m: (m["run"], m["victim"], m["variant"]))
        for m in mine:
            pick.setdefault((gof[m["run"]], m["variant"]), m)
        shown = {(g, domain_of(m["victim"])) for (g, _), m in pick.items()}
        for m in mine:   # and every victim domain of a method once (its first example)
            if (gof[m["run"]], domain_of(m["victim"])) not in shown:
                shown.add((gof[m["run"]], domain_of(m["victim"])))
                pick[(gof[m["run"]], m["variant"], m["victim"])] = m
        if not pick:
            continue
        blocks = []
        for (g, var, *_), m in pick.items():
            z = load_npz(m["path"], m["root"])
            blocks.append((g, var, m, z["truth"][:n], z["recon"][:n], z["baseline"][:n]))
        for k in range(0, len(blocks), PER_PAGE):   # pages of PER_PAGE blocks: each PNG at most ~1,300 px a side
            page = f"_p{k // PER_PAGE + 1}" if k else ""
            files.append(_recon_page(res, attack, blocks[k:k + PER_PAGE], psnr, out, f"recon_{slug(attack)}{page}.png",
                                     (k // PER_PAGE + 1, -(-len(blocks) // PER_PAGE))))
    return files


PER_PAGE = 3


def _mosaic(rows: tuple, cols: int, gap: int = 2) -> np.ndarray:
    """Rows of images (C, H, W) as one RGB picture, white between images and where a row is short: one axes per
    block, not per image (an axes cost the report ~30 ms to lay out and draw)."""
    h, w = np.asarray(rows[0][0]).shape[-2:]
    canvas = np.ones((len(rows) * (h + gap) - gap, cols * (w + gap) - gap, 3))
    for (i, arr), j in ((r, j) for r in enumerate(rows) for j in range(min(cols, len(r[1])))):
        img = np.clip(np.asarray(arr[j], dtype=float), 0, 1)
        canvas[i * (h + gap):i * (h + gap) + h, j * (w + gap):j * (w + gap) + w] = np.moveaxis(img[:3], 0, -1)
    return canvas


def _recon_page(res: T.Results, attack: str, blocks: list, psnr: dict, out: Path, fname: str, page: tuple) -> str:
    """One page of a reconstruction grid: per block (method, variant) truth / attack / baseline rows."""
    cols = max(len(b[3]) for b in blocks)
    fig = _fig(max(4.5, 0.95 * cols + 1.0), 3.6 * len(blocks) + 0.5)
    sub = fig.subfigures(len(blocks), 1, squeeze=False)[:, 0]
    for sf, (g, var, m, x, r, b) in zip(sub, blocks):
        ax, pic = sf.subplots(), _mosaic((x, r, b), cols)
        ax.imshow(pic, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([(i + 0.5) * pic.shape[0] / 3 for i in range(3)], ["truth", "attack", "baseline"], fontsize=9)
        ax.tick_params(length=0)
        ax.set_frame_on(False)
        p, q = (psnr.get((k, attack, m["run"], victim_tag(m["victim"]), var)) for k in ("psnr", "reid"))
        score = ("" if p is None else f"\naligned PSNR {p['value']:.1f} dB vs baseline {p['baseline']:.1f} dB") + \
            ("" if q is None else f"; re-identified {q['value']:.2f} vs chance {q['baseline']:.2f}")
        name = res.label(g) + ("" if var == "main" else f" ({var})")
        sf.suptitle(f"{name}: run {m['run']}, victim {m['victim']}{score}", fontsize=9)
    fig.suptitle(f"{attack}: reconstructions (row 2) of the victim's images (row 1); row 3: the attack's "
                 f"trivial baseline\npixels in [0, 1]; one example run per method and variant, then per victim domain (seed and target in the "
                 f"caption); page {page[0]} of {page[1]}", fontsize=10)
    return _save(fig, out, fname)


def size_curve(res: T.Results, rows: list[dict], out: Path) -> list[str]:
    """Per dataset family with fixed client sizes (report/curves.py): the reconstruction headline (the same metric
    for every channel) against the client's training-set size (log axis), one panel per method on shared axes, one
    line per attack and output variant with its 95% t-interval (lines nudged apart on x so their intervals
    stay visible); oracle priors dashed."""
    files = []
    from .curves import HEADLINE
    mi = info(HEADLINE)
    rows = [r for r in rows if r["metric"] == HEADLINE]
    for ds in dict.fromkeys(r["key"][0] for r in rows):
        lines = defaultdict(list)
        for r in rows:
            if r["key"][0] == ds:
                lines[(r["key"], r["attack"], r["output"])].append(r)
        groups = list(dict.fromkeys(g for g, _, _ in lines))
        channels = list(dict.fromkeys((a, o) for _, a, o in lines))
        fig = _fig(min(3.2 * len(groups) + 1.5, 14.0), 4.2)   # at most ~1,600 px wide (DPI)
        axes = fig.subplots(1, len(groups), sharey=True, squeeze=False)[0]
        col = colors(res)
        for (g, a, o), rs in lines.items():
            ax, i = axes[groups.index(g)], channels.index((a, o))
            rs.sort(key=lambda r: r["size"])
            x = [r["size"] * 2 ** (0.06 * (i - (len(channels) - 1) / 2)) for r in rs]
            y = [r["value"]["mean"] for r in rs]
            lo = [0 if r["value"]["lo"] != r["value"]["lo"] else r["value"]["mean"] - r["value"]["lo"] for r in rs]
            hi = [0 if r["value"]["hi"] != r["value"]["hi"] else r["value"]["hi"] - r["value"]["mean"] for r in rs]
            name = f"{a} on {rs[0].get('artifact', '?')}" + ("" if o == "main" else f" ({o})") + \
                (" [oracle]" if rs[0]["oracle"] else "")
            ax.errorbar(x, y, yerr=[lo, hi], color=col[g], marker="os^vDP*X<>"[i % 10], capsize=2,
                        ls="--" if rs[0]["oracle"] else "-", alpha=0.85)
            ax.plot(x, [r["baseline"]["mean"] for r in rs], color="0.5", ls=":", marker="os^vDP*X<>"[i % 10],
                    ms=3, lw=1)
            ax.plot([], [], color="0.2", marker="os^vDP*X<>"[i % 10], ls="--" if rs[0]["oracle"] else "-",
                    label=name)   # the legend names the channel by its marker (colour: the method, as everywhere)
        for ax, g in zip(axes, groups):
            ax.set_xscale("log", base=2)
            if mi.hi <= 1:
                ax.set_ylim(-0.03, 1.03)
            ax.set_title(res.label(g), fontsize=9)
            ax.set_xlabel("client training-set size (images)")
        axes[0].set_ylabel(f"{mi.label}" + (f" ({mi.unit})" if mi.unit else ""))
        n = sorted({r["value"]["n"] for rs in lines.values() for r in rs})
        fig.suptitle(f"{ds}: reconstruction against client data size; mean over victims (n = {n[0]}"
                     + (f"–{n[-1]}" if len(n) > 1 else "") + "), 95% Student-t intervals;\ndashed: oracle prior "
                     "(upper bound); grey dotted: each channel's trivial baseline; colour: the method; marker: the "
                     "channel",
                     fontsize=9)
        handles = {legend_label(h.get_label()): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
        fig.legend(list(handles.values()), list(handles), fontsize=7, loc="outside lower center", ncol=3)
        files.append(_save(fig, out, f"size_curve_{slug(ds)}.png"))
    return files
