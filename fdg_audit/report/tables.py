"""Load run folders and turn them into the report's tables (plain Python + NumPy, no plotting).

Definitions used everywhere in the report:
  * a *group* is one (dataset, method label, sweep variant); its runs differ by held-out target and seed;
  * held-out accuracy is ``target_acc`` of summary.json: the target-domain accuracy at the round selected on
    the pooled source-validation splits (never the best round on the target);
  * per target: mean ± sample std (ddof=1) over seeds; "mean over targets": for each seed the mean over the
    targets, then mean ± std over the seeds that have every target (DomainBed's convention);
  * strongest leakage: per run, the strongest value over victims, rounds (and, where stated, attacks and
    artifacts); then mean ± std over runs (targets x seeds). "Strongest" is the largest value except for
    error metrics (``higher`` in fdg_audit/metrics/registry.py), where the smallest error is the strongest attack;
  * bytes on the bus: ``traffic``.
Every file of a run folder is read through fdg_audit.store.runfolder.RunFolder; this module builds no path.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np

from ..store.ledger import Ledger, load_npz
from ..metrics import membership as MM
from ..metrics import stats as S
from ..metrics.registry import stronger
from ..store.runfolder import RunFolder
from .formatting import clean, num

LABEL_CHARS = 120
from .formatting import gkey


def stat(values) -> dict:
    """mean, sample std (ddof=1; NaN for one value or an infinite one, e.g. the epsilon of a run without noise) and
    count of the values that are not NaN."""
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    if not len(v):
        return dict(mean=float("nan"), std=float("nan"), n=0)
    finite = len(v) > 1 and np.isfinite(v).all()
    return dict(mean=float(v.mean()), std=float(v.std(ddof=1)) if finite else float("nan"), n=len(v))


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
    items: list = field(default_factory=list)       # dict(attack, run, path): per-item values of the scored rows
    attacks: dict = field(default_factory=dict)     # attacks.json: {label: {name, adversary, aux, consumes, outputs,
    #                                                         priors, budget, knows, rows}} (report/threat.py)
    scenarios: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    left_out: list = field(default_factory=list)    # attacks the scenarios' [[attacks]] tables exclude
    see_also: list = field(default_factory=list)    # the scenarios' see_also lines (where those attacks ran)
    reference: str = ""     # summary.json's "reference": the method (registered name) the Δ columns compare with
    published: dict = field(default_factory=dict)   # the scenario's [reference]: published numbers to print beside
    cache: dict = field(default_factory=dict)       # what the report computes once (scorecard.selections)

    @property
    def ok(self) -> list:
        return [r for r in self.runs if r.get("status") == "ok"]

    def group_of(self) -> dict:
        return {r["run"]: gkey(r) for r in self.ok}

    def groups(self) -> list:
        return list(dict.fromkeys(gkey(r) for r in self.ok))

    def label(self, g) -> str:
        """Display name of a group: method+variant, prefixed by the dataset when there are several; one visible line of
        at most LABEL_CHARS characters (``formatting.clean``)."""
        many = len({k[0] for k in self.groups()}) > 1
        return clean((f"{g[0]}/" if many else "") + f"{g[1]}{g[2]}", LABEL_CHARS)


def _reference(res: Results, refs: list) -> None:
    """The folders' reference method: all must record the same one, else no Δ (a note says why)."""
    named = set(refs)
    if len(named) == 1 and None not in named:
        res.reference = refs[0]
        return
    why = "record no reference method (written by an older fdg_audit)" if named == {None} else \
        f"record different reference methods ({', '.join(sorted(map(str, named)))}; None: none recorded)"
    res.notes.append(f"the run folders {why}: no differences to a reference are computed")


