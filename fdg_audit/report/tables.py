"""Load run folders and turn them into the report's tables (plain Python + NumPy, no plotting).

Definitions used everywhere in the report:
  * a *group* is one (dataset, method label, sweep variant); its runs differ by held-out target and seed;
  * held-out accuracy is ``target_acc`` of summary.json: the target-domain accuracy at the round selected on
    the pooled source-validation splits (never the best round on the target);
  * per target: mean ± sample std (ddof=1) over seeds; "mean over targets": for each seed the mean over the
    targets, then mean ± std over the seeds that have every target (DomainBed's convention);
  * strongest leakage: per run, the strongest value over victims, rounds (and, where stated, attacks and
    artifacts); then mean ± std over runs (targets x seeds). "Strongest" is the largest value except for
    error metrics (``METRICS[..].higher``), where the smallest error is the strongest attack;
  * bytes: encoded wire bytes from messages.jsonl; round 0 is the one-time set-up, "per round" is the mean
    over the training rounds 1..T; both per run, averaged over the group's runs.
"""
from __future__ import annotations

import csv
import json
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..ledger import Ledger, read_summary
from ..metrics.image import PSNR_CAP_DB


@dataclass
class MetricInfo:
    unit: str = ""
    higher: bool = True      # a larger value means a stronger attack (more leakage)
    text: str = ""
    lo: float = 0.0          # the metric's range: intervals are cut to it
    hi: float = 1.0


METRICS = {
    "psnr": MetricInfo("dB", True, "mean PSNR of the reconstructions against the true images", 0.0, PSNR_CAP_DB),
    "psnr_max": MetricInfo("dB", True, "best single-image PSNR", 0.0, PSNR_CAP_DB),
    "ssim": MetricInfo("", True, "mean SSIM (Gaussian window 11x11, sigma 1.5)", -1.0, 1.0),
    "success@25dB": MetricInfo("fraction", True, "fraction of images reconstructed at PSNR >= 25 dB"),
    "auc": MetricInfo("", True, "membership ROC AUC"),
    "tpr@0.01fpr": MetricInfo("fraction", True, "membership TPR at 1% FPR"),
    "tpr@0.001fpr": MetricInfo("fraction", True, "membership TPR at 0.1% FPR"),
    "class_balanced_acc": MetricInfo("fraction", True, "balanced accuracy of the inferred class"),
    "domain_balanced_acc": MetricInfo("fraction", True, "balanced accuracy of the inferred source domain"),
    "label_count_acc": MetricInfo("fraction", True, "label-count accuracy (multiset overlap)"),
    "label_dist_acc": MetricInfo("fraction", True, "label-distribution accuracy (1 - total variation)"),
    "label_existence_f1": MetricInfo("", True, "F1 of which labels a client holds"),
    "n_samples_rel_error": MetricInfo("fraction", False, "relative error of the estimated dataset size", 0.0, math.inf),
    "label_acc": MetricInfo("fraction", True, "accuracy of the labels inferred with the reconstructions"),
    "tpr@0fpr": MetricInfo("fraction", True, "membership TPR with no false positive"),
    "eps_lb_one_run": MetricInfo("", True, "empirical ε lower bound from canaries (one-run audit, 95% conf.)", 0.0,
                                 math.inf),
    "eps_lb_cp": MetricInfo("", True, "empirical ε lower bound from canaries (Clopper–Pearson, 95% conf.)", 0.0,
                            math.inf),
    "eps_theory": MetricInfo("", True, "the accountant's ε of the audited mechanism (not a measurement)", 0.0,
                             math.inf),
    "audit_auc": MetricInfo("", True, "ROC AUC of the canary scores"),
}
# the metrics shown in the terminal headline (per artifact, those present), in order of preference
PRIMARY = ["psnr", "auc", "class_balanced_acc", "domain_balanced_acc", "label_dist_acc", "n_samples_rel_error",
           "eps_lb_one_run"]
NOT_LEAKAGE = {"eps_theory"}   # reported in the leakage table, but no axis of an accuracy-vs-leakage plot


def info(metric: str) -> MetricInfo:
    if metric in METRICS:
        return METRICS[metric]
    low = any(s in metric.lower() for s in ("error", "mse", "lpips", "distance"))
    return MetricInfo("", not low, metric, -math.inf, math.inf)


