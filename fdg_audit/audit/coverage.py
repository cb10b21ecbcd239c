"""Coverage: every artifact kind a run sends has a row, with the strongest attack that measured it or "not attacked"
and why. At plan time (``plan_lines``): which kinds each method declares and which attacks will read them, a warning
for a kind no attack reads. After the attacks (``write_coverage``): ``coverage.csv`` in the run folder, from the
ledger (what was sent), attacks.json (what each attack reads) and leakage.csv (what it measured).

coverage.csv columns (one row per dataset, method and kind): ``dataset, method, kind``, ``senders`` ("client",
"server" or "client+server": who sent it), ``runs`` (runs that sent it), ``status`` ("measured" or "not attacked: <reason>"),
``attack, output, metric`` (the strongest measurement: the largest mean value above its baseline over the rows of
``HEADLINE`` metrics, each against the scorecard's baseline: a reconstruction, whose cell is scored against the
strongest free guess, counts by its re-identification only, not by rows scored against chance such as its label
accuracy), ``value, baseline`` (means over the runs that have them), ``n`` (those runs), ``attacks`` (every
attack that measured the kind, ";"-joined)."""
from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from pathlib import Path

from ..metrics.registry import harm_of
from ..store.ledger import Ledger, atomic_write
from ..store.runfolder import RunFolder

HEADLINE = ("reid", "auc", "class_balanced_acc", "domain_balanced_acc", "label_acc", "label_dist_acc",
            "label_existence_f1")   # metrics in [0, 1], higher = more leakage: comparable as value - baseline
FIELDS = ["dataset", "method", "kind", "senders", "runs", "status", "attack", "output", "metric", "value", "baseline",
          "n", "attacks"]
UNSENT = {"public_aux"}   # the core's record of the server's public data (size and hash), not a party's message


def reads(consumes, ignores, kind: str) -> bool:
    """Whether an attack that ``consumes`` these kinds (``"*"``: all but ``ignores``) reads ``kind``."""
    return kind not in ignores if "*" in consumes else kind in consumes


def plan_lines(methods: dict, attacks: dict) -> tuple[list[str], list[str]]:
    """``methods`` {label: declared kinds}, ``attacks`` {label: (consumes, ignores)}: one line per method naming each
    kind and the attacks that read it, and one warning per kind no attack reads."""
    lines, warns = [], []
    for m, kinds in methods.items():
        parts = []
        for k in kinds:
            who = [a for a, (c, i) in attacks.items() if reads(c, i, k)]
            parts.append(f"{k} ({', '.join(who) if who else 'NOT ATTACKED'})")
            if not who:
                warns.append(f"warning: method {m} sends {k!r} and no attack of this plan reads it: it will show as "
                             f"\"not attacked\"; add an attack that consumes it, e.g. attacks = \"all\" (every registered "
                             f"attack, including those that read every kind)")
        lines.append(f"coverage: {m} sends {'; '.join(parts)}")
    return lines, warns


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def coverage_rows(root) -> list[dict]:
    """The coverage table of a run folder (see the module docstring)."""
    folder = RunFolder(root)
    runs = folder.runs()
    described = folder.attacks()
    sent, senders = defaultdict(set), defaultdict(set)   # (dataset, method, kind) -> runs, sender roles
    for e in Ledger.open(root).stream():
        run = runs.get(e.run)
        if run is None or e.kind in UNSENT or e.sender == "public":
            continue
        key = (run.dataset, run.method, e.kind)
        sent[key].add(e.run)
        senders[key].add("server" if e.sender == "server" else "client")
    leak = folder.leakage() if (Path(root) / "leakage.csv").exists() else []
    by = defaultdict(list)       # (run, kind) -> leakage rows
    for r in leak:
        by[(r["run"], r["artifact"])].append(r)
    out = []
    for (ds, method, kind), rs in sorted(sent.items()):
        rows = [r for run in sorted(rs) for r in by[(run, kind)]]
        ok = [r for r in rows if r["status"] == "ok" and r["victim"] != "pooled"]
        row = dict(dataset=ds, method=method, kind=kind, senders="+".join(sorted(senders[(ds, method, kind)])),
                   runs=len(rs), attack="", output="", metric="",
                   value="", baseline="", n="", attacks=";".join(sorted({r["attack"] for r in ok})))
        cells = defaultdict(lambda: defaultdict(list))   # (attack, output, metric) -> run -> (value, baseline)
        for r in ok:
            if r["metric"] in HEADLINE and not math.isnan(_num(r["value"])) and \
                    (not r.get("free_guess") or harm_of(r["metric"]) == "reconstruction"):   # the scorecard's baseline
                cells[(r["attack"], r["output"], r["metric"])][r["run"]].append((_num(r["value"]), _num(r["baseline"])))
        best = None
        for key, per_run in cells.items():
            vals = [sum(v for v, _ in x) / len(x) for x in per_run.values()]
            bases = [sum(b for _, b in x) / len(x) for x in per_run.values()]
            v, b = sum(vals) / len(vals), sum(bases) / len(bases)
            gain = v - (0.0 if math.isnan(b) else b)
            if best is None or gain > best[0]:
                best = (gain, key, v, b, len(vals))
        if best:
            _, (a, o, m), v, b, n = best
            row.update(status="measured", attack=a, output=o, metric=m, value=f"{v:.4g}", baseline=f"{b:.4g}", n=n)
        elif ok:
            row.update(status="measured", attack=ok[0]["attack"], output=ok[0]["output"], metric=ok[0]["metric"],
                       value=ok[0]["value"], baseline=ok[0]["baseline"], n=1)
        else:
            row["status"] = "not attacked: " + _reason(kind, rows, described)
        out.append(row)
    return out


