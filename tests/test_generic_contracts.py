"""Contracts checked at run time, at the conformance test's strength: a kind sent but not declared, a declared kind
that is not registered or no kinds at all (at plan time), and attack outputs of the wrong shape or out of range
(refused with one line naming the expected shape and range, never clamped)."""
import pytest
import torch

from fdg_audit.api import UserError, load_method, records
from fdg_audit.api.attack import Attack, Reconstruction
from fdg_audit.api.method import MethodPlugin
from conftest import leakage_rows, tiny_scenario

HERE = __name__
FedAvg = load_method("fedavg")


class Undeclared(FedAvg):
    name = "undeclared"
    kinds = ("n_samples",)             # it also sends weights


class Unregistered(FedAvg):
    name = "unregistered"
    kinds = ("n_samples", "weights", "no_such_kind")


class NoKinds(FedAvg):
    name = "nokinds"
    kinds = ()


def test_a_kind_sent_but_not_declared_stops_the_run_with_one_line(run_toml):
    with pytest.raises(UserError, match=r"sent kind 'weights'.*does not declare"):
        run_toml(tiny_scenario(methods=[{"name": f"{HERE}:Undeclared"}]))


@pytest.mark.parametrize("cls, needle", [("Unregistered", "'no_such_kind', which is not registered"),
                                         ("NoKinds", "declares no kinds")])
def test_bad_declarations_are_refused_at_plan_time(run_toml, tmp_path, cls, needle):
    with pytest.raises(UserError, match=needle):
        run_toml(tiny_scenario(methods=[{"name": f"{HERE}:{cls}"}]))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("messages.jsonl"))


class Recon(Attack):
    """Returns one image per victim: the victim's first public image at a wrong size or scale (``how``)."""
    name = "bad_recon"
    consumes = ("weights",)
    outputs = {"": "test"}
    how = ""

    def run(self, view, aux):
        c, s, _ = view.shape
        x = torch.full((1, c, s, s), 0.5)
        if self.how == "shape":
            x = x[..., :14, :14]
        elif self.how == "scale":
            x = x * 255
        return [Reconstruction(view.clients[0], "weights", 1, x, truth=records.TRAIN)]


class WrongShape(Recon):
    name, how = "wrong_shape", "shape"


class WrongScale(Recon):
    name, how = "wrong_scale", "scale"


@pytest.mark.parametrize("cls, needle", [("WrongShape", "expected (N, 1, 28, 28)"),
                                         ("WrongScale", "expected pixels in [0, 1]"),
                                         ("Recon", None)])
def test_reconstructions_of_wrong_shape_or_range_are_refused_not_clamped(run_toml, cls, needle):
    root = run_toml(tiny_scenario(attacks=[{"name": f"{HERE}:{cls}"}]))
    rows = leakage_rows(root)
    assert rows
    if needle is None:      # the same attack with a right image is scored
        assert {r["status"] for r in rows} == {"ok"} and "reid" in {r["metric"] for r in rows}
    else:
        assert all(needle in r["status"] for r in rows), {r["status"] for r in rows}
        assert not any(r["metric"] == "reid" for r in rows)
