"""Reports: the scorecard first and consistent with scorecard.csv, tables checked against hand-made run folders,
bytes by kind, files and links."""
import csv
import json
import math
import re

import numpy as np
import pytest

from fdg_audit.cli import main
from fdg_audit.errors import UserError
from fdg_audit.metrics import stats as S
from fdg_audit.report import headline, write_report
from fdg_audit.report import tables as T
from fdg_audit.report.formatting import fmt
from fdg_audit.report.traffic import bytes_summary, bytes_table
from fdg_audit.store.runfolder import RunFolder

LEAK_FIELDS = ["run", "dataset", "method", "variant", "target", "seed", "attack", "adversary", "artifact", "round",
               "victim", "output", "metric", "value", "baseline", "status"]
CLIENTS = {"A": ["B", "C"], "B": ["A", "C"]}   # target -> source clients


def run_id(method, variant, target, seed, ds="digits"):
    return f"{ds}/{method}{variant}/{target}/s{seed}"


def write_csv(path, rows, fields=None):
    fields = fields or list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def env(run, rnd, sender, receiver, kind, nbytes):
    return dict(run=run, method="m", round=rnd, phase="p", seq=0, sender=sender, receiver=receiver, kind=kind,
                arrays=[], scalars=[], wire_bytes=nbytes, sha256="0" * 64, filters=[])


def fabricate(root, methods=(("fedavg", "", {}), ("feddg", "", {})), seeds=(0, 1, 2), targets=("A", "B"),
              rounds=2, acc=None, drop=(), leakage=(), extra=True, reference="fedavg", curve=None):
    """A run folder written by hand. ``acc(method, variant, target, seed)`` gives target_acc, ``curve(method,
    target, seed, round)`` the source-validation accuracy of the rounds after 0."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    acc = acc or (lambda m, v, t, s: float(rng.uniform(0.2, 0.9)))
    runs, envs, metrics = [], [], []
    for m, var, sweep in methods:
        for t in targets:
            for s in seeds:
                rid = run_id(m, var, t, s)
                if rid in drop:
                    continue
                a = acc(m, var, t, s)
                runs.append(dict(run=rid, dataset="digits", method=m, variant=var, target=t, seed=s, sweep=sweep,
                                 params={"rounds": rounds}, plugin=m, status="ok", target_acc=a, source_val_acc=0.9,
                                 selected_round=rounds, final_target_acc=a, seconds=1.0, clients=CLIENTS[t],
                                 num_classes=10))
                metrics += [dict(run=rid, round=r, target_acc=a, **({"source_val_acc": curve(m, t, s, r)}
                                                                    if curve and r else {}))
                            for r in range(rounds + 1)]
                for c in CLIENTS[t]:
                    envs.append(env(rid, 0, c, "server", "n_samples", 40))
                    if m == "feddg":
                        envs.append(env(rid, 0, c, "server", "amplitude_bank", 1000))
                        envs.append(env(rid, 0, "server", c, "amplitude_bank", 1000))
                    for r in range(1, rounds + 1):
                        envs.append(env(rid, r, c, "server", "weights", 300))
                        envs.append(env(rid, r, "server", c, "weights", 300))
    runs.append(dict(run=run_id("fedavg", "", "A", 9), dataset="digits", method="fedavg", variant="", target="A",
                     seed=9, sweep={}, params={}, plugin="fedavg", status="failed", error="RuntimeError: boom"))
    (root / "summary.json").write_text(json.dumps({"scenario": "fab", "reference": reference, "runs": runs}))
    write_csv(root / "metrics.csv", metrics)
    (root / "messages.jsonl").write_text("".join(json.dumps(e) + "\n" for e in envs))
    if leakage:
        write_csv(root / "leakage.csv", leakage, LEAK_FIELDS)
    if extra:
        (root / "controls.json").write_text(json.dumps([dict(attack="pr", name="toy", metric="psnr", value=90.0,
                                                             threshold=60.0, positive=True, passed=True)]))
        ok = [r for r in runs if r["status"] == "ok"]
        rec = root / "recon" / "pr"
        rec.mkdir(parents=True)
        x = rng.uniform(0, 1, (4, 1, 8, 8)).astype(np.float32)
        for r in ok[:2]:
            np.savez(rec / f"{r['run'].replace('/', '__')}__{r['clients'][0]}__main.npz", truth=x,
                     recon=np.clip(x + 0.1 * rng.standard_normal(x.shape), 0, 1), baseline=np.full_like(x, x.mean()))
        mia = root / "mia" / "loss"
        mia.mkdir(parents=True)
        for r in ok:
            n = 50
            member = np.r_[np.ones(n), np.zeros(n)].astype(np.int8)
            score = np.r_[rng.normal(1, 1, n), rng.normal(0, 1, n)]
            np.savez(mia / (r["run"].replace("/", "__") + ".npz"), score=np.r_[score, score - 5],
                     member=np.r_[member, member], victim=np.array([r["clients"][0]] * (4 * n)),
                     variant=np.array(["loss"] * (4 * n)), round=np.r_[np.full(2 * n, 2), np.full(2 * n, 1)])
        priv = [dict(run=r["run"], party=c, mechanism="dp_sgd", round=k, epsilon=k * (1 + i), delta=1e-5)
                for r in ok if r["method"] == "feddg" for i, c in enumerate(r["clients"]) for k in (1, 2)]
        write_csv(root / "privacy.csv", priv)
    return root


def leak_row(run, attack, artifact, victim, rnd, metric, value, baseline, status="ok", output="main"):
    m, t, s = run.split("/")[1], run.split("/")[2], int(run.split("/")[3][1:])
    return dict(run=run, dataset="digits", method=m, variant="", target=t, seed=s, attack=attack, adversary="server",
                artifact=artifact, round=rnd, victim=victim, output=output, metric=metric, value=value,
                baseline=baseline, status=status)


def md_table(text, first_header, after="# "):
    """Rows (dicts by header) of the first markdown table after the line starting with ``after`` whose header
    starts with ``| first_header |``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(after))
    i = next(i for i, line in enumerate(lines) if i > start and line.startswith(f"| {first_header} |"))
    head = [c.strip() for c in lines[i].strip("|").split("|")]
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(head, [c.strip() for c in line.strip("|").split("|")])))
    return rows