def stronger(metric: str, a: float, b: float) -> bool:
    """Whether value ``a`` is a stronger attack result than ``b`` (NaN is never stronger)."""
    if math.isnan(a):
        return False
    if math.isnan(b):
        return True
    return a > b if info(metric).higher else a < b


def stat(values) -> dict:
    """mean, sample std (ddof=1; NaN for one value) and count of the finite values."""
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    if not len(v):
        return dict(mean=float("nan"), std=float("nan"), n=0)
    return dict(mean=float(v.mean()), std=float(v.std(ddof=1)) if len(v) > 1 else float("nan"), n=len(v))


# ------------------------------------------------------------------------------------------- loading

@dataclass
class Results:
    roots: list
    runs: list = field(default_factory=list)        # summary.json entries of every folder (all statuses)
    leakage: list = field(default_factory=list)
    controls: list = field(default_factory=list)
    envelopes: list = field(default_factory=list)
    privacy: list = field(default_factory=list)
    attack_notes: list = field(default_factory=list)  # leakage.csv rows without a number (skipped, failed)
    recon: list = field(default_factory=list)       # dict(attack, run, victim, variant, path)
    mia: list = field(default_factory=list)         # dict(attack, run, path): raw membership scores of one run
    items: list = field(default_factory=list)       # dict(attack, run, path): per-item values (attack._save_items)
    scenarios: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    reference: dict = field(default_factory=dict)   # the scenario's [reference]: published numbers to print beside

    @property
    def ok(self) -> list:
        return [r for r in self.runs if r.get("status") == "ok"]

    def group_of(self) -> dict:
        return {r["run"]: gkey(r) for r in self.ok}

    def groups(self) -> list:
        return list(dict.fromkeys(gkey(r) for r in self.ok))

    def label(self, g) -> str:
        """Display name of a group: method+variant, prefixed by the dataset when there are several."""
        many = len({k[0] for k in self.groups()}) > 1
        return (f"{g[0]}/" if many else "") + f"{g[1]}{g[2]}"


def gkey(r: dict) -> tuple:
    return (str(r.get("dataset", "")), str(r.get("method", "")), str(r.get("variant", "") or ""))


NEEDS = {"leakage.csv": ("run", "attack", "metric", "value", "baseline", "round", "status"),
         "privacy.csv": ("run", "epsilon", "delta")}


def _csv(path: Path) -> list[dict]:
    """A run folder's CSV file ([] when absent); one without its columns (NEEDS) is a one-line error."""
    if not path.exists():
        return []
    try:
        with open(path, newline="") as f:
            rows = csv.DictReader(f)
            missing = [c for c in NEEDS.get(path.name, ()) if c not in (rows.fieldnames or [])]
            rows = list(rows)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{path} cannot be read as CSV ({e}): the run folder is damaged; restore it or re-run") from None
    if missing:
        raise UserError(f"{path} lacks the column(s) {', '.join(missing)}: the run folder is damaged; restore the file "
                        f"or re-run `fdg_audit attack {path.parent}`")
    return rows


def _controls(path: Path) -> list[dict]:
    """controls.json: a list of {attack, name, metric, value, threshold, passed}; anything else is one line."""
    from ..ledger import read_json
    c = read_json(path, "attack controls file")
    keys = ("attack", "name", "metric", "value", "threshold", "passed")
    if not (isinstance(c, list) and all(isinstance(x, dict) and all(k in x for k in keys) for x in c)):
        raise UserError(f"{path} is not a list of attack controls ({', '.join(keys)}): the run folder is damaged; "
                        f"re-run `fdg_audit attack {path.parent}`")
    return c


def _num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def _split_file(stem: str, runs: set) -> tuple | None:
    """``<run with / as __>__<victim>__<variant>`` -> (run, victim, variant), matched against known runs."""
    for run in sorted(runs, key=len, reverse=True):
        safe = run.replace("/", "__") + "__"
        if stem.startswith(safe):
            rest = stem[len(safe):].split("__")
            return run, rest[0].replace("@", "/"), "__".join(rest[1:]) or "main"
    return None


def _reference(root: Path) -> dict:
    """The [reference] table of a run folder's config.resolved.toml (validated when the scenario was planned)."""
    import tomllib
    try:
        ref = tomllib.loads((root / "config.resolved.toml").read_text()).get("reference", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}
    return ref if isinstance(ref, dict) and isinstance(ref.get("values", {}), dict) else {}


