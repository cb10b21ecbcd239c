"""A hostile run folder (toward issue 21): nothing it says is a path outside it, a pickle or an unbounded array."""
import io
import json
import os
import zipfile

import numpy as np
import pytest

from conftest import tiny_scenario
from test_trust import copy, one_line_error, root  # noqa: F401  (fixtures: a finished run folder and a copy)


def _lines(folder):
    return (folder / "messages.jsonl").read_text().splitlines()


def _set_line(folder, i, **change):
    lines = _lines(folder)
    d = json.loads(lines[i])
    d.update(change)
    lines[i] = json.dumps(d)
    (folder / "messages.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("sha", ["../../../../etc/passwd", "/dev/zero", "ab" * 31])
def test_a_sha256_that_is_not_64_hex_digits_is_refused(copy, capsys, sha):  # noqa: F811
    _set_line(copy, 0, sha256=sha)
    one_line_error(capsys, ["attack", str(copy), "--attacks", "dataset_size"], "64 hexadecimal digits")


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_payload_that_is_a_fifo_or_a_link_out_of_the_folder_is_refused(copy, capsys, kind):  # noqa: F811
    led = [json.loads(x) for x in _lines(copy)]
    e = next(d for d in led if d["kind"] == "n_samples" and d["stored"])
    p = copy / "payloads" / e["sha256"][:2] / e["sha256"]
    p.unlink()
    if kind == "fifo":
        os.mkfifo(p)          # reading it would block forever
    else:
        p.symlink_to("/dev/zero")   # reading it would grow memory until it fails
    one_line_error(capsys, ["attack", str(copy), "--attacks", "dataset_size"], "not a regular file")


def test_a_ledger_line_of_a_run_the_folder_never_planned_is_refused(copy, capsys):  # noqa: F811
    lines = _lines(copy)
    d = json.loads(lines[-1])
    d.update(run="rotated/fedavg/rot0/s99", prev="")
    (copy / "messages.jsonl").write_text("\n".join(lines + [json.dumps(d)]) + "\n")
    one_line_error(capsys, ["attack", str(copy), "--attacks", "dataset_size"], "never planned")


def _npz_with_header(shape, descr="<f8") -> bytes:
    hdr = io.BytesIO()
    np.lib.format.write_array_header_1_0(hdr, {"descr": descr, "fortran_order": False, "shape": shape})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", hdr.getvalue() + b"\0" * 4096)
    return buf.getvalue()


def test_npz_bombs_and_pickles_are_one_line_errors(tmp_path):
    from fdg_audit.errors import UserError
    from fdg_audit.store.ledger import load_npz
    huge = tmp_path / "huge.npz"
    huge.write_bytes(_npz_with_header((10 ** 12,)))                  # declares 8 TB
    with pytest.raises(UserError, match="declares"):
        load_npz(huge)
    bomb = tmp_path / "bomb.npz"          # a few kB on disk that would inflate to 2 GiB (32 MB of it written here)
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        hdr = io.BytesIO()
        np.lib.format.write_array_header_1_0(hdr, {"descr": "|u1", "fortran_order": False, "shape": (2 ** 31,)})
        with z.open("x.npy", "w", force_zip64=True) as f:
            f.write(hdr.getvalue())
            for _ in range(2):
                f.write(bytes(2 ** 24))
    assert bomb.stat().st_size < 4 * 2 ** 20
    with pytest.raises(UserError, match="declares"):
        load_npz(bomb)
    pick = tmp_path / "pickle.npz"
    np.savez(pick, a=np.array([{"x": 1}], dtype=object))
    with pytest.raises(UserError, match="declares objects"):
        load_npz(pick)


def test_report_never_imports_a_module_that_a_folder_names(copy, tmp_path, monkeypatch):  # noqa: F811
    """items/*.npz name their attack; a name that is no installed plugin (here a module inside the folder, and the
    standard library's `this`) is never imported by the scorecard."""
    import runpy  # noqa: F401
    import sys

    from fdg_audit.store.runfolder import RunFolder
    from fdg_audit.metrics.stats import Items
    from fdg_audit.report import write_report
    marker = tmp_path / "imported"
    (copy / "evilmod.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n")
    monkeypatch.syspath_prepend(str(copy))
    run = json.loads((copy / "summary.json").read_text())["runs"][0]["run"]
    for name in ("evilmod:X", "this:X"):
        row = dict(run=run, attack=name, adversary="server", artifact="weights", round=1, victim="rot15", output="",
                   metric="psnr", status="ok", items=Items("mean", np.array([20.0, 21.0]), ids=np.arange(2)),
                   base_items=None)
        RunFolder(copy).save_items(name.replace(":", "_"), run, [row])
    sys.modules.pop("this", None)
    write_report([copy], tmp_path / "out", quiet=True)
    assert not marker.exists() and "this" not in sys.modules


def test_a_run_id_that_walks_out_of_the_folder_is_refused(copy, capsys):  # noqa: F811
    s = json.loads((copy / "summary.json").read_text())
    s["runs"][0]["run"] = "../../../escaped/x"
    (copy / "summary.json").write_text(json.dumps(s))
    one_line_error(capsys, ["attack", str(copy), "--attacks", "dataset_size"], "not a run id")


def test_the_installed_command_runs_no_selectors_py_from_the_working_directory(root, tmp_path):  # noqa: F811
    """`fdg-audit attack .` from inside a received folder: the helper processes (forkserver, resource tracker) start
    as `python -c`, which would import the folder's selectors.py; PYTHONSAFEPATH keeps the folder off their path."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    exe = Path(sys.executable).with_name("fdg-audit")
    if not exe.exists():
        pytest.skip("the fdg-audit command is not installed next to this Python")
    folder = tmp_path / "received"
    shutil.copytree(root, folder)
    marker = tmp_path / "ran"
    (folder / "selectors.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
                                         "raise SystemExit(3)\n")
    r = subprocess.run([str(exe), "attack", ".", "--attacks", "dataset_size"], cwd=folder, capture_output=True,
                       text=True, timeout=300)
    assert not marker.exists(), r.stderr[-2000:]
    assert r.returncode == 0, r.stderr[-2000:]


def _env_probe():
    """An attack that reports what the worker's process tells a plugin: environment, argv, working directory."""
    from fdg_audit.api.attack import Attack, Skipped

    class Probe(Attack):
        name = "env_probe"
        consumes = ("weights",)

        def run(self, view, aux):
            import os
            import sys
            return [Skipped(view.me, "weights", 0,
                            json.dumps(dict(env=sorted(os.environ), argv=sys.argv, cwd=os.getcwd())))]
    return Probe


EnvProbe = _env_probe()


def test_the_worker_sees_no_harness_environment_argv_or_cwd(copy, monkeypatch):  # noqa: F811
    import csv
    import sys

    from fdg_audit.audit.harness import run_attacks
    monkeypatch.setenv("FDG_HARNESS_SECRET", "s3cret")
    monkeypatch.setattr(sys, "argv", ["fdg-audit", "attack", str(copy)])
    run_attacks(copy, [{"name": f"{__name__}:EnvProbe"}], quiet=True)
    with open(copy / "leakage.csv", newline="") as f:
        seen = [json.loads(r["status"].removeprefix("skipped: ")) for r in csv.DictReader(f) if r["attack"] == "env_probe"]
    assert seen
    for s in seen:
        assert "FDG_HARNESS_SECRET" not in s["env"] and set(s["env"]) <= {"PATH", "LANG", "LC_ALL", "TMPDIR", "HOME",
                                                                        "PYTHONSAFEPATH", "OMP_NUM_THREADS",
                                                                        "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                                        "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                                        "CUDA_VISIBLE_DEVICES"}
        assert str(copy) not in " ".join(s["argv"]) and "fdg_view_" in s["cwd"] and str(copy) not in s["cwd"]


def _recompute_probe():
    """A membership attack that rebuilds the data set with fdg_audit.data inside the worker, from the scenario's
    public settings, and calls a candidate a member when its pixels are in the recomputed training split."""
    from fdg_audit.api.attack import Attack, Scores

    class Recompute(Attack):
        name = "recompute"
        consumes = ("weights",)
        aux = ("candidates",)

        def run(self, view, aux):

            from fdg_audit.data import DataConfig, load_data
            seed = int(view.run_id.rsplit("/s", 1)[1])   # the run's seed draws its split from the split seed
            data = load_data(DataConfig(dataset="digits", family="rotated", per_domain=40,
                                        domains=["rot0", "rot15", "rot30", "rot45"], draw=seed))
            out = []
            for v, cand in aux.candidates.items():
                train = data.domain(v).train.x.flatten(1)
                hit = ((cand.x.flatten(1)[:, None] - train[None]).abs().amax(-1) < 1e-6).any(1)   # same pixels
                out.append(Scores(v, "weights", 1, hit.float().numpy()))
            return out
    return Recompute


Recompute = _recompute_probe()


def test_truth_cannot_be_recomputed_in_the_worker(tmp_path):
    """Each run folder draws its own secret split seed (truth/secrets.json, never in the view or the resolved
    config): the rebuilt split says nothing about membership (AUC at chance, not the 1.0 of a public split)."""
    import csv

    from fdg_audit.audit.harness import run_attacks
    from fdg_audit.runner import run_scenario
    from test_attack_framework import SCENARIO
    aucs = {}
    for name, extra in (("secret", ""), ("public", "split_seed = 0\n")):
        f = tmp_path / f"{name}.toml"
        f.write_text(SCENARIO.replace('family = "rotated"\n', f'family = "rotated"\n{extra}'))
        root = run_scenario(str(f), out=str(tmp_path / name), quiet=True)
        assert "split_seed" not in (root / "config.resolved.toml").read_text() or name == "public"
        run_attacks(root, [{"name": f"{__name__}:Recompute"}], quiet=True)
        with open(root / "leakage.csv", newline="") as fh:
            aucs[name] = [float(r["value"]) for r in csv.DictReader(fh)
                          if r["attack"] == "recompute" and r["metric"] == "auc" and r["victim"] != "pooled"]
    assert aucs["public"] and min(aucs["public"]) == 1.0          # the attack works when the split is public
    assert aucs["secret"] and max(abs(a - 0.5) for a in aucs["secret"]) < 0.2, aucs


@pytest.mark.parametrize("file, text, needle", [
    ("controls.json", "garbage{", "controls.json is not valid JSON"),
    ("controls.json", '{"x": 1}', "is not a list of attack controls"),
    ("leakage.csv", "a,b\n1,2\n", "leakage.csv lacks the column(s) run, attack"),
    ("summary.json", '{"runs": 3}', "is not a run summary"),
])
def test_report_on_damaged_result_files_is_one_line(copy, capsys, file, text, needle):  # noqa: F811
    (copy / file).write_text(text)
    one_line_error(capsys, ["report", str(copy)], needle)


def test_a_data_root_that_cannot_be_read_is_one_line(tmp_path, capsys, monkeypatch):
    """data.root = "/" met /proc/1/cwd (permission denied) with a traceback: any folder that cannot be read at the
    domain or class level is refused with one line naming it, before any run folder is made. The unreadable folder
    is simulated (this suite may run as root, which reads folders of mode 0)."""
    from pathlib import Path

    from fdg_audit.cli import main
    locked = tmp_path / "imgs" / "a"
    locked.mkdir(parents=True)
    (tmp_path / "imgs" / "b").mkdir()
    iterdir = Path.iterdir

    def denied(self):
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return iterdir(self)
    monkeypatch.setattr(Path, "iterdir", denied)
    f = tmp_path / "s.toml"
    f.write_text(tiny_scenario(data=dict(dataset="folder", root=str(tmp_path / "imgs"), family=None, domains=None,
                                         per_domain=None, targets=None)))
    assert main(["scenario", str(f), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot read {locked} (Permission denied)" in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()
