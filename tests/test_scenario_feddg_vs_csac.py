"""Smoke test of the named scenario through the CLI, shrunk with --set overrides."""
import json
from pathlib import Path

from fdg_audit.cli import main

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "feddg_vs_csac.toml"


def test_named_scenario_runs_small(tmp_path, capsys):
    tiny = ["seeds=[0]", "store_rounds=[0, 1]", "attacks.amplitude_phase_retrieval.prior_steps=50",
            "attacks.amplitude_phase_retrieval.learned_steps=10",
            "datasets.rotated_small.per_domain=24", "datasets.rotated_small.client_sizes=[1, 4]", "train.rounds=1",
            "train.batch_size=16", "methods.csac.acquire_epochs=1", "threads=1",
            "datasets.digits_dg.per_domain=24", "datasets.digits_small.per_domain=24",
            "datasets.digits_small.client_sizes=[1, 4]",
            "datasets.rotated.per_domain=24", "datasets.rotated.targets=[\"rot75\"]",
            "datasets.rotated.domains=[\"rot0\", \"rot45\", \"rot75\"]",
            "attacks.amplitude_phase_retrieval.hio=40", "attacks.amplitude_phase_retrieval.er=10",
            "attacks.amplitude_phase_retrieval.restarts=2", "attacks.update_inversion.iterations=10",
            "attacks.amplitude_phase_retrieval.render_restarts=4", "attacks.amplitude_phase_retrieval.render_steps=[50, 50]",
            "attacks.all.exclude=[\"mia_lira\", \"mia_rmia\", \"mia_trajectory\", \"dp_audit_artifact\", \"dp_audit_client\", "
            "\"dp_audit_dpsgd\", \"fedavg_leakage\"]",
            # only what the assertions below read: the "all" entry on rotated (not digits_dg), update inversion of
            # small clients on rotated_small (not digits_small), of whole domains on rotated, and the bank attack's
            # "learned" variant (the size curve's) on the rotated families
            "attacks.all.datasets=[\"rotated\"]", "attacks.update_inversion.datasets=[\"rotated_small\"]",
            "attacks.update_inversion_domain.datasets=[\"rotated\"]", "attacks.update_inversion_domain.iterations=10",
            "attacks.update_inversion_domain.plateau_window=5",
            "attacks.amplitude_phase_retrieval.datasets=[\"rotated\", \"rotated_small\"]",
            "attacks.amplitude_phase_retrieval.variants=[\"learned\"]"]
    argv = ["scenario", str(SCENARIO), "--out", str(tmp_path), "--quiet", "--set", *tiny[:12], "--set", *tiny[12:]]
    assert main(argv) == 0
    root = Path(capsys.readouterr().out.strip().splitlines()[-1].split("results: ")[1])
    summary = json.loads((root / "summary.json").read_text())
    runs = summary["runs"]
    assert len(runs) == 12 and all(r["status"] == "ok" for r in runs)          # every --set was applied
    assert {(r["dataset"], r["method"], r["target"]) for r in runs} == {
        (d, m, t) for d, t in (("digits_dg", "syn"), ("rotated", "rot75"), ("rotated_small", "rot75"),
                               ("digits_small", "mnist"))
        for m in ("fedavg", "feddg", "csac")}
    kinds = {k: set(v["kinds_from_clients"]) for k, v in summary["bytes"].items()}
    for d in ("digits_dg", "rotated", "rotated_small", "digits_small"):
        assert kinds[f"{d}/fedavg"] == {"n_samples", "weights"}
        assert kinds[f"{d}/feddg"] == {"n_samples", "amplitude_bank", "weights"}
        assert kinds[f"{d}/csac"] == {"weights"}

    # report.md opens with the verdict, then the scorecard. On rotated every method has a membership cell and FedDG
    # a reconstruction cell (its bank); on rotated_small (clients of 1 and 4 images) every method has a reconstruction
    # cell, FedAvg's and CSAC's from update inversion of weights, and the curve over client data size lists each
    # method's attacks at both sizes
    out = (root / "report.md").read_text()
    assert [line for line in out.splitlines() if line.startswith("## ")][:2] == ["## The answer", "## Privacy scorecard"]
    from pageone_check import disagreements, untraced
    assert untraced(root) == [] and disagreements(root) == []      # page one's numbers are its rows'; one call each
    import csv
    with open(root / "scorecard.csv", newline="") as f:
        card = list(csv.DictReader(f))
    cells = {(r["dataset"], r["method"], r["harm"]): r for r in card}
    for m in ("fedavg", "feddg", "csac"):
        for h in ("accuracy", "membership"):
            assert ("rotated", m, h) in cells, (m, h)
        assert ("rotated_small", m, "reconstruction") in cells, m
        assert ("rotated_small", m, "membership") not in cells   # the "all" entry skips rotated_small
    assert cells[("rotated", "feddg", "reconstruction")]["attack"].split("|")[0] in (   # the stronger channel
        "amplitude_phase_retrieval", "update_inversion_domain")
    assert ("rotated", "feddg", "reconstruction") in cells
    for m in ("fedavg", "csac"):
        assert ("rotated", m, "reconstruction") in cells     # whole-domain clients' weights are attacked too
        assert cells[("rotated_small", m, "reconstruction")]["attack"].startswith("update_inversion")
        assert cells[("rotated_small", m, "reconstruction")]["artifact"] == "weights"
    curve = out[out.index("## Reconstruction against the client's data size"):]
    curve = curve[:curve.index("\n## ")]
    assert "| 1 images | 4 images |" in curve and "plots/size_curve_rotated_small.png" in curve
    for m in ("fedavg", "feddg", "csac"):
        assert f"rotated_small/{m}, update_inversion" in curve
    assert "rotated_small/feddg, amplitude_phase_retrieval (learned)" in curve
    assert (root / "plots" / "size_curve_rotated_small.png").exists()