@pytest.fixture
def psnr_headline(monkeypatch):
    """The scorecard's mechanics on a dB headline: aligned PSNR as the reconstruction card metric (the registry's
    headline is re-identification; the scorecard scores a harm by whichever metric the registry marks ``card``)."""
    import dataclasses

    from fdg_audit.metrics import registry as R
    for m, card in (("psnr", True), ("reid", False)):
        monkeypatch.setitem(R.METRICS, m, dataclasses.replace(R.METRICS[m], card=card))


def parse_pm(cell):
    m = re.match(r"([-\d.]+)(?: ± ([-\d.]+))?", cell)
    return float(m.group(1)), (float(m.group(2)) if m.group(2) else float("nan"))


# ---------------------------------------------------------------- accuracy

def test_accuracy_mean_std_over_seeds_grouped_by_method_target_and_sweep(tmp_path):
    methods = [("fedavg", "[lr=0.1]", {"train.lr": 0.1}), ("fedavg", "[lr=0.5]", {"train.lr": 0.5}),
               ("feddg", "[lr=0.1]", {"train.lr": 0.1}), ("feddg", "[lr=0.5]", {"train.lr": 0.5})]
    drop = {run_id("feddg", "[lr=0.5]", "B", 2)}            # seed 2 lacks target B for this variant
    root = fabricate(tmp_path / "r", methods=methods, drop=drop, extra=False)
    summary = json.loads((root / "summary.json").read_text())["runs"]
    acc = {(r["method"], r["variant"], r["target"], r["seed"]): r["target_acc"] for r in summary if r["status"] == "ok"}
    md = write_report([root], tmp_path / "out").read_text()
    rows = md_table(md, "method", after="## Held-out accuracy")
    assert len(rows) == 4 and {(r["method"], r["lr"]) for r in rows} == \
        {("fedavg", "0.1"), ("fedavg", "0.5"), ("feddg", "0.1"), ("feddg", "0.5")}
    for r in rows:
        var = f"[lr={r['lr']}]"
        for t in ("A", "B"):
            v = [a for (m, vv, tt, s), a in acc.items() if (m, vv, tt) == (r["method"], var, t)]
            mean, std = parse_pm(r[t])
            assert mean == pytest.approx(np.mean(v), abs=6e-4) and std == pytest.approx(np.std(v, ddof=1), abs=6e-4)
        seeds = [s for s in (0, 1, 2) if all((r["method"], var, t, s) in acc for t in "AB")]
        per_seed = [np.mean([acc[(r["method"], var, t, s)] for t in "AB"]) for s in seeds]
        mean, std = parse_pm(r["mean over targets"])
        assert mean == pytest.approx(np.mean(per_seed), abs=6e-4)
        assert std == pytest.approx(np.std(per_seed, ddof=1), abs=6e-4)
        assert ("lack a target" in r["mean over targets"]) == (r["method"] == "feddg" and r["lr"] == "0.5")
    assert "failed: `digits/fedavg/A/s9`" in md                 # the failed run is listed, not averaged
    table = T.accuracy_table(T.load([root]))
    assert all(row["runs"] == 6 - (row["key"] == ("digits", "feddg", "[lr=0.5]")) for row in table)


def test_a_group_still_rising_at_its_end_is_not_converged_whatever_round_was_selected(tmp_path):
    """Every run below is marked converged (its selected round came early). FedAvg's source validation still rises
    through the last 10% of its rounds in all 6 runs (one-sided sign-flip p 1/64, Holm over 2 rows 0.03): not
    converged. FedDG's is a noisy plateau: its late gains have both signs and it stays converged."""
    noise = np.random.default_rng(3).normal(0, 0.004, (2, 3, 21))

    def curve(m, t, s, r):
        return 0.9 + 0.002 * r if m == "fedavg" else 0.95 + noise["AB".index(t), s, r]
    root = fabricate(tmp_path / "r", rounds=20, curve=curve, extra=False)
    assert S.late_gain({r: curve("fedavg", "A", 0, r) for r in range(1, 21)}) == pytest.approx(0.004)
    assert S.late_gain({10: 0.5, 20: 0.6, 30: 0.8}) == pytest.approx(0.2)   # every 10th round evaluated: 30 vs 20
    assert math.isnan(S.late_gain({20: 0.5}))
    rows = {r["method"]: r for r in T.accuracy_table(T.load([root]))}
    assert rows["fedavg"]["converged"] == rows["feddg"]["converged"] == 6
    up, n, p = rows["fedavg"]["rising"]
    assert (up, n) == (6, 6) and p == pytest.approx(2 / 64)
    up, n, p = rows["feddg"]["rising"]
    assert 0 < up < n == 6 and p > 0.05
    md = write_report([root], tmp_path / "out").read_text()
    cells = {r["method"]: r["converged"] for r in md_table(md, "method", after="## Held-out accuracy")}
    assert cells["fedavg"].startswith("6/6; rising at the end 6/6") and cells["fedavg"].endswith("NOT CONVERGED")
    assert "NOT CONVERGED" not in cells["feddg"]
    answer = md.split("## The answer")[1].split("\n## ")[0]                 # page one says it beside the accuracy
    assert "FedAvg on digits had NOT CONVERGED" in answer and answer.count("NOT CONVERGED") == 1


