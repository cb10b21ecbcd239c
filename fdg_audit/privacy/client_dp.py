"""Client-level DP (McMahan et al. 2018) as a bus mod on every model-like upload, for any method.

    [privacy.client]
    clip = 1.0                 # C: L2 bound of one client's update per release
    noise_multiplier = 1.0     # sigma: Gaussian noise N(0, (sigma C)^2) per coordinate (local mode)
    target_epsilon = 0.0       # > 0: sigma calibrated to this client-level epsilon instead (Opacus get_noise_multiplier)
    mode = "local"             # local (untrusted server) | central (trusted aggregator)
    kinds = ["weights", "delta", "head", "generator"]

Which artifacts are updates. Every client upload of a kind in ``kinds`` (default: the model-like kinds: full or
partial model states, classifier heads, generators) is privatized; its arrays are read as a delta from what this
client last received under the same array name (or ``<client>/<name>``, for a server that relays one array per
client): ``u = upload - received``, zero where nothing was received (a client that starts from its own model:
the whole state is then the update). The mod sees each party's requests through the bus's ``Mod.request`` hook.
All float arrays of one upload are clipped jointly, ``u * min(1, C / ||u||)``; the client sends
``received + clipped u + noise``. Non-float arrays (BatchNorm's ``num_batches_tracked``) are sent as received
(their local count is dropped); where nothing was received they cannot be protected and the run stops. Scalars on
an update are refused. Kinds outside ``kinds`` (banks, styles, prototypes, ``n_samples``, metrics) are not
touched: they need their own mechanism (``[privacy.artifacts]``) or stay outside the guarantee.

Modes (named in the envelope's event):
* ``local``: noise N(0, (sigma C)^2) on each upload at the client, against an untrusted server that sees every
  upload. The server's relays are post-processing.
* ``central``: McMahan et al.'s trusted aggregator, implemented as *distributed* noise: each client adds
  N(0, sigma^2 C^2 / K) to its own upload, K the clients the server asks per training round (round(f K') of K'
  clients at participation f, as ``federation.participants`` samples them), so the uniform mean the server computes
  over them carries exactly the N(0, (sigma C / K)^2) that a trusted server would add to the mean of K clipped
  updates (tests/test_client_dp.py measures the aggregate's multiplier at f = 0.3, 0.5, 1). A round that asks every
  client (an update in round 0) then carries more noise than that, never less. No client of this engine
  drops out of a round it was asked to; one that did would lower the aggregate's noise. There is no
  trusted party in the code: the guarantee needs (a) secure aggregation, or a server trusted not to read
  individual uploads (each upload alone carries only sigma / sqrt(K) of noise: its epsilon against a server that
  reads it is that of multiplier sigma / sqrt(K), far larger; the ledger's uploads show what such a server sees),
  and (b) all K clients to add their share honestly (a dropped or colluding client lowers the aggregate's noise).
  The epsilon holds for the aggregate and everything derived from it (the global model, what other clients
  receive). It needs a uniform mean (sensitivity C / K), or a weighted mean whose weights are at most rho / K and
  come from privatized statistics only (the method's ``aggregate_share`` rho; each client then adds
  N(0, rho^2 sigma^2 C^2 / K), so the weighted mean carries at least multiplier sigma for its largest weight, and
  an upload alone carries rho sigma / sqrt(K)): methods without either are refused at plan time. The update audit
  reads central-mode runs' broadcast aggregates, not the individual uploads.

Adaptive clipping (Andrew et al. 2021, "Differentially private learning with adaptive clipping"), an option::

    adaptive = { target_quantile = 0.5, lr = 0.2, bit_noise = 0.0 }   # clip is then the initial C_0

Each release also carries the clipped-count term b - 1/2 (b = 1 when the update's norm is at most C_t) with noise
sigma_b (``bit_noise``; 0 = K / 20, the paper's choice; sigma_b / sqrt(K) per client in central mode), recorded in
the envelope's event (``clipped_bit``: what the server reads). After a round s, every client's next C is
C_s exp(-lr (b_s - target_quantile)), b_s the mean of round s's released terms + 1/2 (the paper's geometric
update). The pair (update, count) is one Gaussian mechanism of multiplier sigma when the update takes
sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^-1/2 (the paper's Theorem 1; the terms have sensitivity 1/2 under
zero-out), so the accounting is unchanged at the configured (or calibrated) sigma; the event records
``update_noise_multiplier`` = sigma_Delta. Plan refuses sigma_b too small to leave a budget (2 sigma_b <= sigma),
and engines other than ``local`` (the filter needs every client's term of the round in one process).

Neighbouring relation ("one client", zero-out, Kairouz et al. 2021): one client's update replaced by zero (the
client contributes nothing). Sensitivity C (local) or C / K (central), so each release is a Gaussian mechanism
with noise multiplier sigma. One example changes one client's update by at most 2C, so for the example-level
relation the same release counts at sigma / 2 (that is how it enters a party's ``total``).

Accounting (Opacus accountant used stand-alone, per (run, client)): one step at sampling rate q = 1 for every round
in which the client released, whatever ``participation`` is: the server draws the round's sample and knows it, so
sampling amplifies nothing against it (nor against a client that learns who took part), and a round without a
release costs nothing. A round in which a method releases m updates (e.g. a trunk and a head) counts as one step at
sigma / sqrt(m) (m Gaussian releases of sensitivity C with the same coin compose to that exactly).

Epsilon per adversary (``epsilon_by`` in each event, one privacy.csv row per adversary): the same history with each
step's multiplier scaled by what that adversary reads. Local mode: the server and an eavesdropper read each upload
(sigma); a client reads only the server's mean of the K uploads when the method's server takes a uniform mean
(sigma sqrt(K): sensitivity C / K, noise sigma C / sqrt(K)), else it may read uploads relayed one by one (sigma).
Central mode: a client reads the aggregate (sigma); the server without secure aggregation and an eavesdropper read
each upload (sigma / sqrt(K)). ``epsilon`` is the mode's headline: against the server (local), against everyone
who reads the aggregate (central).

Audit (``[privacy.audit] update_canaries = m``, read by an audit attack plugin): canary clients in the
sense of Andrew et al. 2024, for the one-run audit of Steinke et al. 2023. Canary j is a public random unit
direction u_j of the update's space (``update_canaries``, from the audit seed); it joins an audited client's
releases with probability 1/2 (``canary_coins``, the truth record ``update_canaries``) as a virtual client whose
clipped update is C u_j, summed into the audited client's upload after that client's clipping and before the noise
(as a secure aggregate of the real client and the canary clients would be). Toggling one canary moves the release's
mean by C, with the release's noise: each canary is one unit of the client-level relation, so a valid audit never
certifies more than the accountant's epsilon. The canaries perturb the audited client's training: audit runs are
for the audit.

Randomness: ``noise_generator`` seeded from (run, sender, round, "client_dp:<kind>", count), as the artifact
mechanism, so both engines give the same ledger and the noise can be regenerated by a test or an auditor who
knows the seed.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from .. import seeding
from ..bus import Mod
from ..errors import UserError
from ..params import asked, typed
from .accounting import epsilon, new_accountant
from .artifacts import noise_generator

UPDATE_KINDS = ["weights", "delta", "head", "generator"]
MODES = ("local", "central")
ADJACENCY = "one client (zero-out: its update replaced by zero)"
CANARY_SALT = 0xC11E


@dataclass
class Adaptive:
    target_quantile: float = 0.5    # gamma: the share of clients whose update norm should fall below C
    lr: float = 0.2                 # eta_C: C <- C exp(-eta_C (b - gamma)) each round (the paper's geometric update)
    bit_noise: float = 0.0          # sigma_b: std of the noise on the clipped-count estimate; 0 = K / 20 (the paper)


@dataclass
class ClientDP:
    clip: float = 1.0               # C (with adaptive: the initial C_0)
    noise_multiplier: float = 1.0
    target_epsilon: float = 0.0
    mode: str = "local"
    kinds: list = field(default_factory=lambda: list(UPDATE_KINDS))
    adaptive: dict = field(default_factory=dict)    # {} = fixed C; a table (Adaptive's keys) = adaptive clipping
    clients: int = 0                # K, clients per round (set at plan time)
    stat_noise: float = 0.0         # sigma_s: noise multiplier of update statistics (arrays stat/<name>); 0 = none
    sample_rate: float = 1.0        # q of the accountant: 1, the sample is known to the server (see Accounting)
    share: float = math.inf         # rho: the server's new model weighs each upload by <= rho / K (set at plan time)
    rounds: int = 0                 # for target_epsilon (set at plan time)


def check(c: ClientDP, where: str) -> ClientDP:
    if c.mode not in MODES:
        raise UserError(f"{where}.mode = {c.mode!r}: use \"local\" (untrusted server) or \"central\" (trusted aggregator)")
    if not c.clip > 0 or c.noise_multiplier < 0 or c.target_epsilon < 0 or c.stat_noise < 0:
        raise UserError(f"{where}: need clip > 0 and noise_multiplier, target_epsilon, stat_noise >= 0, got clip = "
                        f"{c.clip}, noise_multiplier = {c.noise_multiplier}, target_epsilon = {c.target_epsilon}, "
                        f"stat_noise = {c.stat_noise}")
    if not isinstance(c.kinds, list) or not c.kinds:
        raise UserError(f"{where}.kinds must be a non-empty list of artifact kinds, e.g. [\"weights\"]")
    if c.adaptive:
        a = c.adaptive = typed(Adaptive, c.adaptive, f"{where}.adaptive")
        if not 0 < a.target_quantile < 1 or a.lr < 0 or a.bit_noise < 0:
            raise UserError(f"{where}.adaptive: need 0 < target_quantile < 1, lr >= 0 and bit_noise >= 0, got "
                            f"{a.target_quantile}, {a.lr}, {a.bit_noise}")
    return c


def split_noise(z: float, *others: float) -> float:
    """sigma_Delta, the update's noise multiplier when Gaussian releases of multipliers ``others`` (noise over
    sensitivity) go with it: together one Gaussian mechanism of multiplier z = (sigma_Delta^-2 + sum o^-2)^-1/2
    (Andrew et al. 2021, Thm. 1, for the clipped count: o = 2 sigma_b, its terms b - 1/2 having sensitivity 1/2;
    update statistics: o = stat_noise); inf when z = 0 is asked of noisy companions or nothing is left."""
    if z == 0:
        return 0.0
    rest = z ** -2 - sum(o ** -2 for o in others)
    return math.inf if rest <= 0 else rest ** -0.5


@lru_cache(maxsize=256)
def calibrate(target: float, delta: float, q: float, steps: int, accountant: str) -> float:
    """sigma reaching ``target`` epsilon after ``steps`` releases at rate q (Opacus get_noise_multiplier)."""
    from opacus.accountants.utils import get_noise_multiplier
    with warnings.catch_warnings():     # the search probes sigmas whose RDP/PRV evaluation warns
        warnings.simplefilter("ignore")
        return float(get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=q, steps=steps,
                                          accountant=accountant, epsilon_tolerance=0.01))


def plan_check(c: ClientDP, method, params, n_clients: int, delta: float, accountant: str, where: str,
               engine: str = "local") -> None:
    """Plan-time settings: K, q, the calibrated sigma, the central mode's uniform-mean requirement and adaptive
    clipping's noise split."""
    c.sample_rate = 1.0
    c.clients = asked(n_clients, float(params.participation))
    c.rounds = params.rounds
    c.share = float(method.aggregate_share(params))
    if c.mode == "central" and math.isinf(c.share):
        raise UserError(f"{where}: mode = \"central\" needs a server whose new model is a uniform mean (or a mean with "
                        f"bounded, privatized weights) of the updates; method {method.name!r} with these settings has "
                        f"none (its aggregate_share): choose the method's bounded aggregation where it has one (e.g. "
                        f"weighting = \"uniform\" or fusion = \"dp\"), or use mode = \"local\"")
    if method.update_stats(params) and not c.stat_noise > 0:
        raise UserError(f"{where}: method {method.name!r} sends statistics of its update (stat/...) that need noise of "
                        f"their own: set {where}.stat_noise, e.g. 5.0")
    if c.target_epsilon > 0:
        # rounds + 1 releases: covers an update in round 0; privacy.csv gives the realized epsilon
        c.noise_multiplier = calibrate(c.target_epsilon, delta, c.sample_rate, params.rounds + 1, accountant)
    a = c.adaptive
    if a:
        if engine != "local":
            raise UserError(f"{where}.adaptive: adaptive clipping needs every client's noised count of the round in "
                            f"one place, which engine = {engine!r} does not give the filter: use engine = \"local\"")
        if not a.bit_noise:
            a.bit_noise = n_clients / 20
    if c.noise_multiplier > 0 and math.isinf(split_noise(c.noise_multiplier, 2 * a.bit_noise if a else math.inf,
                                                         c.stat_noise or math.inf)):
        raise UserError(f"{where}: adaptive.bit_noise and stat_noise leave no budget for the update at noise multiplier "
                        f"{c.noise_multiplier:.3g} (need (2 bit_noise)^-2 + stat_noise^-2 < its ^-2): raise them")


