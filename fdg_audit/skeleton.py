"""``python -m fdg_audit new-method NAME`` / ``new-attack NAME``: a working plugin package to start from (as
``flwr new`` does): ``NAME/pyproject.toml`` with its entry point, ``NAME/src/NAME/__init__.py`` with the plugin, and
``NAME/tests/test_NAME.py`` that runs it. ``pip install -e NAME`` registers it."""
from __future__ import annotations

import re
from pathlib import Path

from .errors import UserError

PYPROJECT = '''[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1.0"
dependencies = ["fdg_audit"]

[project.entry-points."fdg_audit.{group}"]
{name} = "{name}:{cls}"

[tool.setuptools.packages.find]
where = ["src"]
'''

METHOD = '''"""{name}: FedAvg plus one artifact of its own per client in round 0 (kind "{name}_summary": each class's mean image).
Replace what you need; fdg_audit's methods/README.md is the how-to, the docstring of MethodPlugin the contract."""
from dataclasses import dataclass

import torch

from fdg_audit.api import load_method
from fdg_audit.api.method import Reply, register_kind

FedAvg = load_method("fedavg")          # subclass a built-in through the API
KIND = "{name}_summary"
register_kind(KIND)                     # a new kind is registered when this module is imported


@dataclass
class Params(FedAvg.Params):
    share_summary: bool = True          # your settings: [[methods]] keys, --set methods.{name}.share_summary=false


class Client(FedAvg.Client):
    def on_summary(self, msg):          # answers the server's self.ask("summary")
        k, x, y = self.shape[3], self.train.x, self.train.y
        means = torch.stack([x[y == c].mean(0) if (y == c).any() else torch.zeros(x.shape[1:]) for c in range(k)])
        return Reply(KIND, {{"means": means}})


class Server(FedAvg.Server):
    def begin(self):
        super().begin()                 # FedAvg's round 0: each client's n_samples
        if self.params.share_summary:
            self.summaries = self.ask("summary")


class {cls}(FedAvg):
    name = "{name}"
    Params, Server, Client = Params, Server, Client
    kinds = ("n_samples", KIND, "weights")   # every kind any party sends, and only those
'''

ATTACK = '''"""{name}: membership from the victim's last uploaded model: a candidate the model fits well (low loss) is scored
as a member. Replace what you need; fdg_audit's attacks/README.md is the how-to, fdg_audit/attack.py the contract."""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit.api import DataConfig, ModelConfig, build_model, load_data, metrics
from fdg_audit.api.attack import Attack, AttackParams, Control, Scores


@dataclass
class Params(AttackParams):
    temperature: float = 1.0            # your settings: [[attacks]] keys


def scores(model, x, y, temperature: float = 1.0) -> np.ndarray:
    """Minus each candidate's loss under the model (higher: more likely a member)."""
    with torch.no_grad():
        return (-F.cross_entropy(model(x) / temperature, y, reduction="none")).numpy()


class {cls}(Attack):
    name = "{name}"
    consumes = ("weights",)
    adversary = "server"
    aux = ("candidates",)
    outputs = {{"": "the candidate's loss under the victim's last uploaded model"}}
    Params = Params

    def run(self, view, aux):
        outs = []
        for victim in view.clients:
            ups = sorted(view.messages(kind="weights", sender=victim), key=lambda m: m.seq)
            if not ups or victim not in aux.candidates:
                continue
            model, c = view.model(ups[-1].payload.arrays), aux.candidates[victim]
            outs.append(Scores(victim, "weights", ups[-1].round, scores(model, c.x, c.y, self.p.temperature)))
        return outs

    def control(self):
        """A model trained to fit 16 digits scores them above 16 it never saw; two unseen sets are not told apart."""
        d = load_data(DataConfig(dataset="digits", per_domain=80, domains=["rot0"])).domains[0]
        x, y = d.train.x, d.train.y
        torch.manual_seed(0)
        net = build_model(ModelConfig(), x.shape[1], 10, x.shape[-1])
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        for _ in range(150):
            opt.zero_grad()
            F.cross_entropy(net(x[:16]), y[:16]).backward()
            opt.step()
        net.eval()
        s_in, s_out, s_out2 = (scores(net, x[a:a + 16], y[a:a + 16]) for a in (0, 16, 32))
        lab = np.r_[np.ones(16), np.zeros(16)]
        pos = metrics.auc(np.r_[s_in, s_out], lab)
        neg = abs(metrics.auc(np.r_[s_out, s_out2], lab) - 0.5)
        return [Control("members vs non-members (AUC)", "auc", float(pos), 0.8),
                Control("non-members vs non-members: |AUC - 0.5|", "auc", float(neg), 0.25, positive=False)]
'''

TEST_METHOD = '''"""{name} runs one round, sends only the kinds it declares, and every kind it sends is measured by some attack."""
import csv

from fdg_audit.runner import run_scenario

from {name} import KIND, {cls}

SCENARIO = """
name = "{name}_check"
threads = 1
report = false
attacks = "all"
{tiny}[train]
rounds = 1
batch_size = 16
[[methods]]
name = "{name}"
"""


def test_{name}_sends_its_kinds_and_each_is_measured(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SCENARIO)
    root = run_scenario(str(f), out=str(tmp_path / "runs"), quiet=True)
    with open(root / "coverage.csv") as fh:
        cov = {{r["kind"]: r for r in csv.DictReader(fh)}}
    assert set(cov) <= set({cls}.kinds) and KIND in cov
    assert cov[KIND]["status"] == "measured", cov[KIND]["status"]
'''

TEST_ATTACK = '''"""{name}'s controls pass, and on a real run it scores every victim it can see."""
import csv

from fdg_audit.runner import run_scenario

from {name} import {cls}

SCENARIO = """
name = "{name}_check"
threads = 1
report = false
{tiny}[train]
rounds = 2
batch_size = 16
[[methods]]
name = "fedavg"
[[attacks]]
name = "{name}"
"""


def test_{name}_controls_pass():
    assert all(c.passed for c in {cls}().control())


def test_{name}_scores_each_victim(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SCENARIO)
    root = run_scenario(str(f), out=str(tmp_path / "runs"), quiet=True)
    with open(root / "leakage.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["attack"] == "{name}" and r["metric"] == "auc"]
    assert {{r["victim"] for r in rows}} >= {{"rot15", "rot30"}} and all(r["status"] == "ok" for r in rows)
'''


TINY = """[data]
dataset = "digits"
domains = ["rot0", "rot15", "rot30"]
per_domain = 40
targets = ["rot0"]
split_seed = 0
"""


def new_plugin(kind: str, name: str, where: str = ".") -> Path:
    """Write the skeleton package of a method (``kind`` "method") or an attack ("attack") called ``name``."""
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,40}", name or ""):
        raise UserError(f"new-{kind} {name!r}: give a lower-case Python name (letters, digits, _), e.g. my_{kind}")
    root = Path(where) / name
    if root.exists():
        raise UserError(f"new-{kind} {name}: {root} already exists; choose another name or remove it")
    cls = "".join(p.capitalize() for p in name.split("_")) or "Plugin"
    fill = dict(name=name, cls=cls, group=kind + "s", tiny=TINY)
    files = {"pyproject.toml": PYPROJECT, f"src/{name}/__init__.py": METHOD if kind == "method" else ATTACK,
             f"tests/test_{name}.py": TEST_METHOD if kind == "method" else TEST_ATTACK}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text.format(**fill))
    return root