def test_single_seed_has_no_std(tmp_path):
    root = fabricate(tmp_path / "r", seeds=(0,), acc=lambda m, v, t, s: 0.5 if t == "A" else 0.7, extra=False)
    row = T.accuracy_table(T.load([root]))[0]
    assert row["mean"]["mean"] == pytest.approx(0.6) and row["mean"]["n"] == 1 and math.isnan(row["mean"]["std"])
    assert fmt(row["mean"]) == "0.600"


# ---------------------------------------------------------------- leakage

def test_leakage_strongest_over_victims_and_rounds_then_over_runs(tmp_path):
    r0, r1 = run_id("feddg", "", "A", 0), run_id("feddg", "", "A", 1)
    a0 = run_id("fedavg", "", "A", 0)
    rows = [leak_row(r0, "pr", "amplitude_bank", "B", 0, "psnr", 20.0, 10.0),
            leak_row(r0, "pr", "amplitude_bank", "C", 0, "psnr", 24.0, 12.0),      # strongest of run 0
            leak_row(r1, "pr", "amplitude_bank", "B", 0, "psnr", 30.0, 11.0),      # strongest of run 1
            leak_row(r1, "pr", "amplitude_bank", "C", 0, "psnr", 18.0, 9.0),
            leak_row(r0, "size", "n_samples", "B", 0, "n_samples_rel_error", 0.3, float("nan")),
            leak_row(r0, "size", "n_samples", "C", 0, "n_samples_rel_error", 0.1, float("nan")),  # lower = stronger
            leak_row(r1, "size", "n_samples", "B", 0, "n_samples_rel_error", 0.5, float("nan")),
            leak_row(a0, "mia", "weights", "B", 1, "auc", 0.7, 0.5, "not measurable (control failed)"),
            leak_row(a0, "mia", "weights", "B", 2, "auc", 0.8, 0.5, "not measurable (control failed)"),
            leak_row(a0, "pr", "", "", "", "skipped", float("nan"), float("nan"), "skipped: no amplitude bank")]
    root = fabricate(tmp_path / "r", leakage=rows, extra=False)
    res = T.load([root])
    assert len(res.attack_notes) == 1 and all(r["metric"] != "skipped" for r in res.leakage)
    tab = {(r["method"], r["attack"], r["metric"]): r for r in T.leakage_table(res)}
    psnr = tab[("feddg", "pr", "psnr")]
    assert psnr["value"]["mean"] == pytest.approx(27.0) and psnr["value"]["std"] == pytest.approx(np.std([24, 30], ddof=1))
    assert psnr["baseline"]["mean"] == pytest.approx(11.5)          # baselines of the selected rows (12, 11)
    assert psnr["top"]["value"] == 30.0 and psnr["top"]["victim"] == "B" and psnr["runs"] == 2
    err = tab[("feddg", "size", "n_samples_rel_error")]
    assert err["value"]["mean"] == pytest.approx(0.3) and err["top"]["value"] == 0.1
    mia = tab[("fedavg", "mia", "auc")]
    assert mia["value"]["mean"] == 0.8 and mia["status"].startswith("not measurable")
    md = write_report([root], tmp_path / "out").read_text()
    lrows = md_table(md, "method", after="## Leakage")
    assert {(r["method"], r["attack"], r["metric"]) for r in lrows} == set(tab)
    p = next(r for r in lrows if r["metric"] == "psnr")
    assert parse_pm(p["strongest (mean ± std over runs)"])[0] == 27.0 and p["Δ vs baseline"] == "+15.5"
    assert "skipped: no amplitude bank (1×)" in md


# ---------------------------------------------------------------- bytes

def test_bytes_per_round_by_kind_direction_and_client_kinds(tmp_path):
    root = fabricate(tmp_path / "r", seeds=(0, 1), rounds=4, extra=False)
    res = T.load([root])
    by = bytes_table(res.envelopes, res.ok)
    avg, dg = by[("digits", "fedavg", "")], by[("digits", "feddg", "")]
    assert avg["runs"] == 4 and set(avg["kinds"]) == {("n_samples", "up"), ("weights", "up"), ("weights", "down")}
    # two clients per run: round 0 n_samples 2x40 once; weights 2x300 each way per round, for 4 rounds
    assert avg["kinds"][("n_samples", "up")] == dict(once=80, per_round=0, total=80)
    assert avg["kinds"][("weights", "up")] == dict(once=0, per_round=600, total=2400)
    assert (avg["once"], avg["per_round"], avg["total"]) == (80, 1200, 4880)
    assert dg["kinds"][("amplitude_bank", "down")]["once"] == 2000 and dg["once"] == 4080
    assert dg["clients"] == {c: ["amplitude_bank", "n_samples", "weights"] for c in "ABC"}
    js = bytes_summary(res.envelopes, res.runs)["digits/feddg"]   # summary.json's "bytes" is the same table
    assert (js["runs"], js["total"], js["by_kind"]["amplitude_bank down"]["once"]) == (4, dg["total"], 2000)
    assert js["kinds_from_clients"] == ["amplitude_bank", "n_samples", "weights"]
    assert avg["clients"] == {c: ["n_samples", "weights"] for c in "ABC"}
    h = headline(root)
    assert "fedavg  (4 runs; per run: 4.88 kB total, 80 B once at round 0, 1.2 kB per round)" in h
    assert "left client(s) A, B, C: amplitude_bank, n_samples, weights" in h
    assert re.search(r"↓ amplitude_bank +per round +0 B +once +2 kB +total +2 kB", h)
    card = {r["method"]: r for r in csv.DictReader(open(write_report([root], tmp_path / "o").parent / "scorecard.csv"))
            if r["harm"] == "accuracy"}
    assert float(card["feddg"]["bytes"]) == pytest.approx(dg["total"])   # scorecard.csv's bytes column


