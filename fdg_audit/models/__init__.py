"""Models split into trunk stages, a neck (last map -> flat feature) and a linear head.

``cnn_mnist`` is the standard MNIST CNN (184,586 parameters without norm layers at 1x28x28), ``cnn_small`` a narrower
copy, ``resnet18`` torchvision's ResNet-18 (optional dependency, imported only when asked for).
Nothing is downloaded: ``weights`` is a local state_dict file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fdg_audit.errors import UserError

ARCHS = ("cnn_small", "cnn_mnist", "resnet18")
NORMS = ("group", "batch", "none")
CNN_WIDTHS = {"cnn_small": (16, 32, 64), "cnn_mnist": (32, 64, 128)}  # conv1, conv2, feature dim
TORCHVISION_MISSING = ("resnet18 needs torchvision: pip install 'fdg_audit[vision]' (a CUDA build of torch; "
                       "on CPU-only machines use arch = \"cnn_mnist\")")


@dataclass
class ModelConfig:
    arch: str = "cnn_small"  # "cnn_small" | "cnn_mnist" | "resnet18"
    norm: str = "group"  # "group" | "batch" | "none"  (GroupNorm by default: Opacus refuses BatchNorm)
    weights: str = ""  # optional local state_dict file (never downloaded)
    pretrain_epochs: int = 0  # > 0: the server trains the model this many epochs on data.public before round 0, and
                              # every model the server builds starts from it (fdg_audit.train.federation.pretrain_public)


class Net(nn.Module):
    """trunk (stages of feature maps) -> neck (flat feature of size feature_dim) -> head (class logits)."""

    def __init__(self, trunk: list[nn.Module], neck: nn.Module, head: nn.Linear, feature_dim: int):
        super().__init__()
        self.trunk = nn.ModuleList(trunk)
        self.neck = neck
        self.head = head
        self.feature_dim = feature_dim

    def stages(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Output of every trunk stage, in order."""
        outs = []
        for stage in self.trunk:
            x = stage(x)
            outs.append(x)
        return outs

    def features(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.trunk:
            x = stage(x)
        return self.neck(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _norm(kind: str, ch: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(min(8, ch), ch)
    if kind == "batch":
        return nn.BatchNorm2d(ch)
    return nn.Identity()


def _cnn(arch: str, norm: str, channels: int, num_classes: int, size: int) -> Net:
    c1, c2, dim = CNN_WIDTHS[arch]
    side = ((size - 4) // 2 - 4) // 2
    if side < 1:
        raise UserError(f"{arch} needs images of at least 16x16, got {size}x{size}: raise data.image_size")
    trunk = [nn.Sequential(nn.Conv2d(channels, c1, 5), _norm(norm, c1), nn.ReLU(), nn.MaxPool2d(2)),
             nn.Sequential(nn.Conv2d(c1, c2, 5), _norm(norm, c2), nn.ReLU(), nn.MaxPool2d(2))]
    neck = nn.Sequential(nn.Flatten(), nn.Linear(c2 * side * side, dim), nn.ReLU())
    return Net(trunk, neck, nn.Linear(dim, num_classes), dim)


def _resnet18(norm: str, channels: int, num_classes: int) -> Net:
    try:
        import torchvision
    except Exception:  # missing, or broken against this torch build
        raise UserError(TORCHVISION_MISSING) from None
    layer = {"group": lambda c: nn.GroupNorm(32, c), "batch": nn.BatchNorm2d, "none": lambda c: nn.Identity()}[norm]
    r = torchvision.models.resnet18(weights=None, num_classes=num_classes, norm_layer=layer)
    if channels != 3:
        r.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
    neck = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return Net([stem, r.layer1, r.layer2, r.layer3, r.layer4], neck, r.fc, r.fc.in_features)


def _torchvision_names(sd: dict) -> dict:
    """Rename torchvision ResNet keys (conv1, bn1, layerK, fc) to Net keys; Net keys pass unchanged."""
    out = {}
    for k, v in sd.items():
        head, _, rest = k.partition(".")
        if head in ("conv1", "bn1"):
            k = f"trunk.0.{0 if head == 'conv1' else 1}.{rest}"
        elif head in ("layer1", "layer2", "layer3", "layer4"):
            k = f"trunk.{head[-1]}.{rest}"
        elif head == "fc":
            k = f"head.{rest}"
        out[k] = v
    return out


def load_weights(net: Net, path: str | Path, arch: str) -> None:
    """Load a local state_dict into net; a head of the wrong class count is skipped (kept at random init)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"weights file {path} not found: "
                        f"set model.weights to a local state_dict file or leave it empty")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"weights file {path} could not be read ({e}): "
                        f"save it with torch.save(model.state_dict(), path)") from None
    if not isinstance(sd, dict):
        raise UserError(f"weights file {path} holds a {type(sd).__name__}, not a state_dict: save model.state_dict()")
    if arch == "resnet18":
        sd = _torchvision_names(sd)
    own = net.state_dict()
    sd = {k: v for k, v in sd.items() if not (k.startswith("head.") and k in own and v.shape != own[k].shape)}
    bad = [k for k, v in sd.items() if k in own and v.shape != own[k].shape]
    missing = [k for k in own if k not in sd and not k.startswith("head.")]
    unexpected = [k for k in sd if k not in own]
    if bad or missing or unexpected:
        bn = any("running_" in k for k in unexpected)
        hint = " (a BatchNorm checkpoint needs model.norm = \"batch\")" if bn else ""
        raise UserError(f"weights file {path} does not fit {arch} (shape mismatch: {bad[:3]}, missing: {missing[:3]}, "
                        f"unexpected: {unexpected[:3]}): use a state_dict saved from the same arch/norm/channels{hint}")
    net.load_state_dict(sd, strict=False)


def build_model(cfg: ModelConfig, channels: int, num_classes: int, size: int) -> Net:
    """The Net that cfg describes for (channels, size, size) inputs and num_classes classes, on CPU."""
    if cfg.arch not in ARCHS:
        raise UserError(f"unknown model.arch {cfg.arch!r}: use one of {', '.join(ARCHS)}")
    if cfg.norm not in NORMS:
        raise UserError(f"unknown model.norm {cfg.norm!r}: use one of {', '.join(NORMS)}")
    if cfg.arch == "resnet18":
        net = _resnet18(cfg.norm, channels, num_classes)
    else:
        net = _cnn(cfg.arch, cfg.norm, channels, num_classes, size)
    if cfg.weights:
        load_weights(net, cfg.weights, cfg.arch)
    return net


__all__ = ["ARCHS", "NORMS", "ModelConfig", "Net", "build_model", "load_weights"]
