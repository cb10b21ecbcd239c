"""Attacks on the ``features`` channel (attacks/features.py): controls, helpers, and an end-to-end run on a tiny
federation of ``StandIn``, a FedAvg whose clients also send the representation of one training batch each round,
computed half-way through local training, as FADA's clients send theirs (kind "features", {"features": (N, D)},
truth ``features_r<round>``, public ``encode(model, x)``); it is run by "module:Class" name like any third-party
method."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attacks.features import (FeatureAttribute, FeatureInversion, FeatureMembership, feature_uploads,
                              membership_scores, nearest_distance, round_models)
from fdg_audit import metrics as M
from fdg_audit.api import Split
from fdg_audit.api.attack import AdversaryView, Aux
from fdg_audit.api.method import MethodPlugin, Reply, make_optimizer, register_kind
from fdg_audit.audit.harness import load_runs
from fdg_audit.store.ledger import Ledger
from fdg_audit.audit.scoring import Truth, build_aux
from methods.fedavg import FedAvgClient, FedAvgServer, Params

from conftest import leakage_rows as rows, tiny_scenario

register_kind("features")


def encode(model, x):
    return model.features(x)


class StandInClient(FedAvgClient):
    def local_update(self):
        p, m = self.params, self.model
        sent = torch.randperm(len(self.train.y), generator=self.gen)[:p.batch_size]
        opt = make_optimizer(p, m.parameters())
        batches = list(self.batch_indices())
        for i, j in enumerate(batches):
            if i == len(batches) // 2:   # the rows: computed during local training, between broadcast and upload
                with torch.no_grad():
                    self.rows = encode(m.eval(), self.train.x[sent])
                self.record_truth(f"features_r{self.round}", idx=self.train.idx[sent.numpy()])
            m.train()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(self.train.x[j]), self.train.y[j]).backward()
            opt.step()

    def on_features(self, msg):
        return Reply("features", {"features": self.rows})


class StandInServer(FedAvgServer):
    def step(self, t):
        super().step(t)
        self.ask("features")


class StandIn(MethodPlugin):
    name = "standin"
    Params = Params
    Server = StandInServer
    Client = StandInClient
    kinds = ("n_samples", "weights", "features")
    encode = staticmethod(encode)


HERE = __name__
ATK = {a.name: f"attacks.features:{a.__name__}" for a in (FeatureInversion, FeatureMembership, FeatureAttribute)}
SCENARIO = tiny_scenario(
    name="feat", report=None, data=dict(domains=["rot0", "rot15", "rot30"], targets=["rot30"], per_domain=None),
    train=dict(rounds=2, batch_size=32), methods=[dict(name=f"{HERE}:StandIn")],
    attacks=[dict(name=ATK[k], label=k) for k in ("feature_membership", "feature_attribute")]
    + [dict(name=ATK["feature_inversion"], label="feature_inversion", max_victims=1, epochs=20)])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from conftest import public_split
    from fdg_audit.runner import run_scenario
    out = tmp_path_factory.mktemp("feat")
    (out / "s.toml").write_text(public_split(SCENARIO))
    return run_scenario(str(out / "s.toml"), out=str(out / "runs"), quiet=True)


def server_view(root):
    runs, data = load_runs(root)
    run = next(iter(runs.values()))
    return run, data[run.run], AdversaryView(Ledger.open(root), run.protocol(), "server", "server",
                                             torch.device("cpu"))


def test_every_control_passes_in_the_run(root):
    """Each attack's positive controls succeed and its negative controls stay at chance (the harness ran them)."""
    ctl = json.loads((Path(root) / "controls.json").read_text())
    for name in ATK:
        mine = [c for c in ctl if c["attack"] == name]
        assert any(c["positive"] for c in mine) and any(not c["positive"] for c in mine), name
        assert all(c["passed"] for c in mine), mine
    assert all(r["status"] == "ok" for r in rows(root))


def test_access_helpers(root):
    run, data, view = server_view(root)
    ups = feature_uploads(view, rnd=0)
    assert sorted({v for v, _, _ in ups}) == ["rot0", "rot15"] and {r for _, r, _ in ups} == {1, 2}
    assert all(f.shape == (32, 64) for _, _, f in ups)
    path = round_models(view, "rot0", 2, "path", 3)
    up, down = round_models(view, "rot0", 2, "upload", 1)[0], round_models(view, "rot0", 2, "broadcast", 1)[0]
    x = data.domain("rot0").train.x[:4]
    assert len(path) == 3 and torch.equal(path[0](x), down(x)) and torch.equal(path[-1](x), up(x))
    e = torch.randn(2, 5, 8)
    d = nearest_distance(e, e[1, :3])        # rows = the first 3 candidates' encodings under the second model
    assert (d[:3] == 0).all() and (d[3:] > 0).all()
    assert torch.allclose(membership_scores(torch.stack([d, 3 * d])), membership_scores(d[None]))   # scale-free


