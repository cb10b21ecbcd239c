import sys

import pytest
import torch
from torch import nn

from fdg_audit.errors import UserError
from fdg_audit.models import ModelConfig, Net, build_model

try:
    import torchvision  # noqa: F401
    HAS_TORCHVISION = True
except Exception:  # missing, or installed but broken against this torch
    HAS_TORCHVISION = False


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_cnn_mnist_parameter_count():
    net = build_model(ModelConfig(arch="cnn_mnist", norm="none"), channels=1, num_classes=10, size=28)
    assert n_params(net) == 184_586
    assert net.feature_dim == 128 and net.head.in_features == 128
    assert net.trunk[0][0].out_channels == 32 and net.trunk[1][0].out_channels == 64
    assert n_params(build_model(ModelConfig(arch="cnn_small", norm="none"), 1, 10, 28)) < 50_000


@pytest.mark.parametrize("arch", ["cnn_small", "cnn_mnist"])
@pytest.mark.parametrize("channels,size", [(1, 28), (3, 28), (3, 32), (1, 32)])
def test_shapes_and_split(arch, channels, size):
    torch.manual_seed(0)
    net = build_model(ModelConfig(arch=arch), channels, num_classes=7, size=size).eval()
    x = torch.rand(3, channels, size, size)
    out = net(x)
    assert out.shape == (3, 7)
    maps = net.stages(x)
    assert len(maps) == len(net.trunk) == 2 and all(m.dim() == 4 for m in maps)
    assert maps[0].shape[2] == (size - 4) // 2
    feats = net.features(x)
    assert feats.shape == (3, net.feature_dim)
    assert torch.allclose(feats, net.neck(maps[-1]))
    assert torch.allclose(out, net.head(feats))
    assert (feats >= 0).all()  # neck ends in ReLU


def test_norm_layers():
    mods = lambda net: [type(m) for m in net.modules()]
    group = build_model(ModelConfig(), 3, 10, 28)
    assert mods(group).count(nn.GroupNorm) == 2 and nn.BatchNorm2d not in mods(group)
    batch = build_model(ModelConfig(norm="batch"), 3, 10, 28)
    assert mods(batch).count(nn.BatchNorm2d) == 2 and nn.GroupNorm not in mods(batch)
    none = build_model(ModelConfig(norm="none"), 3, 10, 28)
    assert nn.GroupNorm not in mods(none) and nn.BatchNorm2d not in mods(none)


def test_config_errors():
    with pytest.raises(UserError, match="cnn_small, cnn_mnist, resnet18"):
        build_model(ModelConfig(arch="vgg"), 1, 10, 28)
    with pytest.raises(UserError, match="group, batch, none"):
        build_model(ModelConfig(norm="layer"), 1, 10, 28)
    with pytest.raises(UserError, match="image_size"):
        build_model(ModelConfig(), 1, 10, 12)


def test_weights_round_trip(tmp_path):
    torch.manual_seed(1)
    src = build_model(ModelConfig(arch="cnn_small"), 1, 10, 28)
    path = tmp_path / "w.pt"
    torch.save(src.state_dict(), path)
    torch.manual_seed(2)
    fresh = build_model(ModelConfig(arch="cnn_small"), 1, 10, 28)
    loaded = build_model(ModelConfig(arch="cnn_small", weights=str(path)), 1, 10, 28)
    x = torch.rand(2, 1, 28, 28)
    assert torch.equal(loaded(x), src(x)) and not torch.allclose(fresh(x), src(x))
    # a different class count: the head is skipped, the rest loads
    other_head = build_model(ModelConfig(arch="cnn_small", weights=str(path)), 1, 4, 28)
    assert torch.equal(other_head.features(x), src.features(x))
    with pytest.raises(UserError, match="missing.pt"):
        build_model(ModelConfig(weights=str(tmp_path / "missing.pt")), 1, 10, 28)
    with pytest.raises(UserError, match="w.pt"):
        build_model(ModelConfig(arch="cnn_mnist", weights=str(path)), 1, 10, 28)
    bn_path = tmp_path / "bn.pt"
    torch.save(build_model(ModelConfig(norm="batch"), 1, 10, 28).state_dict(), bn_path)
    with pytest.raises(UserError, match='bn.pt.*running_mean.*norm = "batch"'):
        build_model(ModelConfig(weights=str(bn_path)), 1, 10, 28)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="bad.pt could not be read"):
        build_model(ModelConfig(weights=str(bad)), 1, 10, 28)


def test_resnet18_without_torchvision(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(UserError, match=r"resnet18 needs torchvision: pip install 'fdg_audit\[vision\]'.*cnn_mnist"):
        build_model(ModelConfig(arch="resnet18"), 3, 7, 32)


@pytest.mark.skipif(not HAS_TORCHVISION, reason="torchvision not installed")
def test_resnet18():
    net = build_model(ModelConfig(arch="resnet18", norm="batch"), 3, 7, 32)
    assert isinstance(net, Net) and n_params(net) == 11_180_103 and net.feature_dim == 512
    x = torch.rand(2, 3, 32, 32)
    maps = net.eval().stages(x)
    assert len(maps) == 5 and maps[-1].shape[1] == 512
    assert torch.allclose(net(x), net.head(net.neck(maps[-1])))
    group = build_model(ModelConfig(arch="resnet18"), 1, 10, 28)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in group.modules())
    assert group(torch.rand(2, 1, 28, 28)).shape == (2, 10)
