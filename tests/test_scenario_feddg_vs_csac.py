"""Smoke test of the named scenario through the CLI, shrunk with --set overrides."""
import json
from pathlib import Path

from fdg_audit.cli import main

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "feddg_vs_csac.toml"


def test_named_scenario_runs_small(tmp_path, capsys):
    tiny = ["seeds=[0]", "attacks.update_inversion.seeds=[0]", "train.rounds=1", "train.batch_size=16", "methods.csac.acquire_epochs=1", "threads=1",
            "datasets.appearance.per_domain=24", "datasets.appearance.targets=[\"grey\"]",
            "datasets.appearance.domains=[\"grey\", \"colour\", \"texture\"]",
            "datasets.rotated.per_domain=24", "datasets.rotated.targets=[\"rot75\"]",
            "datasets.rotated.domains=[\"rot0\", \"rot45\", \"rot75\"]",
            "attacks.amplitude_phase_retrieval.hio=40", "attacks.amplitude_phase_retrieval.er=10",
            "attacks.amplitude_phase_retrieval.restarts=2", "attacks.update_inversion.iterations=10",
            "attacks.amplitude_phase_retrieval.render_restarts=4", "attacks.amplitude_phase_retrieval.render_steps=[50, 50]",
            "attacks.all.exclude=[\"mia_lira\", \"mia_rmia\", \"mia_trajectory\", \"dp_audit_artifact\", \"dp_audit_client\", "
            "\"dp_audit_dpsgd\", \"fedavg_leakage\"]"]
    argv = ["scenario", str(SCENARIO), "--out", str(tmp_path), "--quiet", "--set", *tiny[:7], "--set", *tiny[7:]]
    assert main(argv) == 0
    root = Path(capsys.readouterr().out.strip().splitlines()[-1].split("results: ")[1])
    summary = json.loads((root / "summary.json").read_text())
    runs = summary["runs"]
    assert len(runs) == 6 and all(r["status"] == "ok" for r in runs)          # every --set was applied
    assert {(r["dataset"], r["method"], r["target"]) for r in runs} == {
        (d, m, t) for d, t in (("appearance", "grey"), ("rotated", "rot75")) for m in ("fedavg", "feddg", "csac")}
    kinds = {k: set(v["kinds_from_clients"]) for k, v in summary["bytes"].items()}
    for d in ("appearance", "rotated"):
        assert kinds[f"{d}/fedavg"] == {"n_samples", "weights"}
        assert kinds[f"{d}/feddg"] == {"n_samples", "amplitude_bank", "weights"}
        assert kinds[f"{d}/csac"] == {"weights"}

    # report.md opens with the verdict, then the scorecard; every method has a reconstruction and a membership
    # cell on the attacked target (rot75), FedAvg's and CSAC's reconstruction from update inversion of weights
    out = (root / "report.md").read_text()
    assert [line for line in out.splitlines() if line.startswith("## ")][:2] == ["## Verdict", "## Privacy scorecard"]
    import csv
    with open(root / "scorecard.csv", newline="") as f:
        card = [r for r in csv.DictReader(f) if r["dataset"] == "rotated"]
    cells = {(r["method"], r["harm"]): r for r in card}
    for m in ("fedavg", "feddg", "csac"):
        for h in ("accuracy", "reconstruction", "membership"):
            assert (m, h) in cells, (m, h)
    for m in ("fedavg", "csac"):
        assert cells[(m, "reconstruction")]["attack"] == "update_inversion"
        assert cells[(m, "reconstruction")]["artifact"] == "weights"
    assert "amplitude_phase_retrieval" in cells[("feddg", "reconstruction")]["attack"] or \
        "update_inversion" in cells[("feddg", "reconstruction")]["attack"]
    assert cells[("feddg", "membership")]["attack"] in ("amplitude_fingerprint", "mia_loss")
