"""Shared test helpers: build a tiny scenario (``tiny_scenario``) and run it from TOML text into a temporary folder."""
import copy
import csv
import os
import textwrap
from pathlib import Path

import pytest
import tomli_w
import torch

from fdg_audit.runner import run_scenario


if os.environ.get("PYTEST_XDIST_WORKER"):   # two workers on two cores: one torch thread each, not two
    torch.set_num_threads(1)


def pytest_configure(config):
    """Attack workers as forkserver processes (0.1 s each) rather than bubblewrap sandboxes (a fresh interpreter,
    about 2 s each), to keep the suite's time: tests/test_trust.py runs the bubblewrap sandbox itself where it works.
    ``FDG_AUDIT_SANDBOX=bwrap python -m pytest`` runs every attack test in it. (A hook, not module code: test
    modules are attack plugins that workers import.)"""
    os.environ.setdefault("FDG_AUDIT_SANDBOX", "process")


TINY = {"name": "t", "threads": 1, "report": False,
        "data": {"dataset": "digits", "family": "rotated", "domains": ["rot0", "rot15", "rot30"], "per_domain": 40,
                 "targets": ["rot0"]},
        "model": {"arch": "cnn_small"},
        "train": {"rounds": 1, "batch_size": 16},
        "methods": [{"name": "fedavg"}]}


def tiny_scenario(*layers: dict, **overrides) -> str:
    """The TOML text of a small real scenario (``TINY``: FedAvg on three rotated-digit domains of 40 images, one
    round of cnn_small, no report) changed by ``layers`` (dicts, e.g. a test module's own base) and then
    ``overrides``, each key replacing a top-level key: a table (dict) is merged into the scenario's own
    (``data=dict(per_domain=80)`` changes one key and keeps the others; a key set to None goes), any other value
    replaces it (``methods=[...]``, ``attacks=[...]``, ``seeds=[0, 1]``); None drops the key."""
    raw = copy.deepcopy(TINY)
    for layer in (*layers, overrides):
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                value = {k: v for k, v in {**raw[key], **value}.items() if v is not None}
            raw[key] = copy.deepcopy(value)
    return tomli_w.dumps({k: v for k, v in raw.items() if v is not None})


def public_split(text: str) -> str:
    """The scenario with ``split_seed = 0`` in each data table that sets none: a public split, so two run folders of
    the same scenario can be compared (unset, each folder draws a secret one), and ``seeds_draw_data = false`` unless
    the scenario says otherwise: every seed uses that public split, so a test can rebuild a run's data from the
    split seed alone (tests/test_yardstick.py checks the per-seed draws)."""
    text = textwrap.dedent(text)
    out = [] if "seeds_draw_data" in text else ["seeds_draw_data = false"]
    for line in textwrap.dedent(text).splitlines():
        out.append(line)
        if line.strip() in ("[data]", "[[datasets]]") and "split_seed" not in text:
            out.append("split_seed = 0")
    return "\n".join(out) + "\n"


@pytest.fixture
def one_thread():
    """Torch pinned to one thread for the test, restored after it. A float sum's bits depend on how many threads
    split it: an in-process run compared hash for hash with a worker's (``RunSpec.worker_threads``, 1) must use the
    same count, and a control that fits models is reproducible only at a fixed count."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def run_toml(tmp_path):
    """``run_toml(text, *sets) -> run folder``: write the scenario text (with a public split, ``public_split``) and
    run it quietly."""
    def run(text: str, *sets: str, name: str = "t"):
        f = tmp_path / f"{name}.toml"
        f.write_text(public_split(text))
        return run_scenario(str(f), list(sets), out=str(tmp_path / "runs"), quiet=True)
    return run


def leakage_rows(root, **match) -> list[dict]:
    """Rows of a run folder's leakage.csv whose columns equal the given values."""
    with open(Path(root) / "leakage.csv") as f:
        return [r for r in csv.DictReader(f) if all(r[k] == v for k, v in match.items())]