def test_membership_finds_the_sent_images(root):
    """On a pool of every image whose rows were sent and the victim's validation images, the attack separates them,
    although the rows were computed half-way through local training (neither end of the path); the scorer reports
    the AUC over the harness's pool (bounded by the share of members sent) against baseline 0.5."""
    run, data, view = server_view(root)
    truth = Truth(root, run.run, data)
    pools, labels = {}, {}
    for v in ("rot0", "rot15"):
        sent = np.unique(np.concatenate([truth.record(v, f"features_r{r}")["idx"] for r in (1, 2)]))
        val = data.domain(v).val
        pools[v] = Split(torch.cat([truth.images(sent)[0], val.x]), torch.cat([truth.images(sent)[1], val.y]),
                         np.arange(len(sent) + len(val.y)))
        labels[v] = np.r_[np.ones(len(sent)), np.zeros(len(val.y))]
    outs = FeatureMembership().run(view, Aux(candidates=pools, domains=["rot0", "rot15"]))
    assert sorted(o.victim for o in outs) == ["rot0", "rot15"] and all(o.round == 2 for o in outs)
    assert min(M.auc(o.scores, labels[o.victim]) for o in outs) >= 0.75
    for v in ("rot0", "rot15", "pooled"):
        (r,) = rows(root, attack="feature_membership", victim=v, metric="auc")
        blind = rows(root, attack="feature_membership", victim=v, metric="blind_auc")[0]   # no model: the floor
        assert float(r["baseline"]) == max(0.5, float(blind["value"])) and 0 <= float(r["value"]) <= 1


def test_inversion_and_its_baseline_are_scored_the_same_way(root):
    """One reconstruction per sent row, scored against the rows' true images; the baseline is, per row, the better of
    the mean public image and the flat image (fdg_audit.audit.scoring: the same for every channel), aligned alike."""
    run, data, _ = server_view(root)
    (r,) = rows(root, attack="feature_inversion", metric="psnr")
    assert r["round"] == "2" and r["victim"] in ("rot0", "rot15")
    truth = Truth(root, run.run, data)
    x = truth.images(truth.record(r["victim"], "features_r2")["idx"])[0]
    pub = data.domain("rot30")
    mean = M.aligned(torch.cat([pub.train.x, pub.val.x]).mean(0, keepdim=True).expand_as(x).contiguous(), x)
    flat = x.mean((2, 3), keepdim=True).expand_as(x)
    best = torch.maximum(M.psnr(mean, x), M.psnr(flat, x))
    assert float(r["baseline"]) == pytest.approx(float(best.mean()), abs=1e-3)
    assert np.isfinite(float(r["value"]))   # on another domain it need not beat the mean image (module docstring)
    assert {x["metric"] for x in rows(root, attack="feature_inversion")} >= {"psnr", "ssim", "success@25dB"}


def test_attributes_of_the_rows(root):
    out = {(x["victim"], x["output"], x["metric"]): x for x in rows(root, attack="feature_attribute")}
    for v in ("rot0", "rot15"):
        cls, head = out[(v, "public", "class_balanced_acc")], out[(v, "own_head", "class_balanced_acc")]
        dom = out[(v, "domain_samples", "domain_balanced_acc")]
        assert float(cls["baseline"]) == float(head["baseline"]) == 0.1 and float(dom["baseline"]) == 0.5
        assert float(head["value"]) > 0.5                           # the victim's own head reads the class
        assert float(cls["value"]) > 0.1


def test_a_client_of_the_held_out_domain_is_skipped(root):
    run, data, view = server_view(root)
    aux, _ = build_aux(data, run.target, ("public",), run.seed)
    aux.domains = ["rot0"]           # as if rot15 were an adaptation method's target (the held-out domain)
    outs = FeatureInversion(FeatureInversion.Params(epochs=1)).run(view, aux)
    assert [o.reason for o in outs if o.victim == "rot15"] == ["a client of the held-out domain: its images are "
                                                               "the public data"]
