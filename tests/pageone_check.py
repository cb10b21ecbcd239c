"""Checks of a written report folder (issue 46), shared by test_pageone.py and the main scenario's smoke test:

* ``page_one(md)``: page one's sentences (between "## The answer" and its figure).
* ``untraced(folder)``: every number on page one that is not in scorecard.csv's row its link names (or that row's
  comparison in comparisons.csv) at the precision printed, with the same n; [] when every number traces.
* ``disagreements(folder)``: the comparisons to which two views (comparisons.csv, scorecard.csv, report.md's
  comparison table, page one) give different Holm p-values or calls; [] when they agree.
"""
import csv
import re
from pathlib import Path

from fdg_audit.report.formatting import human_bytes

LINK = re.compile(r"\[↗\]\(#([-\w.]+)\)")
NUMBER = re.compile(r"(?<![\w.])([+\-−±]?)(\d+(?:\.\d+)?)(%| [kMG]?B\b)?")
RUNS = re.compile(r"\((\d+) runs?\b")
# what page one may say that is not a measured number: the 95% of an interval, the false-positive rates at which
# membership is read and their chance, client sizes ("clients of 4 images", "at 4, 16 and 64 images"), the paired
# runs a test needs
FIXED = re.compile(r"at 95%|\d+(?:\.\d+)?% false positives|chance: \d+(?:\.\d+)?%|clients of \d+ images?|"
                   r"from \d+ images|at (?:\d+, )*\d+(?: and \d+)? images|Holm correction over the \d+ \w+ comparisons|"
                   r"needs 3 paired runs")
HOLM_N = re.compile(r"Holm correction over the (\d+) (\w+) comparisons")


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def page_one(md: str) -> list[str]:
    body = md.split("## The answer", 1)[1].split("\n## ", 1)[0]
    text = " ".join(line for line in body.splitlines() if line.strip() and not line.startswith("!["))
    text = text.split("How to read it:")[0].split("Top row:")[0]
    return [s.strip() for s in re.split(r"(?<=\.)\s+(?=[A-Z])", text.strip()) if s.strip()]


def _values(row: dict, comp: dict | None) -> list[float]:
    out = []
    for d in (row, comp or {}):
        for k, v in d.items():
            try:
                out.append(float(v))
            except (TypeError, ValueError):   # runs_clear "4/5": the runs above baseline of n
                out += [float(x) for x in v.split("/")] if k == "runs_clear" and v else []
    return out


def untraced(folder) -> list[str]:
    folder = Path(folder)
    rows = {r["id"]: r for r in _csv(folder / "scorecard.csv")}
    comps = {c["id"]: c for c in _csv(folder / "comparisons.csv")}
    bad = []
    family = lambda harm: sum(c["harm"] == harm and c["call"] not in ("not resolvable", "not testable")  # noqa: E731
                              for c in comps.values())
    for s in page_one((folder / "report.md").read_text()):
        bad += [f"Holm family of {n} {h}, comparisons.csv has {family(h)}" for n, h in HOLM_N.findall(s)
                if int(n) != family(h)]
        parts = LINK.split(FIXED.sub(" ", s))
        if len(parts) == 1:
            bad += [f"no row linked: {s}"] if NUMBER.search(s) else []
            continue
        segments = [(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        segments[-1] = (segments[-1][0] + parts[-1], segments[-1][1])     # trailing words: the last row's
        for text, rid in segments:
            if rid not in rows:
                bad.append(f"{rid}: no such row in scorecard.csv")
                continue
            row = rows[rid]
            comp = comps.get(row.get("comparison") or "")
            ns = {row.get("n_runs"), row.get("diff_n"), (comp or {}).get("n")} - {"", None}
            said_n = RUNS.findall(text)
            if not said_n or not set(said_n) <= ns:
                bad.append(f"{rid}: n {said_n} not the row's {sorted(ns)}")
            vals = _values(row, comp)
            for m in NUMBER.finditer(RUNS.sub(" ", text)):
                sign, digits, unit = m.groups()
                unit = unit or ""
                if unit.endswith("B"):
                    ok = row.get("bytes") and human_bytes(float(row["bytes"])) == digits + unit
                elif unit == "%":
                    ok = row.get("bytes_vs_ref") and f"{float(row['bytes_vs_ref']):.0f}" == digits
                else:
                    d = len(digits.split(".")[1]) if "." in digits else 0
                    x = float(digits) * (-1 if sign in "-−" and sign else 1)
                    ok = any(f"{v:.{d}f}" == f"{x:.{d}f}" or (sign == "±" and f"{abs(v):.{d}f}" == digits)
                             for v in vals)
                if not ok:
                    bad.append(f"{rid}: {m.group(0).strip()} is not in its row")
    return bad


def _p(x: str) -> str:
    try:
        return f"{float(x):.3g}"
    except ValueError:
        return "—"


def disagreements(folder) -> list[str]:
    """Comparison id -> the (p, call) each view gives, where they are not all the same."""
    folder = Path(folder)
    seen: dict[str, set] = {}
    for c in _csv(folder / "comparisons.csv"):
        seen.setdefault(c["id"], set()).add((_p(c["p_holm"]), c["call"]))
    rows = {r["id"]: r for r in _csv(folder / "scorecard.csv")}
    for r in rows.values():
        if r.get("comparison"):
            seen.setdefault(r["comparison"], set()).add((_p(r["diff_p_holm"]), r["diff_call"]))
    md = (folder / "report.md").read_text()
    for line in md.splitlines():      # report.md's comparison table: | id | ... | p (Holm) | call |
        m = re.match(r"\| ([-\w.]+) \|.*\| ([^|]*) \| ([^|]*) \|$", line)
        if m and m.group(1) in seen:
            seen[m.group(1)].add((_p(m.group(2).strip()), m.group(3).strip()))
    for s in page_one(md):            # page one: "(n runs, CALL) [link]": the call of the linked row's comparison
        for text, rid in zip(LINK.split(s)[::2], LINK.findall(s)):
            r = rows.get(rid, {})
            said = re.findall(r"runs?, ([a-z ]+)\)\s*$", text)
            if r.get("comparison") in seen and said and said[0] in CALLS:
                seen[r["comparison"]].add((_p(r["diff_p_holm"]), said[0]))
    return [f"{k}: {sorted(v)}" for k, v in seen.items() if len(v) > 1]


CALLS = {"distinguishable", "not distinguishable", "borderline", "inconclusive", "not testable", "not resolvable"}
