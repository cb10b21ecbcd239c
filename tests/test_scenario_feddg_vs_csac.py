"""Smoke test of the named scenario through the CLI, shrunk with --set overrides."""
import json
from pathlib import Path

from fdg_audit.cli import main

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "feddg_vs_csac.toml"


def test_named_scenario_runs_small(tmp_path, capsys):
    tiny = ["train.rounds=1", "train.batch_size=16", "methods.csac.acquire_epochs=1", "threads=1",
            "datasets.appearance.per_domain=24", "datasets.appearance.targets=[\"grey\"]",
            "datasets.appearance.domains=[\"grey\", \"colour\", \"texture\"]",
            "datasets.rotated.per_domain=24", "datasets.rotated.targets=[\"rot75\"]",
            "datasets.rotated.domains=[\"rot0\", \"rot45\", \"rot75\"]"]
    argv = ["scenario", str(SCENARIO), "--out", str(tmp_path), "--quiet", "--set", *tiny[:5], "--set", *tiny[5:]]
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