def load(run_dirs) -> Results:
    """Read one or many run folders. A run present in several folders is taken from the last one."""
    roots = [Path(d) for d in run_dirs]
    res = Results(roots)
    chosen: dict[str, int] = {}
    per_root = []
    for i, root in enumerate(roots):
        f = root / "summary.json"
        if not f.exists():
            raise UserError(f"{root} has no summary.json: pass run folders written by `fdg_audit scenario` "
                            "(runs/<scenario>/<timestamp>)")
        s = read_summary(root)
        res.scenarios.append(s.get("scenario", root.name))
        res.reference = _reference(root) or res.reference
        for r in s.get("runs", []):
            if r["run"] in chosen and r.get("status") == "ok":
                res.notes.append(f"run {r['run']} appears in {roots[chosen[r['run']]]} and {root}: using {root}")
            if r.get("status") == "ok" or r["run"] not in chosen:
                chosen[r["run"]] = i
        per_root.append(s.get("runs", []))
    for i, runs in enumerate(per_root):
        res.runs += [dict(r, root=str(roots[i])) for r in runs if chosen[r["run"]] == i]
    mine = lambda i, run: chosen.get(run) == i
    for i, root in enumerate(roots):
        for r in _csv(root / "leakage.csv"):
            if not mine(i, r["run"]):
                continue
            r = dict(r, value=_num(r.get("value")), baseline=_num(r.get("baseline")),
                     round=int(_num(r["round"])) if r.get("round") not in ("", None) else -1)
            status = r.get("status") or "ok"
            measured = r["metric"] not in ("skipped", "failed") and not status.startswith(("skipped", "failed"))
            (res.leakage if measured else res.attack_notes).append(r)
        for r in _csv(root / "privacy.csv"):
            if mine(i, r.get("run", "")):
                res.privacy.append(dict(r, epsilon=_num(r.get("epsilon")), delta=_num(r.get("delta"))))
        if (root / "controls.json").exists():
            res.controls += [dict(c, root=str(root)) for c in _controls(root / "controls.json")]
        if (root / "messages.jsonl").exists():   # Ledger.open: a torn last line is dropped, damage is one line
            res.envelopes += [asdict(e) for e in Ledger.open(root).envelopes if mine(i, e.run)]
        runs = {r for r, j in chosen.items() if j == i}
        for p in sorted((root / "recon").glob("*/*.npz")):
            hit = _split_file(p.stem, runs)
            if hit:
                res.recon.append(dict(attack=p.parent.name, run=hit[0], victim=hit[1], variant=hit[2], path=p))
        safe = {r.replace("/", "__"): r for r in runs}
        for p in sorted((root / "mia").glob("*/*.npz")):
            if p.stem in safe:
                res.mia.append(dict(attack=p.parent.name, run=safe[p.stem], path=p))
        for p in sorted((root / "items").glob("*/*.npz")):
            if p.stem in safe:
                res.items.append(dict(attack=p.parent.name, run=safe[p.stem], path=p))
    return res


# ------------------------------------------------------------------------------------------- accuracy

def sweep_keys(res: Results) -> list[str]:
    return list(dict.fromkeys(k for r in res.ok for k in (r.get("sweep") or {})))


def _clip01(ci: tuple) -> tuple:
    """(mean, lo, hi, n) with the interval cut to accuracy's range [0, 1] (NaN stays NaN)."""
    m, lo, hi, n = ci
    return m, lo if lo != lo else max(lo, 0.0), hi if hi != hi else min(hi, 1.0), n


def accuracy_table(res: Results) -> list[dict]:
    """One row per group: per-target and mean-over-targets held-out accuracy (mean ± std over seeds)."""
    by = defaultdict(list)
    for r in res.ok:
        if r.get("target_acc") is not None:
            by[gkey(r)].append(r)
    rows = []
    for g, rs in by.items():
        targets = list(dict.fromkeys(r["target"] for r in rs))
        seeds = sorted({r["seed"] for r in rs})
        acc = defaultdict(dict)
        for r in rs:
            acc[r["target"]][r["seed"]] = float(r["target_acc"])
        complete = [s for s in seeds if all(s in acc[t] for t in targets)]
        from ..metrics.stats import t_interval
        pairs = [(t, v) for t in targets for v in acc[t].values()]
        rows.append(dict(dataset=g[0], method=g[1], variant=g[2], key=g, sweep=rs[0].get("sweep") or {},
                         targets={t: stat(acc[t].values()) for t in targets},
                         mean=stat([float(np.mean([acc[t][s] for t in targets])) for s in complete]),
                         ci=_clip01(t_interval([v for _, v in pairs], strata=[t for t, _ in pairs])),
                         converged=sum(r.get("converged") is not False for r in rs),
                         seeds=seeds, incomplete=[s for s in seeds if s not in complete], runs=len(rs),
                         num_classes=rs[0].get("num_classes")))
    return rows


