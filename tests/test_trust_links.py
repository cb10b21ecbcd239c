"""The trust boundary, round 4 (issue 51): a run folder is opened as data at every read and every write. Links under
the folder are never followed (``report`` and ``attack`` write only inside the folder they were given), FIFOs and
devices are refused before they are read, sizes are capped before reading, and long names are shortened with their
hash. Each test is one of the hostile tester's tries."""
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fdg_audit.audit.harness import run_attacks
from fdg_audit.cli import main
from fdg_audit.errors import UserError
from fdg_audit.store.runfolder import RunFolder

from test_hostile import CODE
from test_trust import copy, one_line_error, root  # noqa: F401  (fixtures: a finished run folder and a copy)


def _a_run(folder: Path) -> str:
    return next(iter(RunFolder(folder).runs()))


def run_tag(run: str) -> str:
    """A short run id's file stem (``runfolder.run_tag`` for ids that need no hash; written out here so that these
    tries run unchanged on 3cee758, which had no ``run_tag``)."""
    return run.replace("/", "__")


def test_report_writes_nothing_through_a_linked_plots_folder(copy, tmp_path, capsys):  # noqa: F811
    """Try 3a: plots/ linked to a folder outside made ``report`` write its figures there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (copy / "plots").symlink_to(outside, target_is_directory=True)
    one_line_error(capsys, ["report", str(copy)], "plots is not a folder")
    assert list(outside.iterdir()) == []


def test_report_replaces_a_linked_figure_instead_of_writing_through_it(copy, tmp_path):  # noqa: F811
    """Try 3b: plots/<name>.png linked to a file outside made ``report`` overwrite that file."""
    assert main(["report", str(copy)]) == 0
    fig = sorted((copy / "plots").glob("*.png"))[0]
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    fig.unlink()
    fig.symlink_to(outside)
    assert main(["report", str(copy)]) == 0
    assert outside.read_text() == "keep me" and not fig.is_symlink() and fig.read_bytes()[:4] == b"\x89PNG"


def test_attack_writes_nothing_through_a_linked_items_folder(copy, tmp_path):  # noqa: F811
    """Try 3c: items/ linked outside made ``attack`` overwrite a file there."""
    outside = tmp_path / "outside"
    (outside / "dataset_size").mkdir(parents=True)
    victim = outside / "dataset_size" / (run_tag(_a_run(copy)) + ".npz")
    victim.write_text("keep me")
    (copy / "items").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UserError, match="items is not a folder"):
        run_attacks(copy, [{"name": "dataset_size"}], quiet=True)
    assert victim.read_text() == "keep me" and sorted(p.name for p in outside.rglob("*")) == ["dataset_size",
                                                                                            victim.name]


@pytest.mark.parametrize("sandbox", ["process", "bwrap"])
def test_a_linked_attack_cache_hands_the_plugin_nothing_outside(copy, tmp_path, monkeypatch, sandbox):  # noqa: F811
    """Try 3d: attack_cache/<attack> linked to a folder outside handed the plugin that folder (it read a host
    secret) and the harness wrote into it. Now the plugin sees no cache and the harness refuses to write there."""
    from fdg_audit.audit.bwrap import bwrap_works
    if sandbox == "bwrap" and not bwrap_works():
        pytest.skip("needs bubblewrap")
    monkeypatch.setenv("FDG_AUDIT_SANDBOX", sandbox)
    outside = tmp_path / "host"
    outside.mkdir()
    np.savez(outside / "state.npz", x=np.array([7, 7, 7]))   # the host's secret, in the form the plugin reads
    (copy / "attack_cache").mkdir()
    (copy / "attack_cache" / "hostile_keeper").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UserError, match="hostile_keeper is not a folder"):
        run_attacks(copy, [{"name": "hostile:Keeper"}], quiet=True)
    assert sorted(p.name for p in outside.iterdir()) == ["state.npz"]
    assert np.load(outside / "state.npz")["x"].tolist() == [7, 7, 7]


# Try 4a: mia/…npz, items/…npz, leakage.csv, summary.json as FIFOs hung ``attack`` or ``report`` until killed; try
# 4b: summary.json, config.resolved.toml, messages.jsonl and items/…npz linked to /dev/zero were read without limit
# (24 GB, then the kernel's OOM killer; under a 4 GB cap a MemoryError traceback)
TRIES = [("fifo", "report", "mia/dataset_size/{run}.npz"), ("fifo", "report", "items/dataset_size/{run}.npz"),
         ("fifo", "report", "leakage.csv"), ("fifo", "attack", "leakage.csv"), ("fifo", "attack", "summary.json"),
         ("zero", "attack", "summary.json"), ("zero", "attack", "config.resolved.toml"),
         ("zero", "attack", "messages.jsonl"), ("zero", "report", "items/dataset_size/{run}.npz")]

# each try's command in turn in one process (one interpreter start for all): its exit code and its stderr, a
# traceback escaping the command included
EACH = """
import contextlib, io, json, sys, traceback
from fdg_audit.cli import main
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(args)
        except BaseException:
            code = None
            traceback.print_exc()
    print(json.dumps([code, err.getvalue()]), flush=True)