def noise(run: str, sender: str, rnd: int, kind: str, count: int, n: int, device=None) -> torch.Tensor:
    """The standard normal vector (float64, length n) that release ``count`` of (run, sender, round, kind) uses."""
    g = noise_generator(run, sender, rnd, f"client_dp:{kind}", count)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    return z if device is None else z.to(device)


@lru_cache(maxsize=8)
def update_canaries(m: int, n: int, seed: int) -> torch.Tensor:
    """(m, n) public canary directions (unit rows, float64) for an update of n coordinates."""
    g = torch.Generator().manual_seed(int(seeding.seq(seed, n, CANARY_SALT).generate_state(1)[0]))
    u = torch.randn(m, n, generator=g, dtype=torch.float64)
    return u / u.norm(dim=1, keepdim=True)


def canary_coins(run: str, client: str, m: int, seed: int) -> np.ndarray:
    """Which of the m update canaries join this client's releases (each with probability 1/2; never reported to
    attacks, only to the scorer's truth record)."""
    return seeding.rng(run, client, seed, CANARY_SALT, 1).random(m) < 0.5


def _deltas(kind: str, arrays: dict, stats: dict, sender: str, received: dict, out: dict) -> tuple[dict, dict]:
    """(deltas, references) of an update's float arrays (float64): each against what the sender last received of it
    (``_reference``; zero if never); a non-float array is replaced in ``out`` by what it received."""
    deltas, refs = {}, {}
    for name, v in arrays.items():
        if name in stats:
            continue
        v = torch.as_tensor(v)
        ref = _reference(name, sender, received)
        if not v.is_floating_point():
            if ref is None:
                raise UserError(f"privacy.client: {kind} array {name!r} is not float and was never received, so "
                                "it cannot be privatized: drop the kind from privacy.client.kinds")
            out[name] = ref.to(v.device, v.dtype).clone()
            continue
        ref = torch.zeros_like(v, dtype=torch.float64) if ref is None else ref.to(v.device, torch.float64)
        refs[name], deltas[name] = ref, v.double() - ref
    return deltas, refs