def load(run_dirs) -> Results:
    """Read one or many run folders. A run present in several folders is taken from the last one."""
    folders = [RunFolder(d) for d in run_dirs]
    res = Results([f.root for f in folders])
    chosen: dict[str, int] = {}
    per_root, refs = [], []
    for i, rf in enumerate(folders):
        s = rf.summary()
        res.scenarios.append(s.get("scenario", rf.root.name))
        res.published = rf.reference_values() or res.published
        out, see = rf.left_out()
        res.left_out = list(dict.fromkeys(res.left_out + out))
        res.see_also = list(dict.fromkeys(res.see_also + see))
        refs.append(s.get("reference") if isinstance(s.get("reference"), str) else None)
        for r in s["runs"]:
            if r["run"] in chosen and r.get("status") == "ok":
                res.notes.append(f"run {r['run']} appears in {folders[chosen[r['run']]].root} and {rf.root}: using "
                                 f"{rf.root}")
            if r.get("status") == "ok" or r["run"] not in chosen:
                chosen[r["run"]] = i
        per_root.append(s["runs"])
    _reference(res, refs)
    for i, rf in enumerate(folders):
        runs = {r for r, j in chosen.items() if j == i}
        curves = _curves(rf, runs)
        res.runs += [dict(r, root=str(rf.root), late_gain=S.late_gain(curves.get(r["run"], {})))
                     for r in per_root[i] if chosen[r["run"]] == i]
        for r in rf.leakage():
            if r["run"] not in runs:
                continue
            r = dict(r, value=num(r.get("value")), baseline=num(r.get("baseline")),
                     round=int(num(r["round"])) if r.get("round") not in ("", None) else -1)
            status = r.get("status") or "ok"
            measured = r["metric"] not in ("skipped", "failed") and not status.startswith(("skipped", "failed"))
            (res.leakage if measured else res.attack_notes).append(r)
        res.privacy += [dict(r, epsilon=num(r.get("epsilon")), delta=num(r.get("delta")),
                             # a folder written before privacy.csv had per-adversary rows: one row for every
                             # adversary and every kind (as its ε was then read)
                             adversary=r.get("adversary") or "server", headline=r.get("headline") in (None, "", "True"),
                             covers=str(r.get("covers") or "*").split())
                        for r in rf.privacy() if r.get("run", "") in runs]
        res.controls += [dict(c, root=str(rf.root)) for c in rf.controls()]
        res.attacks |= rf.attacks()
        if (rf / "messages.jsonl").exists():   # Ledger.open: a torn last line is dropped, damage is one line
            res.envelopes += [asdict(e) for e in Ledger.open(rf.root).envelopes if e.run in runs]
        res.recon += rf.result_files("recon", runs)
        res.mia += rf.result_files("mia", runs)
        res.items += rf.result_files("items", runs)
    return res


# ------------------------------------------------------------------------------------------- accuracy

def client_size(run: dict, victim: str) -> int | None:
    """The training-set size of client ``victim`` ("<domain>/<k>") in a run whose data config sets client_sizes."""
    sizes = (run.get("data") or {}).get("client_sizes") or []
    dom, _, k = victim.rpartition("/")
    return int(sizes[int(k)]) if dom and k.isdigit() and int(k) < len(sizes) else None


def sweep_keys(res: Results) -> list[str]:
    return list(dict.fromkeys(k for r in res.ok for k in (r.get("sweep") or {})))


def _clip01(ci: tuple) -> tuple:
    """(mean, lo, hi, n) with the interval cut to accuracy's range [0, 1] (NaN stays NaN)."""
    m, lo, hi, n = ci
    return m, lo if lo != lo else max(lo, 0.0), hi if hi != hi else min(hi, 1.0), n


ADAPTATION = "domain adaptation (target seen, unlabeled)"   # runs whose method's ``adaptation`` flag is set


def adaptation_note(res: Results) -> str:
    """One line naming the groups whose held-out domain took part unlabeled (RunInfo.adaptation), or ""."""
    gs = list(dict.fromkeys(gkey(r) for r in res.ok if r.get("adaptation")))
    return (f"{', '.join(res.label(g) for g in gs)}: {ADAPTATION}: the held-out domain's unlabeled images took part "
            "in training, so its held-out accuracy is not domain generalization") if gs else ""


def _curves(rf: RunFolder, runs: set) -> dict:
    """{run: {round: source-validation accuracy}} of the runs' evaluated rounds (metrics.csv)."""
    out = defaultdict(dict)
    for m in rf.csv("metrics.csv"):
        t, v = num(m.get("round")), num(m.get("source_val_acc"))
        if m.get("run") in runs and math.isfinite(t) and math.isfinite(v):
            out[m["run"]][int(t)] = v
    return out


def accuracy_table(res: Results) -> list[dict]:
    """One row per group: per-target and mean-over-targets held-out accuracy (mean ± std over seeds). Computed once
    per Results (``res.cache``): the accuracy section and page one read the same rows."""
    if "accuracy" not in res.cache:
        res.cache["accuracy"] = _accuracy_rows(res)
    return res.cache["accuracy"]


def _accuracy_rows(res: Results) -> list[dict]:
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
        pairs = [(t, v) for t in targets for v in acc[t].values()]
        rows.append(dict(dataset=g[0], method=g[1], variant=g[2], key=g, sweep=rs[0].get("sweep") or {},
                         targets={t: stat(acc[t].values()) for t in targets},
                         mean=stat([float(np.mean([acc[t][s] for t in targets])) for s in complete]),
                         ci=_clip01(S.t_interval([v for _, v in pairs], strata=[t for t, _ in pairs])),
                         converged=sum(r.get("converged") is not False for r in rs), rising=_rising(rs),
                         seeds=seeds, incomplete=[s for s in seeds if s not in complete], runs=len(rs),
                         num_classes=rs[0].get("num_classes"), adaptation=any(r.get("adaptation") for r in rs),
                         extra={k: (stat(v), S.t_interval(v)) for k, v in _extras(rs).items()}))
    for r, p in zip(rows, S.holm([r["rising"][2] for r in rows])):
        r["rising"] = r["rising"][:2] + (p,)
    return rows


def still_rising(row: dict) -> bool:
    """An accuracy row whose runs' source validation still rises at their end (``_rising``, Holm p below 0.05)."""
    return row["rising"][2] < 1 - S.LEVEL