"""


def test_fifos_and_links_to_dev_zero_are_one_line_not_a_hang_or_unbounded_reading(root, tmp_path):  # noqa: F811
    """Tries 4a and 4b, each on its own copy of the run folder, one command after another in one process capped at
    4 GB and ended after 600 s (a FIFO that hangs it fails the test; so does a MemoryError's traceback)."""
    argvs = []
    for i, (how, cmd, file) in enumerate(TRIES):
        folder = tmp_path / f"try{i}" / "runs" / "tr" / "copy"
        shutil.copytree(root, folder)
        f = folder / file.format(run=run_tag(_a_run(folder)))
        f.parent.mkdir(parents=True, exist_ok=True)
        if f.exists():
            f.unlink()
        os.mkfifo(f) if how == "fifo" else f.symlink_to("/dev/zero")
        argvs.append(["attack", str(folder), "--attacks", "dataset_size", "--quiet"] if cmd == "attack"
                     else ["report", str(folder)])
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # noqa: E731
    p = subprocess.run([sys.executable, "-c", EACH, json.dumps(argvs)], env=dict(CODE, FDG_AUDIT_SANDBOX="process"),
                       capture_output=True, text=True, timeout=600, preexec_fn=cap)
    got = [json.loads(x) for x in p.stdout.splitlines()]
    assert p.returncode == 0 and len(got) == len(TRIES), (p.returncode, got, p.stderr[-3000:])
    for t, (code, err) in zip(TRIES, got):
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (t, err[-3000:])
        assert "is not a regular file" in err and "Traceback" not in err, (t, err)


def test_long_names_are_hashed_not_a_traceback(tmp_path):
    """Try 5: a 300-character dataset label or a run id of 25 valid parts ended in ``OSError: File name too long``
    when items or plots were named after them. Now a long name is shortened with its hash, the same every time,
    and found again by the reader."""
    from fdg_audit.metrics.stats import Items
    from fdg_audit.report.plots import _fig, _save
    run = "/".join(f"part{i:02d}xxxxx" for i in range(25))
    label = "a" * 200
    folder = RunFolder(tmp_path)
    folder.save_items(label, run, [dict(run=run, attack=label, metric="auc", items=Items("score", np.arange(3.0)))])
    folder.save_scores(label, run, [], {})
    (found,) = folder.result_files("items", {run})
    assert found["run"] == run and len(found["path"].name) <= 255
    from fdg_audit.store.safe import bounded, read_in   # here, not at the top: every try runs on 3cee758 too
    name = _save(_fig(1, 1), tmp_path / "out" / "plots", f"curves_{'d' * 300}.png")
    assert len(name) <= 200 and name.endswith(".png") and name == bounded(f"curves_{'d' * 300}.png")
    assert read_in(tmp_path / "out", tmp_path / "out" / "plots" / name)[:4] == b"\x89PNG"


def test_the_helper_refuses_links_at_any_component_and_devices(tmp_path):
    """The helper itself: a link anywhere below the folder (a folder or the file), a FIFO, a device, a file over
    the cap: one line each; a write replaces a link at its target instead of following it."""
    from fdg_audit.store.safe import read_in, write_in
    root = tmp_path / "r"
    (root / "d").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "f").write_text("outside")
    (root / "ln").symlink_to(tmp_path / "out", target_is_directory=True)
    (root / "d" / "f").symlink_to(tmp_path / "out" / "f")
    (root / "big").write_bytes(b"x" * 100)
    for path, needle in (("ln/f", "not a folder"), ("d/f", "not a regular file"), ("big", "larger than")):
        with pytest.raises(UserError, match=needle):
            read_in(root, path, cap=10)
    with pytest.raises(UserError, match="not a regular file"):
        read_in(Path("/dev"), "null")
    with pytest.raises(UserError, match="not a folder"):
        write_in(root, "ln/new", b"x")
    write_in(root, "d/f", b"mine")
    assert (tmp_path / "out" / "f").read_text() == "outside" and (root / "d" / "f").read_bytes() == b"mine"
    assert not (root / "d" / "f").is_symlink() and read_in(root, "missing/x") is None
    shutil.rmtree(root)