# ---------------------------------------------------------------- files, links, aggregation

def test_report_files_relative_links_privacy_roc_and_grids(tmp_path):
    r0 = run_id("feddg", "", "A", 0)
    leak = [leak_row(r0, "pr", "amplitude_bank", "B", 0, "psnr", 25.0, 11.0),
            leak_row(run_id("fedavg", "", "A", 0), "loss", "weights", "B", 2, "auc", 0.6, 0.5)]
    root = fabricate(tmp_path / "r", leakage=leak)
    out = tmp_path / "copy" / "example-report"
    md = write_report([root], out).read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert links and all(not l.startswith("/") and l.startswith("plots/") for l in links)
    for name in ("accuracy_digits.png", "bytes.png", "privacy_vs_accuracy.png", "roc_loss.png", "recon_pr.png"):
        assert f"plots/{name}" in links
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # ε per run = the largest ε in privacy.csv (here 2 * 2 for the second client), shown for feddg only
    eps = T.privacy_table(T.load([root]))
    assert set(eps) == {("digits", "feddg", "")} and eps[("digits", "feddg", "")]["epsilon"]["mean"] == 4.0
    assert "| feddg | 4.00 ± 0.00 | 1e-05 |" in md
    h = headline(root)
    assert all(len(line) <= 100 for line in h.splitlines() if not line.startswith(" "))   # the terminal's page one
    # membership scores: the last round only (round 2, not the shifted round-1 copy), pooled over runs
    mia = T.membership_scores(T.load([root]))["loss"]
    d = mia[(("digits", "fedavg", ""), "loss")]
    assert len(d["scores"]) == 6 * 100 and len(d["models"]) == 6 and d["labels"].sum() == 300
    # calibrated within each target model as the scorecard's pool (mid-rank quantiles of 100 candidates)
    assert np.allclose(np.sort(d["scores"][:100]), (np.arange(100) + 0.5) / 100)


def test_aggregates_several_folders_and_later_duplicates_win(tmp_path):
    a = fabricate(tmp_path / "a", seeds=(0,), acc=lambda m, v, t, s: 0.2, extra=False)
    b = fabricate(tmp_path / "b", seeds=(0, 1), acc=lambda m, v, t, s: 0.4 + 0.1 * s, extra=False)
    res = T.load([a, b])
    assert len(res.ok) == 8 and any("appears in" in n for n in res.notes)
    row = next(r for r in T.accuracy_table(res) if r["method"] == "fedavg")
    assert row["mean"]["mean"] == pytest.approx(0.45)            # b's seed 0 replaced a's
    assert bytes_table(res.envelopes, res.ok)[("digits", "fedavg", "")]["runs"] == 4
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "agg")]) == 0
    assert (tmp_path / "agg" / "report.md").exists()
    with pytest.raises(UserError, match="summary.json"):
        write_report([tmp_path], tmp_path / "x")


def test_write_report_on_a_real_tiny_run(run_toml):
    root = run_toml("""
        name = "tiny"
        seeds = [0]
        [data]
        dataset = "digits"
        family = "rotated"
        domains = ["rot0", "rot30", "rot60"]
        targets = ["rot0"]
        per_domain = 60
        [model]
        arch = "cnn_small"
        [train]
        rounds = 1
        batch_size = 32
        [[methods]]
        name = "fedavg"
        """)
    md = (root / "report.md").read_text()                        # written by the runner (report = true)
    summary = json.loads((root / "summary.json").read_text())["runs"][0]
    row = md_table(md, "method", after="## Held-out accuracy")[0]
    assert row["method"] == "fedavg" and float(row["rot0"]) == pytest.approx(summary["target_acc"], abs=6e-4)
    assert (root / "plots" / "accuracy_rotated.png").exists() and (root / "plots" / "bytes.png").exists()
    h = headline(root)
    assert "THE ANSWER" in h and "left client(s) rot30, rot60: n_samples, weights" in h
    assert md.index("## Privacy scorecard") < md.index("## Held-out accuracy")


# ---------------------------------------------------------------- scorecard

def _items_file(root, attack, run, cands, output="main"):
    """items/<attack>/<run>.npz from (victim, metric, values, baseline values) candidates, as the harness writes."""
    from fdg_audit.metrics.stats import Items
    rows = [dict(run=run, attack=attack, adversary="server", artifact="amplitude_bank" if attack == "pr" else
                 "weights", round=0, victim=v, output=o, metric=m, status="ok",
                 items=Items("mean", np.asarray(x, float), ids=np.arange(len(x))),
                 base_items=Items("mean", np.asarray(b, float), ids=np.arange(len(b))))
            for v, m, x, b, *o in cands for o in [o[0] if o else output]]
    RunFolder(root).save_items(attack, run, rows)


