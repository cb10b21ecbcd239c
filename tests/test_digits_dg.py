import socket

import numpy as np
import pytest
import torch

from fdg_audit.data import DataConfig, load_data
from fdg_audit.data import digits_dg
from fdg_audit.errors import UserError


@pytest.fixture(scope="module")
def family():
    return load_data(DataConfig(family="digits_dg"))


def pixels(ds, name):
    d = ds.domain(name)
    return torch.cat([d.train.x, d.val.x])


def test_builds_offline_from_package_files(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("digits_dg tried to open a network connection")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    ds = load_data(DataConfig(family="digits_dg", per_domain=60))
    assert ds.names == ["mnist", "mnistm", "syn"] and (ds.channels, ds.size, ds.num_classes) == (3, 28, 10)
    ids = np.concatenate([s.idx for d in ds.domains for s in (d.train, d.val)])
    assert len(ids) == 180 and len(np.unique(ids)) == 180      # every domain its own digits
    for d in ds.domains:
        for s in (d.train, d.val):
            assert s.x.shape == (len(s.y), 3, 28, 28) and s.x.dtype == torch.float32
            assert s.x.min() >= 0 and s.x.max() <= 1
    assert ds.layout["support"] == {"mnist": "frame", "mnistm": "full", "syn": "full"}
    assert len(digits_dg.read_photos()) == 14 and digits_dg.glyphs().shape == (15, 3, 10, 64, 64)


def test_mnist_domain_is_the_mnist_digits(family):
    from fdg_audit.data.mnist import read_mnist_5k
    images, labels = read_mnist_5k()
    d = family.domain("mnist").train
    assert torch.equal(d.x[:, 0], torch.as_tensor(images[d.idx], dtype=torch.float32) / 255)
    assert torch.equal(d.x[:, 0], d.x[:, 2]) and torch.equal(d.y, torch.as_tensor(labels[d.idx]))


def test_same_split_seed_same_images_other_seed_other_images(family):
    again = load_data(DataConfig(family="digits_dg", split_seed=0))
    other = load_data(DataConfig(family="digits_dg", split_seed=1, domains=["mnistm", "syn"]))
    for name in ("mnistm", "syn"):
        assert torch.equal(pixels(family, name), pixels(again, name))
        a, b = family.domain(name).train, other.domain(name).train
        n = min(len(a), len(b))
        assert (a.x[:n] - b.x[:n]).abs().amax(dim=(1, 2, 3)).min() > 0.1


def test_mnistm_background_is_full_frame(family):
    assert (pixels(family, "mnist").amax(1) == 0).float().mean() > 0.5      # MNIST: mostly empty
    x = pixels(family, "mnistm")
    assert (x == 0).float().mean() <= 0.05
    assert (x.amax(1) == 0).float().mean() <= 0.05
    # |patch - digit|: where the digit is 0 the patch shows, varied across images
    assert x.mean(dim=(1, 2, 3)).std() > 0.05


def test_syn_digits_are_learnable(family):
    def features(x):     # polarity-free foreground: distance of each grey pixel from the image's median (background)
        g = x.mean(1).flatten(1)
        g = (g - g.median(1, keepdim=True).values).abs()
        return g / g.norm(dim=1, keepdim=True)

    d = family.domain("syn")
    a, b = features(d.train.x), features(d.val.x)
    centroids = torch.stack([a[d.train.y == c].mean(0) for c in range(10)])
    acc = (torch.cdist(b, centroids).argmin(1) == d.val.y).float().mean()
    assert acc > 0.4      # chance is 0.1


def test_missing_source_file_is_one_line_error(monkeypatch):
    monkeypatch.setattr(digits_dg, "PHOTOS", {"skimage": ("data", ("astronaut.png", "no_such_photo.png"))})
    with pytest.raises(UserError, match="no_such_photo.png.*pip install --force-reinstall scikit-image") as e:
        load_data(DataConfig(family="digits_dg", domains=["mnistm"], per_domain=20))
    assert "\n" not in str(e.value)
    monkeypatch.setattr(digits_dg, "FONTS", ("NoSuchFont.ttf",))
    with pytest.raises(UserError, match="NoSuchFont.ttf.*matplotlib") as e:
        load_data(DataConfig(family="digits_dg", domains=["syn"], per_domain=20))
    assert "\n" not in str(e.value)


def test_public_domain_and_refusals():
    ds = load_data(DataConfig(family="digits_dg", per_domain=40, public="syn"))
    assert ds.names == ["mnist", "mnistm"] and ds.public_name == "syn" and len(ds.public.y) == 40
    run = np.concatenate([s.idx for d in ds.domains for s in (d.train, d.val)])
    assert not set(run) & set(ds.public.idx)
    with pytest.raises(UserError, match="dataset = \"mnist\""):
        load_data(DataConfig(dataset="digits", family="digits_dg"))
    with pytest.raises(UserError, match="SVHN has no offline source"):
        load_data(DataConfig(family="digits_dg", domains=["mnist", "svhn"]))
    with pytest.raises(UserError, match="disjoint"):
        load_data(DataConfig(family="digits_dg", protocol="standard"))