def not_converged(row: dict) -> bool:
    """An accuracy row with a run selected in its last 10% of rounds, or whose group still rises at its end."""
    return row["converged"] < row["runs"] or still_rising(row)


def _rising(rs: list[dict]) -> tuple[int, int, float]:
    """(runs whose source validation still gains over their last 10% of evaluations, runs with a gain, the one-sided
    sign-flip p-value that the group's gains are positive; Holm-adjusted over the table's rows by the caller)."""
    g = [r["late_gain"] for r in rs if math.isfinite(r.get("late_gain", float("nan")))]
    return sum(x > 0 for x in g), len(g), S.signflip_p(g, "greater") if len(g) >= S.MIN_RUNS else float("nan")


def _extras(rs: list[dict]) -> dict:
    """{metric: values over the runs} of what the method reports itself at the selected round (Server.extra_metrics,
    RunInfo.extra), for metrics every run of the group has."""
    keys = [k for k in (rs[0].get("extra") or {}) if all(k in (r.get("extra") or {}) for r in rs)]
    return {k: [float(r["extra"][k]) for r in rs] for k in keys}


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


def membership_scores(res: Results) -> dict:
    """{attack: {(group, output variant): dict(scores, labels, models)}} from mia/<attack>/<run>.npz: per run,
    victim and variant the scores of the last round attacked (the final model), calibrated within their target
    model as the scorecard's pool is (``metrics.membership.calibrate``), pooled over the group's runs and victims
    (``models``: the (run, victim) pairs pooled)."""
    gof = res.group_of()
    out = defaultdict(lambda: defaultdict(lambda: dict(scores=[], labels=[], models=set())))
    for m in res.mia:
        if m["run"] not in gof:
            continue
        z = load_npz(m["path"], m["root"])
        if "score" not in z:
            continue
        s, y = z["score"].ravel(), z["member"].ravel()
        victim, variant, rnd = z["victim"].astype(str), z["variant"].astype(str), z["round"]
        for v, var in dict.fromkeys(zip(victim, variant)):
            sel = (victim == v) & (variant == var)
            sel &= rnd == rnd[sel].max()
            d = out[m["attack"]][(gof[m["run"]], var or "main")]
            d["scores"].append(MM.calibrate(s[sel], np.zeros(int(sel.sum()))))
            d["labels"].append(y[sel])
            d["models"].add((m["run"], v))
    return {a: {k: dict(scores=np.concatenate(d["scores"]), labels=np.concatenate(d["labels"]).astype(int),
                        models=d["models"]) for k, d in by.items()} for a, by in out.items()}


# ------------------------------------------------------------------------------------------- privacy

def privacy_table(res: Results) -> dict:
    """{group: dict(epsilon=stat, delta)} from privacy.csv: per run the largest headline ε (each mechanism's budget
    against the adversary it is configured for; the worst party's, by the end of training), then over runs. The
    leakage cells carry the ε against their own adversary (``epsilon_against``)."""
    gof = res.group_of()
    per_run = {}
    for r in res.privacy:
        if r["run"] in gof and r["headline"] and not math.isnan(r["epsilon"]):
            if r["run"] not in per_run or r["epsilon"] > per_run[r["run"]]["epsilon"]:
                per_run[r["run"]] = r
    by = defaultdict(list)
    for run, r in per_run.items():
        by[gof[run]].append(r)
    return {g: dict(epsilon=stat(r["epsilon"] for r in rs), delta=max(r["delta"] for r in rs))
            for g, rs in by.items()}


def final_privacy(res: Results) -> dict:
    """{(run, adversary): [the last privacy.csv row of each (party, mechanism)]}, totals left out."""
    last = {}
    for r in res.privacy:
        key = (r["run"], r["adversary"], r["party"], r["mechanism"])
        if r["mechanism"] != "total" and (key not in last or int(r["round"]) >= int(last[key]["round"])):
            last[key] = r
    out = defaultdict(list)
    for (run, adv, _, _), r in last.items():
        out[(run, adv)].append(r)
    return out


def outside_dp(final: dict, run: str, adversary: str, kind: str) -> bool:
    """Whether ``run`` has DP mechanisms (``final``: final_privacy) but none of them covers artifacts of ``kind``
    against ``adversary`` (e.g. a bank of image statistics when client-level DP noises only the weights)."""
    rows = final.get((run, adversary), final.get((run, "server"), ()))
    return bool(rows) and not any(kind in r["covers"] or "*" in r["covers"] for r in rows)


def epsilon_against(final: dict, runs, adversary: str, kinds) -> float:
    """The ε that holds against ``adversary`` for artifacts of ``kinds`` over ``runs`` (``final``: final_privacy):
    per run the largest final ε of any party's mechanism that covers the kind, inf where a kind is outside every
    mechanism; then the largest over the runs and kinds."""
    worst = 0.0
    for run in runs:
        for kind in kinds:
            e = [r["epsilon"] for r in final.get((run, adversary), final.get((run, "server"), ()))
                 if kind in r["covers"] or "*" in r["covers"]
                 and not math.isnan(r["epsilon"])]
            worst = max(worst, max(e) if e else math.inf)
    return worst
