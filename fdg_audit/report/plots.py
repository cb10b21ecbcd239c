"""The report's figures (matplotlib, Agg, no pyplot state). Each function writes PNGs into ``out`` and returns
their file names; every figure states its units, the number of seeds and what the baseline is."""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .. import metrics as M
from ..metrics.registry import info
from ..runfolder import victim_tag
from . import tables as T
from .formatting import ARROW, human_bytes, num, slug

DPI = 110


def _fig(w, h):
    fig = Figure(figsize=(w, h), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, out: Path, name: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():     # tall grids of tiny panels: matplotlib falls back to its default layout
        warnings.filterwarnings("ignore", message="constrained_layout not applied")
        fig.savefig(out / name, bbox_inches="tight")
    return name


def colors(res: T.Results) -> dict:
    import matplotlib
    cmap = matplotlib.colormaps["tab10" if len(res.groups()) <= 10 else "tab20"]
    return {g: cmap(i % cmap.N) for i, g in enumerate(res.groups())}


def _seeds(rows) -> str:
    n = sorted({len(r["seeds"]) for r in rows})
    return f"{n[0]} seed{'s' * (n[0] != 1)}" if len(n) == 1 else f"{n[0]}–{n[-1]} seeds"


def accuracy(res: T.Results, acc: list[dict], out: Path) -> list[str]:
    """Grouped bars per dataset: held-out accuracy per target and mean over targets, std over seeds."""
    files, col = [], colors(res)
    for ds in dict.fromkeys(r["dataset"] for r in acc):
        rows = [r for r in acc if r["dataset"] == ds]
        targets = list(dict.fromkeys(t for r in rows for t in r["targets"]))
        xs = targets + ["mean over targets"]
        width = 0.8 / len(rows)
        fig = _fig(max(6.0, 1.5 + len(xs) * (0.45 + 0.22 * len(rows))), 4.2)
        ax = fig.subplots()
        for i, r in enumerate(rows):
            cells = [r["targets"].get(t, T.stat([])) for t in targets] + [r["mean"]]
            x = np.arange(len(xs)) + (i - (len(rows) - 1) / 2) * width
            err = [0 if math.isnan(c["std"]) else c["std"] for c in cells]
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
                     + ("1 seed (no error bars)" if one else f"bars: mean over {_seeds(rows)}, error bars: std over "
                        "seeds"), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
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
            for name, rs in lines.items():
                rs = sorted(rs, key=lambda r: r["sweep"][key])
                ax.errorbar([r["sweep"][key] for r in rs], [r["mean"]["mean"] for r in rs], marker="o", capsize=3,
                            yerr=[0 if math.isnan(r["mean"]["std"]) else r["mean"]["std"] for r in rs], label=name)
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
            ax.legend(fontsize=8, frameon=False)
            files.append(_save(fig, out, f"sweep_{slug(ds)}_{slug(key)}.png"))
    return files


def tradeoff(res: T.Results, card: list[dict], out: Path) -> list[tuple[str, str, str]]:
    """Accuracy against each harm, one figure per (dataset, harm): every method (and adversary) on the same axes,
    95% intervals as error bars both ways, the trivial baseline as a grey x, the Pareto front marked (no other
    point is at least as accurate and leaks at most as much). Returns (dataset, harm, file) triples."""
    files, col = [], colors(res)
    acc = {(r["dataset"], r["method"], r["variant"]): r for r in card if r["harm"] == "accuracy"}
    marks = {"server": "o", "client": "s", "eavesdropper": "^"}
    for ds in dict.fromkeys(g[0] for g in res.groups()):
        for harm in dict.fromkeys(r["harm"] for r in card if r["harm"] != "accuracy" and r["dataset"] == ds):
            pts = []
            for r in card:
                g = (r["dataset"], r["method"], r["variant"])
                x = num(r["value"])
                if r["dataset"] != ds or r["harm"] != harm or g not in acc or math.isnan(x):
                    continue
                pts.append((g, r, x, num(acc[g]["value"])))
            if not pts:
                continue
            mi = info(pts[0][1]["metric"].split("|")[0])
            front = T.pareto_front([(x, y) for _, _, x, y in pts], mi.higher)
            fig = _fig(8.6, 4.8)
            ax = fig.subplots()
            for (g, r, x, y), on in zip(pts, front):
                a = acc[g]
                xe = [[max(0.0, x - num(r["ci_low"]))], [max(0.0, num(r["ci_high"]) - x)]]
                ye = [[max(0.0, y - num(a["ci_low"]))], [max(0.0, num(a["ci_high"]) - y)]]
                xe, ye = [[0 if math.isnan(v[0]) else v[0]] for v in xe], [[0 if math.isnan(v[0]) else v[0]] for v in ye]
                ax.errorbar(x, y, xerr=xe, yerr=ye, fmt=marks.get(r["adversary"], "o"), ms=8 if on else 6,
                            color=col.get(g, "k"), mec="k" if on else col.get(g, "k"), mew=1.5, capsize=2,
                            label=f"{res.label(g)}, {r['adversary']} ({r['attack']}; {r['n_runs']} runs)")
                b = num(r["baseline"])
                if not math.isnan(b):
                    ax.plot([b, x], [y, y], color=col.get(g, "k"), lw=0.7, ls=":")
                    ax.plot(b, y, "x", color="0.35", ms=7)
            order = sorted(((x, y) for (_, _, x, y), on in zip(pts, front) if on), key=lambda p: p[0])
            ax.plot([p[0] for p in order], [p[1] for p in order], "k-", lw=1.2, alpha=0.6,
                    label="Pareto front (black-edged points)")
            ax.plot([], [], "x", color="0.35", label="trivial baseline (selected the same way)")
            unit = f" ({mi.unit})" if mi.unit else ""
            more = "→ more leakage" if mi.higher else "← more leakage (lower error)"
            ax.set_xlabel(f"{harm}: {pts[0][1]['metric']}{unit}, held-out strongest attack   {more}")
            ax.set_ylabel("held-out accuracy (mean over targets and seeds)")
            ax.set_title(f"{ds}: accuracy vs {harm}\nerror bars: 95% bootstrap intervals (scorecard.csv); "
                         "marker: adversary (o server, □ client, △ eavesdropper)", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
            files.append((ds, harm, _save(fig, out, f"tradeoff_{slug(ds)}_{slug(harm)}.png")))
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
    cmap = matplotlib.colormaps["tab10" if len(kinds) <= 10 else "tab20"]
    kc = {k: cmap(i % cmap.N) for i, k in enumerate(kinds)}
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
    axes[0].set_yticks(range(len(gs)), [res.label(g) for g in gs])
    axes[0].invert_yaxis()
    handles = [Patch(color=kc[k], label=k) for k in kinds] + \
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
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    return [_save(fig, out, "privacy_vs_accuracy.png")]


def roc(res: T.Results, out: Path) -> list[str]:
    """Log-log ROC per membership attack; scores pooled over each group's runs and victims."""
    files, col = [], colors(res)
    for attack, pooled in T.membership_scores(res).items():
        fig = _fig(6.4, 5.2)
        ax = fig.subplots()
        lo, styles = 1.0, {}
        for (g, var), d in pooled.items():
            s, y = d["scores"], d["labels"]
            if y.min() == y.max():
                continue
            fpr, tpr, _ = M.roc(s, y)
            n0 = int((y == 0).sum())
            lo = min(lo, 1 / n0)
            t1 = M.tpr_at_fpr(s, y, 0.01)
            name = res.label(g) + ("" if var == "main" else f" ({var})")
            ls = styles.setdefault(var, ["-", "--", "-.", ":"][len(styles) % 4])
            ax.plot(np.maximum(fpr, 1 / n0 / 2), np.maximum(tpr, 1 / n0 / 2), color=col[g], ls=ls, lw=1.6,
                    drawstyle="steps-post",
                    label=f"{name}: AUC {M.auc(s, y):.3f}, TPR@1%FPR {'n/a' if math.isnan(t1) else f'{t1:.3f}'}\n"
                          f"    pooled over {len(d['models'])} models×victims, {int(y.sum())} members, {n0} non-members")
        ax.plot([lo / 2, 1], [lo / 2, 1], color="0.5", lw=1, label="baseline: random guess (TPR = FPR)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo / 2, 1)
        ax.set_ylim(lo / 2, 1.3)
        ax.set_xlabel("false positive rate (log scale)")
        ax.set_ylabel("true positive rate (log scale)")
        ax.set_title(f"{attack}: membership ROC (last round attacked), scores pooled over runs\n(targets × seeds) and "
                     "victims; rates below 1/non-members are not resolvable (drawn at the edge)", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.12), frameon=False)
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
    """One grid per reconstruction attack: per group its first saved example, rows truth / attack /
    baseline, with the example's PSNR from leakage.csv in the block title."""
    files = []
    gof = res.group_of()
    psnr = {(r["attack"], r["run"], victim_tag(r["victim"]), r.get("output") or "main"): r for r in res.leakage
            if r["metric"] == "psnr"}
    for attack in dict.fromkeys(m["attack"] for m in res.recon):
        pick = {}
        for m in sorted((m for m in res.recon if m["attack"] == attack and m["run"] in gof),
                        key=lambda m: (m["run"], m["victim"], m["variant"])):
            pick.setdefault((gof[m["run"]], m["variant"]), m)
        if not pick:
            continue
        blocks = []
        for (g, var), m in pick.items():
            with np.load(m["path"]) as z:
                blocks.append((g, var, m, z["truth"][:n], z["recon"][:n], z["baseline"][:n]))
        cols = max(len(b[3]) for b in blocks)
        fig = _fig(max(4.5, 0.95 * cols + 1.0), 3.6 * len(blocks) + 0.5)
        sub = fig.subfigures(len(blocks), 1, squeeze=False)[:, 0]
        for sf, (g, var, m, x, r, b) in zip(sub, blocks):
            axes = sf.subplots(3, cols, squeeze=False)
            for j in range(cols):
                for i, arr in enumerate((x, r, b)):
                    if j < len(arr):
                        _show(axes[i, j], arr[j])
                    else:
                        axes[i, j].axis("off")
            for i, name in enumerate(("truth", "attack", "baseline")):
                axes[i, 0].set_ylabel(name, fontsize=9)
            p = psnr.get((attack, m["run"], victim_tag(m["victim"]), var))
            score = "" if p is None else f"\nmean PSNR {p['value']:.1f} dB vs baseline {p['baseline']:.1f} dB"
            name = res.label(g) + ("" if var == "main" else f" ({var})")
            sf.suptitle(f"{name}: run {m['run']}, victim {m['victim']}{score}", fontsize=9)
        fig.suptitle(f"{attack}: reconstructions (row 2) of the victim's images (row 1); row 3: the attack's "
                     f"trivial baseline\npixels in [0, 1]; one example run per method (seed and target in the "
                     f"caption)", fontsize=10)
        files.append(_save(fig, out, f"recon_{slug(attack)}.png"))
    return files


def size_curve(res: T.Results, rows: list[dict], out: Path) -> list[str]:
    """Per dataset family with fixed client sizes (report/curves.py): success@25dB against the client's training-set
    size (log axis), one panel per method on shared axes, one line per attack and output variant with its 95%
    t-interval (lines nudged apart on x so their intervals stay visible); oracle priors dashed."""
    files = []
    rows = [r for r in rows if r["metric"] == "success@25dB"]
    for ds in dict.fromkeys(r["key"][0] for r in rows):
        lines = defaultdict(list)
        for r in rows:
            if r["key"][0] == ds:
                lines[(r["key"], r["attack"], r["output"])].append(r)
        groups = list(dict.fromkeys(g for g, _, _ in lines))
        channels = list(dict.fromkeys((a, o) for _, a, o in lines))
        fig = _fig(3.2 * len(groups) + 1.5, 4.2)
        axes = fig.subplots(1, len(groups), sharey=True, squeeze=False)[0]
        for (g, a, o), rs in lines.items():
            ax, i = axes[groups.index(g)], channels.index((a, o))
            rs.sort(key=lambda r: r["size"])
            x = [r["size"] * 2 ** (0.06 * (i - (len(channels) - 1) / 2)) for r in rs]
            y = [r["value"]["mean"] for r in rs]
            lo = [0 if r["value"]["lo"] != r["value"]["lo"] else r["value"]["mean"] - r["value"]["lo"] for r in rs]
            hi = [0 if r["value"]["hi"] != r["value"]["hi"] else r["value"]["hi"] - r["value"]["mean"] for r in rs]
            name = a + ("" if o == "main" else f" ({o})") + (" [oracle]" if rs[0]["oracle"] else "")
            ax.errorbar(x, y, yerr=[lo, hi], color=f"C{i % 10}", marker="os^vDP*X<>"[i % 10], capsize=2,
                        ls="--" if rs[0]["oracle"] else "-", label=name, alpha=0.85)
        for ax, g in zip(axes, groups):
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.03, 1.03)
            ax.set_title(res.label(g), fontsize=9)
            ax.set_xlabel("client training-set size (images)")
        axes[0].set_ylabel("success@25dB (share of images, PSNR >= 25 dB)")
        n = sorted({r["value"]["n"] for rs in lines.values() for r in rs})
        fig.suptitle(f"{ds}: reconstruction against client data size; mean over victims (n = {n[0]}"
                     + (f"–{n[-1]}" if len(n) > 1 else "") + "), 95% t-intervals; dashed: oracle prior (upper bound)",
                     fontsize=9)
        handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
        fig.legend(list(handles.values()), list(handles), fontsize=7, loc="outside lower center", ncol=3)
        files.append(_save(fig, out, f"size_curve_{slug(ds)}.png"))
    return files