# ------------------------------------------------------------------------------------------- leakage

def _strongest(rows: list[dict]) -> dict | None:
    best = None
    for r in rows:
        if best is None or stronger(r["metric"], r["value"], best["value"]):
            best = r
    return best


def per_run_strongest(leak: list[dict], keys: tuple) -> dict:
    """{(run, *keys): the row with the strongest value} over everything not in ``keys`` (victims, rounds...)."""
    by = defaultdict(list)
    for r in leak:
        by[(r["run"],) + tuple(r.get(k, "") for k in keys)].append(r)
    return {k: _strongest(v) for k, v in by.items()}


def leakage_table(res: Results) -> list[dict]:
    """Per group x attack x artifact x output x metric: the per-run strongest value over victims and rounds,
    summarised over runs (mean ± std, and the strongest run), with the mean baseline and the status."""
    gof = res.group_of()
    keys = ("attack", "artifact", "output", "metric")
    by = defaultdict(list)
    for (run, *k), r in per_run_strongest([r for r in res.leakage if r["run"] in gof], keys).items():
        by[(gof[run],) + tuple(k)].append(r)
    rows = []
    for (g, attack, artifact, output, metric), rs in by.items():
        top = _strongest(rs) or rs[0]
        bad = [r["status"] for r in rs if r.get("status") not in ("ok", "", None)]
        rows.append(dict(key=g, dataset=g[0], method=g[1], variant=g[2], attack=attack, artifact=artifact,
                         output=output, metric=metric, value=stat(r["value"] for r in rs),
                         baseline=stat(r["baseline"] for r in rs), top=top, runs=len(rs),
                         adversary=rs[0].get("adversary", ""), status=bad[0] if bad else "ok"))
    return rows


def method_leakage(res: Results, metric: str) -> dict:
    """{group: dict(value=stat, baseline=stat)}: per run the strongest ``metric`` over every measurable
    attack, artifact, victim and round; then over runs. Rows whose control failed are left out."""
    gof = res.group_of()
    rows = [r for r in res.leakage if r["metric"] == metric and r.get("status") in ("ok", "", None) and r["run"] in gof]
    by = defaultdict(list)
    for (run,), r in per_run_strongest(rows, ()).items():
        by[gof[run]].append(r)
    return {g: dict(value=stat(r["value"] for r in rs), baseline=stat(r["baseline"] for r in rs))
            for g, rs in by.items() if any(not math.isnan(r["value"]) for r in rs)}


def pareto_front(points: list[tuple[float, float]], higher: bool = True) -> list[bool]:
    """Which (leakage, accuracy) points are Pareto-optimal: no other point has at least the accuracy and at
    most the leakage, and is strictly better in one. ``higher``: larger leakage values mean more leakage."""
    p = [((x if higher else -x), y) for x, y in points]
    return [not any(q[0] <= a[0] and q[1] >= a[1] and (q[0] < a[0] or q[1] > a[1]) for q in p)
            for a in p]


def membership_scores(res: Results) -> dict:
    """{attack: {(group, output variant): dict(scores, labels, models)}} from mia/<attack>/<run>.npz: per run,
    victim and variant the scores of the last round attacked (the final model), pooled over the group's runs
    and victims (``models``: the (run, victim) pairs pooled)."""
    gof = res.group_of()
    out = defaultdict(lambda: defaultdict(lambda: dict(scores=[], labels=[], models=set())))
    for m in res.mia:
        if m["run"] not in gof:
            continue
        with np.load(m["path"]) as z:
            if "score" not in z:
                continue
            s, y = z["score"].ravel(), z["member"].ravel()
            victim, variant, rnd = z["victim"].astype(str), z["variant"].astype(str), z["round"]
        for v, var in dict.fromkeys(zip(victim, variant)):
            sel = (victim == v) & (variant == var)
            sel &= rnd == rnd[sel].max()
            d = out[m["attack"]][(gof[m["run"]], var or "main")]
            d["scores"].append(s[sel])
            d["labels"].append(y[sel])
            d["models"].add((m["run"], v))
    return {a: {k: dict(scores=np.concatenate(d["scores"]), labels=np.concatenate(d["labels"]).astype(int),
                        models=d["models"]) for k, d in by.items()} for a, by in out.items()}