@pytest.mark.usefixtures("psnr_headline")
def test_scorecard_opens_the_report_and_matches_scorecard_csv(tmp_path):
    base = {(t, s): 0.5 + 0.05 * s + (0.1 if t == "A" else 0) for t in "AB" for s in (0, 1, 2)}
    root = fabricate(tmp_path / "r", acc=lambda m, v, t, s: base[(t, s)] + (0.1 if m == "feddg" else 0.0),
                     extra=False)
    rng = np.random.default_rng(0)
    ok = [r for r in json.loads((root / "summary.json").read_text())["runs"] if r["status"] == "ok"]
    truth = {}
    for r in ok:
        if r["method"] == "feddg":   # two outputs: "c" leaks (30 dB), "b" does not (12 dB): held-out picks "c"
            c = rng.normal(30, 2, 40)
            _items_file(root, "pr", r["run"], [("B", "psnr", rng.normal(12, 2, 40), rng.normal(11, 1, 40), "b"),
                                              ("B", "psnr", c, rng.normal(11, 1, 40), "c")])
        else:                        # one candidate: scored on all its images
            x = rng.normal(15, 2, 40)
            truth[(r["target"], r["seed"])] = x.mean()
            _items_file(root, "ui", r["run"], [("B+C", "psnr", x, rng.normal(11, 1, 40))])
    (root / "controls.json").write_text(json.dumps([
        dict(attack=a, name="toy", metric="psnr", value=90.0, threshold=60.0, positive=True, passed=True)
        for a in ("pr", "ui")]))
    md = write_report([root], tmp_path / "out").read_text()
    sections = [line for line in md.splitlines() if line.startswith("## ")]
    assert sections[:2] == ["## The answer", "## Privacy scorecard"] and "## Verdict" in sections
    with open(tmp_path / "out" / "scorecard.csv", newline="") as f:
        card = list(csv.DictReader(f))
    from fdg_audit.report.scorecard import FIELDS
    assert list(card[0]) == FIELDS
    assert {(r["method"], r["harm"], r["setting"]) for r in card} == {
        ("fedavg", "accuracy", ""), ("feddg", "accuracy", ""), ("fedavg", "reconstruction", ""),
        ("feddg", "reconstruction", "")}
    cell = {(r["method"], r["harm"]): r for r in card if not r["setting"]}
    avg, dg = cell[("fedavg", "reconstruction")], cell[("feddg", "reconstruction")]
    assert avg["selection"] == "single" and avg["attack"] == "ui" and avg["n_items"] == "240"
    assert float(avg["value"]) == pytest.approx(np.mean(list(truth.values())), abs=1e-3)
    assert dg["selection"] == "crossfit" and dg["attack"] == "pr" and int(dg["n_items"]) == 6 * 40
    assert 28.5 < float(dg["value"]) < 31.5 and 10 < float(dg["baseline"]) < 12   # C's level, not max of noise
    for r in (avg, dg):
        assert float(r["ci_low"]) < float(r["value"]) < float(r["ci_high"]) and r["control"] == "passed"
        assert r["epsilon"] == "inf" and r["adversary"] == "server" and r["n_runs"] == "6"
    # one comparison per cell, whatever the attack: feddg's 30 dB minus fedavg's 15 dB, its id in comparisons.csv
    assert float(dg["diff_ref"]) == pytest.approx(float(dg["value"]) - float(avg["value"]), abs=0.5)
    assert avg["diff_ref"] == "" and dg["comparison"] in (tmp_path / "out" / "comparisons.csv").read_text()
    acc = cell[("feddg", "accuracy")]
    assert float(acc["value"]) == pytest.approx(np.mean(list(base.values())) + 0.1)
    assert float(acc["diff_ref"]) == pytest.approx(0.1) and float(acc["baseline"]) == pytest.approx(0.1)
    assert acc["reference"] == "fedavg" and cell[("fedavg", "accuracy")]["reference"] == ""
    # the verdict, in words, from these cells: 30 dB and 15 dB both clear 11 dB; feddg's accuracy cost is +0.1
    verdict = md.split("## Verdict")[1].split("\n## ")[0]
    line = {m: next(x for x in verdict.splitlines() if x.startswith(f"- **{m}**")) for m in ("fedavg", "feddg")}
    for m, r in (("fedavg", avg), ("feddg", dg)):
        assert f"reconstruction against the server: recon PSNR dB {float(r['value']):.1f} [" in line[m]
        assert "vs baseline " in line[m]
    assert f"Held-out accuracy {float(acc['value']):.3f} [" in line["feddg"]
    # the fabricated accuracy differs by +0.100 in every run: no spread, so the exact sign-flip p (2/64, then Holm)
    assert "Δ fedavg +0.100" in line["feddg"] and "(n = 6, borderline)" in line["feddg"]
    assert "(the reference)" in line["fedavg"] and "Δ" not in line["fedavg"]
    # the markdown rows carry the csv's numbers
    rows = {(r["method"], r["harm"]): r for r in md_table(md, "row", after="### ")}
    assert rows[("feddg", "reconstruction")]["value [95% CI]"] == \
        f"{float(dg['value']):.1f} [{float(dg['ci_low']):.1f}, {float(dg['ci_high']):.1f}] (n 6)"
    assert rows[("feddg", "reconstruction")]["row"] == dg['id']
    assert rows[("feddg", "accuracy")]["value [95% CI]"].startswith(f"{float(acc['value']):.3f}")
    # in words: feddg is 0.1 more accurate on every target and seed
    assert "feddg − fedavg = +0.100 [+0.100, +0.100] (n = 6" in md and "distinguishable: feddg − fedavg" not in md
    h = headline(root)
    assert "+0.100 [+0.100, +0.100]" in h and f"[row {acc['id']}]" in h
    assert "plots/answer.png" in md.split("## Privacy scorecard")[0]   # the answer figure on page one


def test_a_grid_block_is_one_picture_with_every_image_in_its_place():
    """A block of a reconstruction grid is one picture: row i, column j holds image j of row i (grey images in every
    colour channel), white in the gaps and where a row is short."""
    from fdg_audit.report.plots import _mosaic
    rng = np.random.default_rng(0)
    grey, colour = rng.random((3, 1, 5, 4)), rng.random((2, 3, 5, 4))
    pic = _mosaic((grey, colour, grey[:1]), cols=3, gap=2)
    assert pic.shape == (3 * 5 + 2 * 2, 3 * 4 + 2 * 2, 3)
    cell = lambda i, j: pic[i * 7:i * 7 + 5, j * 6:j * 6 + 4]  # noqa: E731
    for j in range(3):
        assert np.array_equal(cell(0, j), np.repeat(grey[j, 0][..., None], 3, -1))
    assert np.array_equal(cell(1, 1), np.moveaxis(colour[1], 0, -1))
    assert (cell(1, 2) == 1).all() and (cell(2, 1) == 1).all() and (pic[5:7] == 1).all() and (pic[:, 4:6] == 1).all()


