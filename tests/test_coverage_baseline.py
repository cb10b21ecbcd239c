"""coverage.csv scores each kind against the scorecard's baseline: a reconstruction, whose cell is scored against the
strongest free guess, counts by its re-identification against that guess, never by a row of the same output scored
against chance (its label accuracy), which would read as a leak where page one says none beats the free guess."""
import csv

from conftest import tiny_scenario
from fdg_audit.audit.coverage import coverage_rows
from fdg_audit.store.runfolder import LEAK_FIELDS, RunFolder


def _leakage(root, rows: list[dict]) -> None:
    run = next(iter(RunFolder(root).runs()))
    with open(root / "leakage.csv", "w", newline="") as f:
        w = csv.DictWriter(f, LEAK_FIELDS, restval="")
        w.writeheader()
        w.writerows({**dict(run=run, attack="update_inversion", artifact="weights", round=1, victim="rot15",
                            status="ok", free_guess="class mean"), **r} for r in rows)


def test_a_reconstruction_counts_against_its_free_guess_not_chance(run_toml):
    root = run_toml(tiny_scenario(seeds=[0]))
    recon = [dict(metric="reid", value=0.2, baseline=0.28),        # below the strongest free guess
             dict(metric="label_acc", value=0.35, baseline=0.1)]   # the same output's labels, against chance
    _leakage(root, recon)
    (row,) = [r for r in coverage_rows(root) if r["kind"] == "weights"]
    assert (row["status"], row["attack"], row["metric"]) == ("measured", "update_inversion", "reid"), row
    assert (float(row["value"]), float(row["baseline"])) == (0.2, 0.28)
    assert row["attacks"] == "update_inversion"
    # a measurement whose own baseline is its cell's (membership AUC against its blind baseline) still competes
    _leakage(root, recon + [dict(metric="auc", value=0.6, baseline=0.5, free_guess="")])
    (row,) = [r for r in coverage_rows(root) if r["kind"] == "weights"]
    assert (row["metric"], float(row["value"]), float(row["baseline"])) == ("auc", 0.6, 0.5), row