# ------------------------------------------------------------------------------------------- bytes

def direction(e: dict) -> str:
    if e["receiver"] == "server":
        return "up"
    if e["sender"] == "server":
        return "down"
    return "peer"


ARROW = {"up": "↑", "down": "↓", "peer": "↔"}


def bytes_table(res: Results) -> dict:
    """{group: dict(runs, kinds={(kind, direction): dict(once, per_round, total)}, once, per_round, total,
    clients={client: sorted kinds it sent})}, bytes per run averaged over the group's runs."""
    gof = res.group_of()
    rounds = {r["run"]: int((r.get("params") or {}).get("rounds") or 0) for r in res.ok}
    for e in res.envelopes:
        if e["run"] in rounds and not rounds[e["run"]]:
            rounds[e["run"]] = max(rounds[e["run"]], e["round"])
    acc = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    runs, clients = defaultdict(set), defaultdict(lambda: defaultdict(set))
    for e in res.envelopes:
        if e["run"] not in gof:
            continue
        g = gof[e["run"]]
        runs[g].add(e["run"])
        a = acc[g][(e["kind"], direction(e))]
        b = e["wire_bytes"]
        a[2] += b
        if e["round"] == 0:
            a[0] += b
        else:
            a[1] += b / max(1, rounds[e["run"]])
        if e["sender"] != "server":
            clients[g][e["sender"]].add(e["kind"])
    out = {}
    for g in res.groups():
        n = len(runs[g])
        if not n:
            continue
        order = sorted(acc[g], key=lambda k: (k[0], list(ARROW).index(k[1])))
        kinds = {k: dict(once=acc[g][k][0] / n, per_round=acc[g][k][1] / n, total=acc[g][k][2] / n) for k in order}
        out[g] = dict(runs=n, kinds=kinds, **{f: sum(k[f] for k in kinds.values())
                                              for f in ("once", "per_round", "total")},
                      clients={c: sorted(k) for c, k in sorted(clients[g].items())})
    return out


def human_bytes(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:.3g} {unit}"
    return f"{b:.0f} B"


# ------------------------------------------------------------------------------------------- privacy

def privacy_table(res: Results) -> dict:
    """{group: dict(epsilon=stat, delta)} from privacy.csv: per run the largest ε of any row (the worst party's
    ε spent by the end of training; its composed ``total`` where it runs several mechanisms), then over runs."""
    gof = res.group_of()
    per_run = {}
    for r in res.privacy:
        if r["run"] in gof and not math.isnan(r["epsilon"]):
            if r["run"] not in per_run or r["epsilon"] > per_run[r["run"]]["epsilon"]:
                per_run[r["run"]] = r
    by = defaultdict(list)
    for run, r in per_run.items():
        by[gof[run]].append(r)
    return {g: dict(epsilon=stat(r["epsilon"] for r in rs), delta=max(r["delta"] for r in rs))
            for g, rs in by.items()}


# ------------------------------------------------------------------------------------------- text

def fmt(s: dict, digits: int = 3) -> str:
    if not s or s["n"] == 0:
        return "—"
    m = f"{s['mean']:.{digits}f}"
    return m if s["n"] == 1 else f"{m} ± {s['std']:.{digits}f}"


def fmt_metric(metric: str, s: dict) -> str:
    u = info(metric).unit
    return fmt(s, 1 if u == "dB" else 3) + (" dB" if u == "dB" and s["n"] else "")


def md_table(headers: list[str], rows: list[list]) -> str:
    esc = lambda c: str(c).replace("|", "\\|")
    lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def text_table(headers: list[str], rows: list[list]) -> str:
    """Fixed-width table; a cell may hold several lines (one row then spans several terminal lines)."""
    cells = [[str(c).split("\n") for c in r] for r in [headers] + rows]
    w = [max(len(line) for r in cells for line in r[i]) for i in range(len(headers))]
    out = []
    for j, r in enumerate(cells):
        for k in range(max(len(c) for c in r)):
            out.append("  ".join((c[k] if k < len(c) else "").ljust(w[i]) for i, c in enumerate(r)).rstrip())
        if j == 0:
            out.append("  ".join("-" * x for x in w))
    return "\n".join(out)


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("_") or "x"