def _reason(kind: str, rows: list, described: dict) -> str:
    if rows:
        first = rows[0]["status"]
        return f"{rows[0]['attack']}: {first}" if first != "ok" else "only pooled rows"
    who = [label for label, d in described.items() if reads(d["consumes"], d.get("ignores", ()), kind)]
    if not who:
        left = [label for label, d in described.items() if "*" in d["consumes"] and kind in d.get("ignores", ())]
        return (f"{', '.join(left)} leaves it out (its skip setting)" if left else
                "no attack of this run reads this kind")
    return (f"{', '.join(who)} read it but did not run on these runs (their targets/seeds/datasets filters, their "
            f"adversary's view or the store policy)")


def write_coverage(root) -> Path:
    """Write coverage.csv into the run folder (atomically) and return its path."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(coverage_rows(root))
    path = Path(root) / "coverage.csv"
    atomic_write(path, buf.getvalue())
    return path


JOB_S = 6.0   # CPU s of any attack job beyond the attack's own work: its worker (under bubblewrap a fresh interpreter
#               importing torch), its view and its scoring: 6.1-6.7 CPU s per job of norm_stats_domain and
#               mia_trajectory on the main job (draw 2, idle; bench/attack_cost.py --against)


def estimate(attacks: dict, runs: list[dict]) -> dict[str, float | None]:
    """The cost guard's estimate, in CPU seconds, of each attack that will run on the plan: ``attacks`` {label:
    Described}, ``runs`` the plan's runs (each with its method's kinds as ``kinds``, ``clients`` {name: images},
    ``target``, ``seed``, ``dataset`` and ``steps`` (n -> local steps of a client of n images)). An attack counts on a
    run when it reads a kind the method declares and its filters want the run: ``JOB_S`` and its ``"run"`` cost per
    run, and per victim (at most ``max_victims``) ``"victim"`` + images (capped at ``"max_images"``) x (``"image"`` +
    ``"image_step"`` x the victim's local steps), plus its control job (``JOB_S`` + ``"control"``); all from
    ``Attack.cost()``. An attack whose victim is a group of clients (a curious client's view of the others' mean)
    says so with ``"victims"`` (victims per run, at most) and ``"parties"`` (clients modelled per victim, each with
    the images of a client of that size; 0: every other client of the run). None: the attack declares no cost (not
    estimated, never counted as 0). An attack that reads no run of the plan is left out."""
    out = {}
    for label, d in attacks.items():
        c, p = d.cost, d.p
        mine = [r for r in runs if any(reads(d.consumes, d.ignores, k) for k in r["kinds"])
                and not ((p.targets and r["target"] not in p.targets) or (p.seeds and r["seed"] not in p.seeds)
                         or (p.datasets and r["dataset"] not in p.datasets))]
        if not mine:
            continue
        if not c:
            out[label] = None
            continue
        cap, total = int(c.get("max_images", 0)), JOB_S + c.get("control", 0.0)
        for r in mine:
            sizes = sorted(r["clients"].values())
            victims = sizes[:p.max_victims] if p.max_victims else sizes
            victims = victims[:int(c["victims"])] if "victims" in c else victims
            parties = min(int(c.get("parties") or len(sizes) - 1), len(sizes) - 1) if "parties" in c else 1
            total += JOB_S + c.get("run", 0.0) + sum(
                c.get("victim", 0.0) + parties * (min(n, cap) if cap else n)
                * (c.get("image", 0.0) + c.get("image_step", 0.0) * r["steps"](n)) for n in victims)
        out[label] = total
    return out


def coverage_markdown(root) -> str:
    """A self-contained report section from coverage.csv (written by ``write_coverage``): one line per method and kind,
    "not attacked" in capitals so it never reads like "no leak". "" when the folder has no coverage.csv."""
    path = Path(root) / "coverage.csv"
    if not path.exists():
        return ""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = ["## Coverage: every kind sent", "",
           "Each artifact kind a method sent, and the strongest attack that measured it (mean over runs; value vs its "
           "baseline), or why none did.", "",
           "| data set | method | kind | sent by | strongest measurement | value vs baseline (n runs) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] == "measured":
            what = f"{r['attack']} {r['output']} {r['metric']}".replace("  ", " ")
            val = f"{r['value']} vs {r['baseline']} ({r['n']})"
        else:
            what, val = "**NOT ATTACKED**: " + r["status"].removeprefix("not attacked: "), "—"
        out.append(f"| {r['dataset']} | {r['method']} | {r['kind']} | {r['senders']} | {what} | {val} |")
    return "\n".join(out) + "\n"