def _reference(name: str, sender: str, received: dict):
    return received.get(name, received.get(f"{sender}/{name}"))


class ClientDPFilter(Mod):
    """The bus mod on the update kinds: ``request`` keeps what each party last received (by array name),
    ``__call__`` privatizes each client upload as an update from it."""

    def __init__(self, c: ClientDP, delta: float, accountant: str, audit=None):
        self.c, self.delta, self.accountant = c, delta, accountant
        self.audit = audit if audit is not None and audit.update_canaries else None
        self.releases: dict = {}   # (run, sender) -> {round: releases}
        self.sent: dict = {}       # (run, sender, round, kind) -> releases so far
        self.bits: dict = {}       # adaptive: (run, round) -> the noised clipped-count terms released that round
        self.clips: dict = {}      # adaptive: run -> (round, C of that round)
        self.received: dict = {}   # party -> arrays it last received, by name (copies)

    def request(self, party, payload):
        self.received.setdefault(party, {}).update({k: v.clone() for k, v in payload.arrays.items()})

    def clip(self, run: str, rnd: int) -> float:
        """C of this round: fixed, or (adaptive) C_t = C_s exp(-eta (b_s - gamma)) from the last round s < t with
        releases, b_s = the noised share of that round's updates whose norm was at most C_s (Andrew et al. 2021).
        The share is over every release of round s (each release's noised term in its envelope's event)."""
        a = self.c.adaptive
        if not a:
            return self.c.clip
        s, cs = self.clips.get(run, (None, self.c.clip))
        if s is not None and s < rnd:
            bits = self.bits.pop((run, s), [])
            b = sum(bits) / max(1, len(bits)) + 0.5      # the released terms are b_i - 1/2 (+ noise)
            cs = cs * math.exp(-a.lr * (b - a.target_quantile))
        self.clips[run] = (rnd, cs)
        return cs

    def scales(self) -> dict:
        """{adversary: the factor on the noise multiplier of what it reads} (see Epsilon per adversary)."""
        k, rho = max(1, self.c.clients), self.c.share
        if self.c.mode == "central":
            return {"server": rho / k ** 0.5, "client": 1.0, "eavesdropper": rho / k ** 0.5}
        return {"server": 1.0, "client": max(1.0, k ** 0.5 / rho), "eavesdropper": 1.0}

    def multiplier(self, scale: float) -> float:
        """One release's noise multiplier for an adversary whose view scales the update's (and the clipped count's)
        noise by ``scale``: the update statistics' noise sigma_s is the same for everyone who reads them (each
        client's, or what the server computed from them); z = the configured noise_multiplier at scale 1."""
        z, s = self.c.noise_multiplier, self.c.stat_noise
        if not s or z == 0:
            return z * scale
        return ((z ** -2 - s ** -2) / scale ** 2 + s ** -2) ** -0.5

    def epsilon(self, run: str, sender: str, scale: float = 1.0) -> float:
        acc = new_accountant(self.accountant)
        acc.history = self.history(run, sender, scale)
        return epsilon(acc, self.delta)

    def history(self, run: str, sender: str, scale: float = 1.0) -> list[tuple]:
        """(sigma, q, steps) runs: one step per round with releases, q = 1 (see Accounting)."""
        rel = self.releases[(run, sender)]
        hist = [(self.multiplier(scale) / math.sqrt(rel[r]), 1.0, 1) for r in sorted(rel)]
        out = []
        for h in hist:     # merge equal steps: (sigma, q, n)
            if out and out[-1][:2] == h[:2]:
                out[-1] = (h[0], h[1], out[-1][2] + 1)
            else:
                out.append(h)
        return out

    def noised_stats(self, stats: dict, clip: float, kind: str, where: dict) -> dict:
        """Update statistics (arrays ``stat/<name>``, e.g. per-tensor norms of the update): clipped jointly to L2 norm
        ``clip`` (one client moves them by at most clip under zero-out) plus N(0, (stat_noise clip)^2) each, the
        same for every adversary (each client's are read one by one)."""
        if not self.c.stat_noise > 0:
            raise UserError(f"privacy.client: the {kind!r} upload carries update statistics {sorted(stats)} that need "
                            "noise of their own: set privacy.client.stat_noise, e.g. 5.0")
        vs = {k: torch.as_tensor(v).double() for k, v in stats.items()}
        norm = torch.sqrt(sum(v.pow(2).sum() for v in vs.values()))
        f = (clip / (norm + 1e-12)).clamp(max=1.0)
        g = noise_generator(where["run"], where["sender"], where["round"], f"client_dp_stat:{kind}",
                            self.sent.get((where["run"], where["sender"], where["round"], kind), 0))
        return {k: (v * f + torch.randn(v.shape, generator=g, dtype=torch.float64) * self.c.stat_noise * clip
                    ).to(torch.as_tensor(stats[k]).dtype) for k, v in vs.items()}

    def __call__(self, kind, arrays, scalars, where):
        sender, run, rnd = where["sender"], where["run"], where["round"]
        if sender == "server":
            return arrays, scalars, None
        if scalars:
            raise UserError(f"privacy.client: the {kind!r} update carries scalars {sorted(scalars)}, which client-level "
                            "DP cannot bound: drop the kind from privacy.client.kinds or the scalars from the method")
        c, received = self.c, self.received.get(sender, {})
        clip, a = self.clip(run, rnd), c.adaptive
        central = math.sqrt(c.clients) / c.share if c.mode == "central" and c.clients else 1.0
        sigma = split_noise(c.noise_multiplier, 2 * a.bit_noise if a else math.inf, c.stat_noise or math.inf)
        stats = {k: v for k, v in arrays.items() if k.startswith("stat/")}
        out = dict(arrays)
        deltas, refs = _deltas(kind, arrays, stats, sender, received, out)
        audited, bit = 0, None
        if deltas:
            norm = torch.sqrt(sum(d.pow(2).sum() for d in deltas.values()))
            f = (clip / (norm + 1e-12)).clamp(max=1.0)
            std = sigma * clip / central
            n = self.sent.get((run, sender, rnd, kind), 0)
            self.sent[(run, sender, rnd, kind)] = n + 1
            dev = next(iter(deltas.values())).device
            size = sum(d.numel() for d in deltas.values())
            z = noise(run, sender, rnd, kind, n, size, dev) * std
            aud = self.audit
            if aud is not None and (not aud.clients or sender in aud.clients):
                audited = aud.update_canaries
                coins = torch.as_tensor(canary_coins(run, sender, aud.update_canaries, aud.seed), dtype=torch.float64)
                z = z + ((coins * clip) @ update_canaries(aud.update_canaries, size, aud.seed)).to(dev)
            if a:     # the clipped-count term b - 1/2 with noise sigma_b (sigma_b / sqrt(K) each in central mode)
                g = noise_generator(run, sender, rnd, f"client_dp_bit:{kind}", n)
                e = float(torch.randn((), generator=g, dtype=torch.float64))
                bit = float(norm <= clip) - 0.5 + e * a.bit_noise / central
                self.bits.setdefault((run, rnd), []).append(bit)
            i = 0
            for name, d in deltas.items():
                k = d.numel()
                out[name] = (refs[name] + d * f + z[i:i + k].view_as(d)).to(arrays[name].dtype)
                i += k
        if stats:
            out.update(self.noised_stats(stats, clip, kind, where))
        rel = self.releases.setdefault((run, sender), {})
        rel[rnd] = rel.get(rnd, 0) + 1
        hist, scales = self.history(run, sender), self.scales()
        eps = {s: self.epsilon(run, sender, s) for s in {1.0, *scales.values()}}
        event = dict(mechanism="client_dp", mode=c.mode, update_kind=kind, accountant=self.accountant,
                     covers=list(c.kinds), headline="client" if c.mode == "central" else "server",
                     adversary_scale=scales, epsilon_by={adv: eps[s] for adv, s in scales.items()},
                     noise_multiplier=c.noise_multiplier, clip=clip, sample_rate=c.sample_rate,
                     clients=c.clients, steps=sum(h[2] for h in hist), delta=self.delta,
                     epsilon=eps[1.0], history=[list(h) for h in hist],
                     example_history=[[h[0] / 2, h[1], h[2]] for h in hist], adjacency=ADJACENCY,
                     update_canaries=audited)
        if a or c.stat_noise:
            event.update(update_noise_multiplier=sigma, stat_noise=c.stat_noise)
        if a:
            event.update(bit_noise=a.bit_noise, clipped_bit=bit if deltas else None)
        return out, scalars, event