def test_reconstruction_grids_of_client_ids_stay_flat_and_parse_back(tmp_path):
    """Client ids carry a slash ("rot15/0"): the grid file must not become a folder the report never reads."""
    import torch
    x = torch.zeros(2, 1, 4, 4)
    RunFolder(tmp_path).save_grid("update_inversion", "rotated/fedavg/rot45/s0", "rot15/0", "n_assumed", (x, x, x))
    (f,) = (tmp_path / "recon").glob("*/*.npz")
    got = RunFolder(tmp_path).result_files("recon", {"rotated/fedavg/rot45/s0", "rotated/fedavg/rot4/s0"})
    assert [(g["run"], g["victim"], g["variant"], g["path"]) for g in got] == \
        [("rotated/fedavg/rot45/s0", "rot15/0", "n_assumed", f)]
    # A curious client's victim is the union of the other clients: 119 ids would exceed the file-name limit.
    others = "+".join(f"rot{a}/{i}" for a in (0, 15, 30) for i in range(40))
    RunFolder(tmp_path).save_grid("update_inversion_client", "rotated/fedavg/rot45/s0", others, "", (x, x, x))
    got = RunFolder(tmp_path).result_files("recon", {"rotated/fedavg/rot45/s0"})
    assert ("update_inversion_client", "rot0/0+118more+rot30/39", "main") in \
        [(g["attack"], g["victim"], g["variant"]) for g in got]


def test_the_verdict_lists_only_leaks_whose_interval_clears_the_baseline():
    """A cell is a leak in the report's opening verdict when its whole interval lies beyond its baseline's (below it
    for an error metric); a point estimate past the baseline with an overlapping interval, a cell read as "not
    above baseline", and a failed control are not."""
    from fdg_audit.report import clears
    cell = dict(harm="membership", metric="auc", value="0.6", ci_low="0.55", ci_high="0.65", baseline="0.5",
                baseline_ci_low="", baseline_ci_high="", reading="", control="passed")
    assert clears(cell)
    assert not clears(dict(cell, ci_low="0.49"))                      # the interval reaches the baseline
    assert not clears(dict(cell, reading="not above baseline"))
    assert not clears(dict(cell, control="failed"))
    psnr = dict(cell, harm="reconstruction", metric="psnr", ci_low="20", ci_high="30", baseline="15",
                baseline_ci_low="12", baseline_ci_high="21")
    assert not clears(psnr) and clears(dict(psnr, baseline_ci_high="19"))
    err = dict(cell, harm="dataset_size", metric="n_samples_rel_error", ci_low="0.01", ci_high="0.1", baseline="0.25")
    assert clears(err) and not clears(dict(err, ci_high="0.3"))


@pytest.mark.usefixtures("psnr_headline")
def test_the_reference_method_is_data_and_assumptions_come_from_attacks_json(tmp_path):
    """The Δ columns compare with summary.json's "reference" (here feddg); folders that disagree get no Δ and a
    note. The "assumes" column reads attacks.json: the aux in the core's words, then the variant's own words."""
    from fdg_audit.report import scorecard as SC
    a = fabricate(tmp_path / "a", acc=lambda m, v, t, s: 0.5 + 0.02 * s + (0.1 if m == "feddg" else 0.0), extra=False,
                  reference="feddg")
    rng = np.random.default_rng(2)
    for r in json.loads((a / "summary.json").read_text())["runs"]:
        if r["status"] == "ok":
            _items_file(a, "pr", r["run"], [("B", "psnr", rng.normal(20, 1, 40), rng.normal(11, 1, 40))],
                        output="sharp" if r["method"] == "feddg" else "main")
    (a / "attacks.json").write_text(json.dumps({"pr": dict(
        name="x:Y", adversary="server", aux=["public", "unknown_aux"], consumes=["weights"],
        outputs={"": "reads the weights as received", "sharp": "a sharpness prior"})}))
    md = write_report([a], tmp_path / "out").read_text()
    with open(tmp_path / "out" / "scorecard.csv", newline="") as f:
        cell = {(r["method"], r["harm"]): r for r in csv.DictReader(f) if not r["setting"]}
    avg, dg = cell[("fedavg", "accuracy")], cell[("feddg", "accuracy")]
    assert avg["reference"] == "feddg" and float(avg["diff_ref"]) == pytest.approx(-0.1) and dg["diff_ref"] == ""
    return   # the rest: the scorecard's former same-attack Δ (issue 46: one comparison per cell, test_report_model)
    rec = cell[("fedavg", "reconstruction")]
    assert rec["reference"] == "feddg" and float(rec["diff_ref"]) == pytest.approx(
        float(rec["value"]) - float(cell[("feddg", "reconstruction")]["value"]), abs=1e-3)
    assert rec["assumes"] == "public target-domain images; reads the weights as received"
    assert cell[("feddg", "reconstruction")]["assumes"] == "public target-domain images; a sharpness prior"
    assert "| Δ feddg [95% CI] |" in md and "Δ feddg -0.100" in md
    (a / "attacks.json").write_text(json.dumps({"pr": dict(name="x:Y", adversary="server", aux=[], consumes=[],
                                                           outputs={})}))
    assert {r["assumes"] for r in SC.scorecard(T.load([a])) if r["harm"] == "reconstruction"} == {"no auxiliary data"}
    b = fabricate(tmp_path / "b", seeds=(7,), extra=False, reference="fedavg")
    res = T.load([a, b])
    assert res.reference == "" and any("different reference methods (fedavg, feddg" in n for n in res.notes)
    assert all(r["diff_ref"] == r["reference"] == "" for r in SC.scorecard(res))


