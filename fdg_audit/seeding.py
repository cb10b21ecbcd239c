"""Every random stream of fdg_audit is derived here, from a key of integers and strings.

``seq(*key)`` is ``numpy.random.SeedSequence(key)`` with each string replaced by its CRC-32, so ``rng(a, b)`` is
exactly ``numpy.random.default_rng([a, b])`` for integers. A stream names itself by a constant of this module as
one element of its key, so two uses never share a stream by accident:

* a run: ``run_seq(seed, run_id)``; a party's call: ``party_seq(run, party, round, call)`` (the engines reseed
  each party from it before every call, so every engine gives the same ledger on CPU); the round's sample of
  clients: ``SAMPLE``; canaries and coins: ``CANARY``; DP noise: ``NOISE``; attack victims: ``VICTIMS``.
* data splits take ``(split_seed, <stream number>)`` keys in fdg_audit.data (unchanged, so splits are stable); a run's
  split seed is ``seed_int(secret split seed, DRAW, run seed)`` (``DataConfig.draw``), so each seed draws its data.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

SAMPLE, CANARY, NOISE, VICTIMS, SCORE, DRAW = 2 ** 31, 0xCA7A, 0xD9A5, 0x5643, 0x5C0E, 0xD4A3


def _int(k) -> int:
    return zlib.crc32(k.encode()) if isinstance(k, str) else int(k)


def seq(*key) -> np.random.SeedSequence:
    """The seed sequence of ``key`` (integers >= 0 and strings)."""
    return np.random.SeedSequence([_int(k) for k in key])


def rng(*key) -> np.random.Generator:
    return np.random.default_rng(seq(*key))


def seed_int(*key) -> int:
    """A 63-bit integer seed (for torch generators) from ``key``."""
    return int(seq(*key).generate_state(1, np.uint64)[0] & 0x7FFF_FFFF_FFFF_FFFF)


def torch_gen(*key, device=None) -> torch.Generator:
    return torch.Generator(device=device or "cpu").manual_seed(seed_int(*key))


def run_seq(seed: int, run_id: str) -> np.random.SeedSequence:
    """The root of one run's streams: its master seed and its id."""
    return seq(seed, run_id)


def child(root: np.random.SeedSequence, *spawn_key: int) -> np.random.SeedSequence:
    """A stream under a run's root, e.g. ``child(root, party, round, call)`` or ``child(root, SAMPLE, round)``."""
    return np.random.SeedSequence(root.entropy, spawn_key=tuple(int(k) for k in spawn_key))


def seed32(*key) -> int:
    """A 32-bit integer seed from ``key`` (for APIs that take one, e.g. an attack's ``seed`` parameter)."""
    return int(seq(*key).generate_state(1)[0])