def test_the_verdict_says_what_was_measured_distinguished_and_not_resolved():
    """The verdict is built from scorecard rows only: a cell that clears its baseline is named with its adversary;
    a failed control is "not measurable"; a cell below its baseline keeps its reading; a Δ over fewer than 3 runs
    is "not testable"; the accuracy cost is the accuracy row's Δ to the reference."""
    from types import SimpleNamespace

    from fdg_audit.report.scorecard import FIELDS
    from fdg_audit.report.verdict import verdict_md
    row = lambda **k: {f: "" for f in FIELDS} | dict(dataset="digits", variant="", control="passed") | k  # noqa: E731
    card = [row(method="fedavg", harm="accuracy", metric="target_acc", value="0.5", ci_low="0.45", ci_high="0.55"),
            row(method="feddg", harm="accuracy", metric="target_acc", value="0.4", ci_low="0.35", ci_high="0.45",
                reference="fedavg", diff_ref="-0.1", diff_ref_ci_low="-0.15", diff_ref_ci_high="-0.05", diff_n="6",
                diff_call="distinguishable", diff_p_holm="0.01"),
            row(method="feddg", harm="membership", adversary="server", metric="auc", value="not measurable",
                control="failed"),
            row(method="feddg", harm="reconstruction", adversary="server", metric="psnr", value="9", ci_low="8",
                ci_high="10", baseline="11", reading="no reconstruction at this budget"),
            row(method="feddg", harm="domain", adversary="client", metric="domain_balanced_acc", value="0.9",
                ci_low="0.85", ci_high="0.95", baseline="0.33", attack="stats", artifact="weights", reference="fedavg",
                diff_ref="0.5", diff_ref_ci_low="0.4", diff_ref_ci_high="0.6", diff_n="2", diff_call="not testable")]
    res = SimpleNamespace(reference="fedavg", label=lambda g: g[1] + g[2])
    md = verdict_md(res, card)
    avg, dg = (next(x for x in md if x.startswith(f"- **{m}**")) for m in ("fedavg", "feddg"))
    assert "No harm is measured above its baseline" in avg and "Held-out accuracy 0.500 [0.450, 0.550] (the reference)" in avg
    assert "domain against the client: domain bal. acc 0.900 [0.850, 0.950] vs baseline 0.330 (stats on weights)" in dg
    assert "membership (server): not measurable" in dg and "reconstruction (server): no reconstruction at this budget" in dg
    assert "domain (client) against fedavg: not testable (n = 2" in dg and "Distinguishable" not in dg
    assert "Held-out accuracy 0.400 [0.350, 0.450]; Δ fedavg -0.100 [-0.150, -0.050] (n = 6, distinguishable)" in dg


def test_accuracy_table_carries_what_a_method_reports_itself():
    """Server.extra_metrics at the selected round (RunInfo.extra, e.g. PerAda's personalised accuracy) reaches the
    accuracy table with its interval over runs, only where every run of the group reports it."""
    from fdg_audit.report import tables as T
    runs = [dict(run=f"d/m/t/s{s}", dataset="d", method="m", variant="", target="t", seed=s, status="ok",
                 target_acc=0.5, extra={"personal_acc": v}) for s, v in enumerate((0.6, 0.7, 0.8))]
    runs.append(dict(run="d/n/t/s0", dataset="d", method="n", variant="", target="t", seed=0, status="ok",
                     target_acc=0.4, extra={}))
    rows = {r["method"]: r for r in T.accuracy_table(T.Results(roots=[], runs=runs))}
    (st, (m, lo, hi, n)), = rows["m"]["extra"].values()
    assert n == 3 and abs(m - 0.7) < 1e-9 and lo < 0.7 < hi
    assert rows["n"]["extra"] == {}


def _reid_folder(tmp_path, rates):
    """Three methods, 2 targets x 3 seeds; per run a re-identification items file per channel: ``rates[method]`` =
    {artifact: hit rate}; FedDG's bank is attacked by "pr", every method's weights by "ui"."""
    from fdg_audit.metrics.stats import Items
    ms = tuple((m, "", {}) for m in rates)
    root = fabricate(tmp_path / "r", methods=ms, extra=False,
                     acc=lambda m, v, t, s: 0.6 + 0.01 * s + (0.05 if m == "feddg" else 0.0))
    rng = np.random.default_rng(11)
    per_run = {}
    for r in json.loads((root / "summary.json").read_text())["runs"]:
        if r["status"] != "ok":
            continue
        for art, rate in rates[r["method"]].items():
            hits = (rng.uniform(size=60) < rate).astype(float)
            per_run.setdefault(r["run"], {})[art] = hits
            a = "pr" if art == "amplitude_bank" else "ui"
            RunFolder(root).save_items(a, r["run"], [dict(
                run=r["run"], attack=a, adversary="server", artifact=art, round=0, victim="B", output="main",
                metric="reid", status="ok", items=Items("mean", hits, ids=np.arange(60)),
                base_items=Items("mean", np.full(60, 0.01), ids=np.arange(60)))])
    return root, per_run


def test_plots_pass_the_checklist(tmp_path):
    """Fixed colours per method across datasets, a line style per dataset; at most 6 ROC curves, the strongest variant
    per method; grids at most 1,600 px a side, paged; no trade-off figure for a family of one method; one legend entry
    per label."""
    from PIL import Image

    from fdg_audit.report import plots as P
    res = T.Results(roots=[])
    res.runs = [dict(run=f"{ds}/{m}", dataset=ds, method=m, variant="", status="ok") for ds in ("d1", "d2")
                for m in (["a", "b", "c"] if ds == "d1" else ["c", "a"])]
    col = P.colors(res)
    assert col[("d1", "a", "")] == col[("d2", "a", "")] and col[("d1", "c", "")] == col[("d2", "c", "")]
    assert len({col[("d1", m, "")] for m in "abc"}) == 3
    import colorsys
    res.runs += [dict(run=f"d1/a_{v}", dataset="d1", method=f"a_{v}", plugin="a", variant="", status="ok")
                 for v in ("eps8", "eps2")]   # a method's DP settings: shades of its hue, never another method's
    shades = [P.colors(res)[("d1", m, "")] for m in ("a", "a_eps8", "a_eps2")]
    assert len(set(shades)) == 3 and P.colors(res)[("d1", "b", "")] == col[("d1", "b", "")]
    assert max(abs(colorsys.rgb_to_hsv(*c)[0] - colorsys.rgb_to_hsv(*shades[0])[0]) for c in shades) < 0.01
    ls = P.line_styles(res)     # one method on two datasets: one colour, two line styles
    assert ls[("d1", "a", "")] == ls[("d1", "b", "")] != ls[("d2", "a", "")] == ls[("d2", "c", "")]
    rng = np.random.default_rng(0)
    y = np.r_[np.ones(50), np.zeros(50)].astype(int)
    pooled = {(("d", f"m{i}", ""), v): dict(scores=rng.normal(y * k, 1), labels=y, models={1})
              for i in range(8) for k, v in ((0.2 * i, "weak"), (0.2 * i + 1, "strong"))}
    curves = P._roc_curves(pooled)
    assert len(curves) == 6 and all(v == "strong" for _, v, _, _ in curves)
    from fdg_audit import metrics as M
    auc = sorted(((M.auc(d["scores"], d["labels"]), g[1]) for (g, v), d in pooled.items() if v == "strong"),
                 reverse=True)
    assert [g[1] for g, _, _, _ in curves] == [m for _, m in auc[:6]]   # the 6 strongest methods, strongest first
    # a reconstruction grid of 8 methods: pages, each at most 1,600 px a side
    root = fabricate(tmp_path / "r", methods=tuple((f"m{i}", "", {}) for i in range(8)), seeds=(0,), extra=False)
    rec = root / "recon" / "pr"
    rec.mkdir(parents=True)
    x = rng.uniform(0, 1, (8, 1, 8, 8)).astype(np.float32)
    for i in range(8):
        np.savez(rec / f"digits__m{i}__A__s0__B__main.npz", truth=x, recon=x, baseline=x)
    one = T.load([root])
    files = P.recon(one, tmp_path / "plots")
    assert len(files) == 3 and files[0] == "recon_pr.png"
    for f in files:
        assert max(Image.open(tmp_path / "plots" / f).size) <= 1600


def test_the_answer_figure_never_draws_two_channels_alike():
    """Colour is the method and line style the channel: the reference's channel is solid, another channel dashed,
    and where the reference itself sends two channels (a Flower app's one strategy) they still differ."""
    from fdg_audit.report.answer import line_styles
    assert line_styles([["weights"], ["amplitude_bank", "weights"]], ["weights"]) == {"weights": "-",
                                                                                      "amplitude_bank": "--"}
    both = line_styles([["amplitude_bank", "weights"]], ["amplitude_bank", "weights"])
    assert set(both) == {"amplitude_bank", "weights"} and len(set(both.values())) == 2


def test_attacks_a_scenario_left_out_are_named_with_where_they_ran(tmp_path):
    """The attacks section names what the scenario's [[attacks]] tables exclude and prints its see_also lines (where
    those attacks ran); a hostile config adds no markup and no non-strings."""
    root = fabricate(tmp_path / "r", leakage=[leak_row(run_id("fedavg", "", "A", 0), "loss", "weights", "B", 2, "auc",
                                                        0.6, 0.5)])
    (root / "config.resolved.toml").write_text(
        'see_also = ["mia_lira ran in scenarios/membership.toml", 3]\n'
        '[[attacks]]\nname = "all"\nexclude = ["mia_lira", "mia_rmia", {x = 1}]\n'
        '[[attacks]]\nname = "loss"\nexclude = ["<script>"]\n')
    md = write_report([root], tmp_path / "out").read_text()
    assert "\nLeft out by the scenario (its [[attacks]] exclude): mia_lira, mia_rmia, \\<script\\>.\n" in md
    assert "\n- See also: mia_lira ran in scenarios/membership.toml\n" in md
    assert "<script>" not in md and "{x" not in md and "See also: 3" not in md
    plain = fabricate(tmp_path / "p", leakage=[leak_row(run_id("fedavg", "", "A", 0), "loss", "weights", "B", 2,
                                                         "auc", 0.6, 0.5)])
    assert "Left out by the scenario" not in write_report([plain], tmp_path / "o2").read_text()


def test_a_legend_entry_is_cut_per_line():
    """A folder's labels are data: every figure's legend and tick labels are cut to LEGEND_CHARS per line (a
    100,000-character method label took matplotlib 45 s to draw), and a short label is kept as it is."""
    from fdg_audit.report.formatting import LEGEND_CHARS, legend_label
    long = "L" * 100_000 + "\n    12 members"
    cut = legend_label(long).split("\n")
    assert [len(x) for x in cut] == [LEGEND_CHARS, len("    12 members")] and cut[0].endswith("…")
    assert legend_label("FedAvg: AUC 0.5") == "FedAvg: AUC 0.5"


def test_the_epsilon_of_runs_without_noise_reads_infinite_without_a_warning():
    """The DP example's table said "inf ± nan" for the sigma = 0 runs, and numpy warned on stderr while the report was
    written: the std of infinite values is undefined, so it is not computed."""
    import warnings

    from fdg_audit.report.formatting import fmt
    from fdg_audit.report.tables import stat
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = stat([float("inf")] * 3)
    assert fmt(s, 2) == "∞" and s["n"] == 3 and fmt(stat([7.0, 9.0]), 2) == "8.00 ± 1.41"
