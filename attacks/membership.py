"""Membership inference on transmitted models (docs/attacks.md §3, table rows M1-M4).

Question: was candidate x in the victim client's training data? ``aux.candidates[victim]`` is a shuffled pool of
the victim's training images and images of the same domain it never trained on, with class labels; membership is
withheld and scored by the shared scorer (AUC, TPR at 1 %, 0.1 % and 0 % FPR; per victim and pooled over victims).
Raw scores are saved by the harness to ``mia/<attack>/<run>.npz`` for log-log ROC plots and pooling over runs.

Target model (``target_model``): ``"local"`` = the victim's last uploaded weights (the server adversary's view),
``"global"`` = the newest global weights on the wire (the last broadcast, i.e. the global model after T-1
aggregations: the final aggregate is never transmitted; for the last round the two differ by one aggregation).
With ``"global"`` the adversary is a curious client (the first, or ``as_client``; it is not its own victim): every
client receives the broadcast, so its cells carry the epsilon of the aggregate, not the per-upload one.
Every attack here reads ``weights`` artifacts, so it applies to every method that sends a plain model state.

- ``mia_loss`` (Yeom et al. 2018): score = -CE(f(x), y). With ``refs > 0`` also the calibrated loss (variant
  ``calibrated``): -(CE under the target - mean CE under reference models that did not train on x).
- ``mia_lira`` (Carlini et al., S&P 2022): statistic phi = z_y - logsumexp_{j != y} z_j (logit-scaled confidence).
  Offline: score = (phi - mu_out) / sigma_out, the paper's one-sided test against the OUT Gaussian (the demo code
  uses the two-sided -logpdf instead). Online (``online = true``, the attacker trains half of its reference
  federations with each candidate): log N(phi; mu_in, sigma_in) - log N(phi; mu_out, sigma_out). With
  ``fixed_variance`` (default, for few references) sigma is one global within-example standard deviation.
  No query augmentations (digits are not flip-invariant).
- ``mia_rmia`` (Zarifzadeh et al., ICML 2024): Pr(x|theta) = softmax(z / T)_y; offline
  Pr(x) = ((1 + a) Pr_OUT(x) + (1 - a)) / 2 with ``a`` tuned on a grid 0..1 by attacking reference 0 with the
  others (Privacy Meter's ``tune_offline_a``), online Pr(x) = mean over all references; score = fraction of
  population points z with LR(x, z) = [Pr(x|theta)/Pr(x)] / [Pr(z|theta)/Pr(z)] > gamma. Defaults T = 2, gamma = 2
  (the research code's); the signal is the softmax probability, not the research code's "taylor" soft margin.
- ``mia_trajectory`` (Chang, Edwards, Paul, Shokri, USENIX Security 2024): the loss of each candidate under the
  victim's successive uploaded models (or successive global models) from ``start_round`` on; variants ``slope``
  (minus the least-squares slope of the loss over rounds, the paper's "our_loss"), ``last`` and ``mean``
  (the paper's "01-loss" and "fed-loss"). Needs no reference models.

Reference federations (``references``; trained once per run and setting, kept in the run folder's attack cache that
every attack here shares, so LiRA and RMIA with equal reference settings use the same models): the attacker re-runs
the observed protocol (``view.method`` with ``view.settings``, same
model) through the federation engine (``fdg_audit.api.attack.federate``, in-memory ledger) on its own data: one
pseudo-client per observed client, named like it, each holding a random ``ref_fraction`` of the attacker's pool
(``shadow_data = "public"``: the held-out domain's images split among the pseudo-clients; ``"domain_samples"``:
each pseudo-client gets public samples of its twin's domain), plus, online, a random half of the twin victim's
candidates (each candidate IN for exactly half of the references). The reference's target model is the twin
client's last upload (``local``) or the reference's last global broadcast (``global``). ``population`` attacker
images are never trained on: they are the reference runs' validation split and RMIA's population z. The attacker's
data are far fewer images than a victim's and (with ``public``) of another domain, so reference models are
mismatched by construction; that is the threat model, not a bug.

Controls (``control()``, ``control_world``): a small FedAvg federation on embedded digits whose clients memorise
30 mislabelled canaries each (positive: the main variant's AUC over both victims >= 0.8), and the same scores
restricted to the non-members, half of them labelled "member" at random (negative: AUC <= 0.65, i.e. near 0.5).
Canaries, not natural images, because digits generalise so well that a natural overfit model's LOSS AUC sits
near 0.8 and moves with the seed. The clients train 8 local epochs a round, 30 for LiRA and RMIA: their reference
models are trained on another domain (the control's attacker holds rot60, the victims rot0 and rot30), whose
per-candidate OUT statistics add noise that 8 epochs of memorisation did not clear by a margin (offline LiRA AUC
0.74-0.80 over seeds 0 and 1 where LOSS read 0.93-0.98). ``control_world(device, seed, local_epochs)``; the
controls use the attack's ``seed``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit.api import Split, UserError, seeding
from fdg_audit.api import metrics as M
from fdg_audit.api.attack import Attack, AttackParams, Aux, Control, Scores, Skipped, federate, sample_victims

TARGETS = ("local", "global")


@dataclass
class TargetParams(AttackParams):
    target_model: str = "local"   # local: victim's last uploaded weights | global: newest global weights on the wire
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.target_model not in TARGETS:
            raise UserError(f"target_model = {self.target_model!r}: use \"local\" or \"global\"")


@dataclass
class RefParams(TargetParams):
    refs: int = 2                 # reference federations (each a full run of the observed protocol)
    online: bool = False          # also train references with half of each victim's candidates
    ref_rounds: int = 0           # rounds of a reference run (0 = the observed run's)
    ref_fraction: float = 0.5     # share of the attacker's pool each reference trains on
    shadow_data: str = "public"   # public (held-out domain) | domain_samples (public samples of each client domain)
    population: int = 100         # attacker images never trained on (reference validation, RMIA population)

    def __post_init__(self):
        super().__post_init__()
        if self.shadow_data not in ("public", "domain_samples"):
            raise UserError(f"shadow_data = {self.shadow_data!r}: use \"public\" or \"domain_samples\"")
        if self.online and self.refs < 2:
            raise UserError(f"online = true needs refs >= 2 (IN and OUT references), got refs = {self.refs}")
        if not 0 < self.ref_fraction <= 1:
            raise UserError(f"ref_fraction = {self.ref_fraction}: use a number in (0, 1], e.g. 0.5")


# ------------------------------------------------------------------------------------------ signals

def target_states(view, victim: str, which: str, every_round: bool = False) -> list[tuple[int, dict]]:
    """(round, weights) of the victim's uploads (``local``) or of the global broadcasts (``global``), by round."""
    msgs = view.messages(kind="weights", sender=victim) if which == "local" else \
        view.messages(kind="weights", sender="server")
    by_round = {}
    for m in msgs:
        by_round.setdefault(m.round, m)
    rounds = sorted(by_round)[(0 if every_round else -1):] if by_round else []
    return [(r, by_round[r].payload.arrays) for r in rounds]


@torch.no_grad()
def logits(model, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    model.eval()
    dev = next(model.parameters()).device
    return torch.cat([model(x[i:i + batch].to(dev)).float() for i in range(0, len(x), batch)]).cpu()


def ce(z: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    return F.cross_entropy(z, y.cpu(), reduction="none").numpy().astype(np.float64)


def logit_conf(z: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """LiRA's phi = log(p_y / (1 - p_y)) computed stably as z_y - logsumexp_{j != y} z_j."""
    y = y.cpu()
    zy = z.gather(1, y[:, None])[:, 0]
    rest = z.scatter(1, y[:, None], float("-inf")).logsumexp(1)
    return (zy - rest).numpy().astype(np.float64)


def prob(z: torch.Tensor, y: torch.Tensor, temperature: float) -> np.ndarray:
    return (z / temperature).softmax(1).gather(1, y.cpu()[:, None])[:, 0].numpy().astype(np.float64)


def trend_slope(losses: np.ndarray) -> np.ndarray:
    """Least-squares slope over rounds of a (T, n) loss matrix, per column (0 when T < 2)."""
    t = np.arange(len(losses), dtype=np.float64)
    t -= t.mean()
    return (t[:, None] * (losses - losses.mean(0))).sum(0) / max((t ** 2).sum(), 1e-12)


def _masked_mean(v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean over axis 0 of v where mask, nan where a column has no entry."""
    n = mask.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (v * mask).sum(0) / np.maximum(n, 1), np.nan)


def _fill(mu: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Columns without a reference of this kind: the other kind's mean plus the average gap between the two."""
    ok = ~np.isnan(mu) & ~np.isnan(other)
    gap = (mu[ok] - other[ok]).mean() if ok.any() else 0.0
    return np.where(np.isnan(mu), other + gap, mu)


def _gauss(v: np.ndarray, mask: np.ndarray, fixed: bool) -> tuple[np.ndarray, np.ndarray]:
    mu = _masked_mean(v, mask)
    res = np.where(mask, v - np.nan_to_num(mu), 0.0)
    if fixed:
        sd = np.full(v.shape[1], math.sqrt((res ** 2).sum() / max(mask.sum() - mask.any(0).sum(), 1)))
    else:
        sd = np.sqrt((res ** 2).sum(0) / np.maximum(mask.sum(0) - 1, 1))
    return mu, np.maximum(sd, 1e-6)


def lira(phi: np.ndarray, ref_phi: np.ndarray, ref_in: np.ndarray, online: bool, fixed_variance: bool = True
         ) -> np.ndarray:
    """LiRA scores from the target's phi (n,), the references' phi (N, n) and IN masks (N, n)."""
    mu_out, sd_out = _gauss(ref_phi, ~ref_in, fixed_variance)
    if not online:
        return (phi - _fill(mu_out, np.zeros_like(mu_out))) / sd_out
    mu_in, sd_in = _gauss(ref_phi, ref_in, fixed_variance)
    mu_in, mu_out = _fill(mu_in, mu_out), _fill(mu_out, mu_in)
    logpdf = lambda v, m, s: -0.5 * ((v - m) / s) ** 2 - np.log(s)  # noqa: E731
    return logpdf(phi, mu_in, sd_in) - logpdf(phi, mu_out, sd_out)


def rmia(px: np.ndarray, ref_px: np.ndarray, ref_in_x: np.ndarray, pz: np.ndarray, ref_pz: np.ndarray,
         a: float, gamma: float, online: bool) -> np.ndarray:
    """RMIA scores. px (n,) / pz (m,): target probabilities of candidates / population; ref_* (N, ·) the
    references'; ref_in_x (N, n) IN masks; population points are OUT for every reference."""
    def marginal(p_ref, out_mask):
        if online:
            return p_ref.mean(0)
        p_out = _masked_mean(p_ref, out_mask)
        p_out = np.where(np.isnan(p_out), p_ref.mean(0), p_out)
        return 0.5 * ((1 + a) * p_out + (1 - a))
    rx = px / np.maximum(marginal(ref_px, ~ref_in_x), 1e-30)
    rz = pz / np.maximum(marginal(ref_pz, np.ones_like(ref_pz, dtype=bool)), 1e-30)
    return (rx[:, None] / rz[None, :] > gamma).mean(1)


# ------------------------------------------------------------------------------------------ references

def _sub(s: Split, i) -> Split:
    i = np.asarray(i, dtype=np.int64)
    return Split(s.x[torch.as_tensor(i)], s.y[torch.as_tensor(i)], np.asarray(s.idx)[i])


def _cat(splits: list[Split]) -> Split:
    return Split(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]),
                 np.concatenate([s.idx for s in splits]))


def _relabel(s: Split, start: int) -> Split:
    return Split(s.x, s.y, np.arange(start, start + len(s), dtype=np.int64))


@dataclass
class References:
    """Reference models of one run: ``states[r][victim]`` (weights), ``cand_in[r][victim]`` (IN masks over the
    victim's candidates), ``pool``/``pool_in[r][victim]`` (the attacker's trainable images and which of them the
    reference's target model trained on) and ``population`` (never trained on)."""
    states: list
    cand_in: list
    pool: Split
    pool_in: list
    population: Split


def references(view, aux: Aux, p: RefParams, victims: list[str], online: bool) -> References:
    """Train ``p.refs`` reference federations of the observed protocol on the attacker's data (module docstring)."""
    if aux.public is None or len(aux.public) < 4:
        raise UserError("reference models need aux.public (the attacker's labelled images of the held-out domain)")
    rng = seeding.rng(p.seed, 7)
    # private ids: the attacker tracks which of its own images each reference trained on
    perm = rng.permutation(len(aux.public))
    n_pop = min(p.population, len(aux.public) // 3)
    population = _relabel(_sub(aux.public, perm[:n_pop]), 0)
    if p.shadow_data == "domain_samples":
        parts = {c: aux.domain_samples.get(c) for c in view.clients}
        missing = [c for c, s in parts.items() if s is None]
        if missing:
            raise UserError(f"shadow_data = \"domain_samples\" but aux has none for {missing}: use \"public\"")
        pool = _cat(list(parts.values()))
        owner = np.concatenate([np.full(len(s), i) for i, s in enumerate(parts.values())])
    else:
        pool = _sub(aux.public, perm[n_pop:])
        owner = None
    pool = _relabel(pool, n_pop)
    starts = n_pop + len(pool) + np.cumsum([0] + [len(aux.candidates[v]) for v in victims])
    cands = {v: _relabel(aux.candidates[v], int(starts[i])) for i, v in enumerate(victims)}
    n_ref = max(p.refs, 1)
    ins = {v: (rng.random((n_ref, len(c))).argsort(0) < n_ref // 2) if online else np.zeros((n_ref, len(c)), bool)
           for v, c in cands.items()}
    k = len(view.clients)
    key = _refs_key(view, p, victims, online)
    got = view.cached(key)      # another attack's job of this run trained the same references (LiRA and RMIA)
    states, cand_in, pool_in = [], [], []
    for r in range(p.refs):
        if owner is None:
            chosen = rng.permutation(len(pool))[:max(k, int(p.ref_fraction * len(pool)))]
            split = np.array_split(chosen, k)
        else:
            split = [rng.permutation(np.flatnonzero(owner == i))[:max(1, int(p.ref_fraction * (owner == i).sum()))]
                     for i in range(k)]
        if min(len(s) for s in split) == 0:
            raise UserError(f"the attacker's pool ({len(pool)} images) is too small for {k} pseudo-clients: "
                            "lower population or raise ref_fraction")
        clients = {}
        for c, sel in zip(view.clients, split):
            train = _sub(pool, sel)
            if c in ins:
                train = _cat([train, _sub(cands[c], np.flatnonzero(ins[c][r]))])
            clients[c] = (train, population)
        if got is None:
            params = dataclasses.replace(view.settings, **({"rounds": p.ref_rounds} if p.ref_rounds else {}))
            ref = federate(view.method, params, view.model_cfg, clients, aux.num_classes or view.shape[2],
                           seed=1000 * p.seed + r, device=view.device, run_id=f"reference{r}")
            states.append({v: target_states(ref, v, p.target_model)[-1][1] for v in victims})
        else:
            states.append({v: {n.split(".", 1)[1]: torch.from_numpy(a) for n, a in got.items()
                               if n.startswith(f"r{r}v{i}.")} for i, v in enumerate(victims)})
        trained = {c: set(tr.idx.tolist()) for c, (tr, _) in clients.items()}
        everyone = set().union(*trained.values())
        seen = {v: trained[v] if p.target_model == "local" else everyone for v in victims}
        cand_in.append({v: np.isin(cands[v].idx, list(seen[v])) for v in victims})
        pool_in.append({v: np.isin(pool.idx, list(seen[v])) for v in victims})
    if got is None:
        view.keep(key, {f"r{r}v{i}.{n}": np.asarray(a) for r, st in enumerate(states)
                        for i, v in enumerate(victims) for n, a in st[v].items()})
    return References(states, cand_in, pool, pool_in, population)


def _refs_key(view, p: RefParams, victims: list[str], online: bool) -> str:
    """The attack-cache key of one run's reference federations: everything that decides them (the run, the
    reference settings, the victims), so attacks with the same settings (LiRA and RMIA) train them once."""
    what = (view.run_id, p.seed, p.refs, online, p.ref_rounds, p.ref_fraction, p.shadow_data, p.population,
            p.target_model, tuple(victims))
    return "refs-" + hashlib.blake2b(repr(what).encode(), digest_size=12).hexdigest()


# ------------------------------------------------------------------------------------------ attacks

class _Membership(Attack):
    consumes = ("weights",)
    adversary = "server"
    cache = "mia_references"      # one attack cache for every membership attack: equal references are trained once
    aux = ("candidates",)
    knows = ("architecture",)     # losses through the observed model
    Params = TargetParams
    main = ""                     # the variant the controls judge
    control_epochs = 8            # local epochs of the control world's clients (``control_world``)

    def __init__(self, params=None, device: str = "cpu"):
        super().__init__(params, device)
        if self.p.target_model == "global":   # the broadcast model: what every client receives
            self.adversary = "client"

    def victims(self, view, aux) -> list[str]:
        return sample_victims(view, [c for c in view.clients if c in aux.candidates and c != view.me],
                              self.p.max_victims)

    def cost(self) -> dict:   # the cost guard: per run, and a reference federation ~ a run's training (uncalibrated)
        return {"run": 0.5 + 20.0 * getattr(self.p, "refs", 0) * (2 if getattr(self.p, "online", False) else 1)}

    def run(self, view, aux):
        outs, ready = [], []
        for v in self.victims(view, aux):
            ts = target_states(view, v, self.p.target_model)
            if ts:
                ready.append((v, ts[-1]))
            else:
                outs.append(Skipped(v, "weights", -1, f"no {self.p.target_model} weights observed"))
        return outs + (self.attack(view, aux, ready) if ready else [])

    def attack(self, view, aux, targets: list) -> list:
        raise NotImplementedError

    def control(self) -> list[Control]:
        view, aux, members, fake = control_world(str(self.device), self.p.seed, self.control_epochs)
        res = [o for o in self.run(view, aux) if isinstance(o, Scores) and o.variant == self.main]
        scores = np.concatenate([o.scores for o in res])
        member = np.concatenate([members[o.victim] for o in res])
        out = np.concatenate([fake[o.victim] for o in res])[member == 0]
        return [Control("clients that memorised mislabelled canaries: canaries vs non-members", f"auc ({self.main})",
                        M.auc(scores, member), 0.8),
                Control("same model, non-members only (labelled member at random)", f"auc ({self.main})",
                        M.auc(scores[member == 0], out), 0.65, positive=False)]


REFS = "reference federations of the observed protocol trained on the attacker's public images (another domain or " \
    "far fewer images than the victim's: mismatched by construction)"


class LossAttack(_Membership):
    """Loss threshold (M1) and, with references, the calibrated loss."""
    name = "mia_loss"
    aux = ("candidates", "public", "domain_samples")
    main = "loss"
    outputs = {"loss": "the candidate's loss under the target model; no reference models",
               "calibrated": f"the loss minus its mean under {REFS} that did not train on the candidate"}

    @dataclass
    class Params(RefParams):
        refs: int = 0             # > 0 adds the calibrated-loss variant (offline references)

    def attack(self, view, aux, targets):
        refs = references(view, aux, self.p, [v for v, _ in targets], False) if self.p.refs else None
        outs = []
        for v, (rnd, state) in targets:
            c = aux.candidates[v]
            loss = ce(logits(view.model(state), c.x), c.y)
            outs.append(Scores(v, "weights", rnd, -loss, "loss"))
            if refs:
                ref = np.stack([ce(logits(view.model(s[v]), c.x), c.y) for s in refs.states])
                out = ~np.stack([m[v] for m in refs.cand_in])
                outs.append(Scores(v, "weights", rnd, -(loss - _fill(_masked_mean(ref, out), ref.mean(0))),
                                   "calibrated"))
        return outs


class _Referenced(_Membership):
    """An attack with reference federations, offline or ``online`` (its main output)."""
    aux = ("candidates", "public", "domain_samples")
    knows = ("architecture", "local_hyperparams")   # reference federations replay the observed protocol
    control_epochs = 30           # mismatched references add noise: the control's canaries are memorised harder

    @property
    def main(self):
        return "online" if self.p.online else "offline"


class LiRA(_Referenced):
    """Likelihood-ratio attack with reference federations (M2)."""
    name = "mia_lira"
    outputs = {"offline": f"a Gaussian fit of the candidate's logit-scaled confidence under {REFS}, none trained on it",
               "online": f"Gaussians fitted IN and OUT under {REFS}, half of them trained on each candidate"}

    @dataclass
    class Params(RefParams):
        refs: int = 4
        fixed_variance: bool = True

    def attack(self, view, aux, targets):
        refs, outs = references(view, aux, self.p, [v for v, _ in targets], self.p.online), []
        for v, (rnd, state) in targets:
            c = aux.candidates[v]
            phi = logit_conf(logits(view.model(state), c.x), c.y)
            ref_phi = np.stack([logit_conf(logits(view.model(s[v]), c.x), c.y) for s in refs.states])
            ref_in = np.stack([m[v] for m in refs.cand_in])
            for online in ((False, True) if self.p.online else (False,)):
                outs.append(Scores(v, "weights", rnd, lira(phi, ref_phi, ref_in, online, self.p.fixed_variance),
                                   "online" if online else "offline"))
        return outs


class RMIA(_Referenced):
    """Relative membership inference with a few reference federations (M3)."""
    name = "mia_rmia"
    outputs = {"offline": f"likelihood ratios against population images never trained on, Pr(x) from {REFS} that "
                          "did not train on the candidate (coefficient a tuned on them)",
               "online": f"likelihood ratios against population images never trained on, Pr(x) from {REFS}, half of "
                         "them trained on each candidate"}

    @dataclass
    class Params(RefParams):
        a: float = -1.0           # offline Pr(x) coefficient; < 0 = tuned on the references (needs refs >= 2)
        gamma: float = 2.0
        temperature: float = 2.0

    def tune_a(self, view, refs: References, v: str) -> float:
        """Privacy Meter's tune_offline_a, attacking every reference in turn with the others (leave one out) and
        keeping the a of the best mean AUC over them. With one reference attacked, as Privacy Meter does, the a chosen
        swung between 0 and 1 with the float order of training (the positive control at seed 4: AUC 0.85 on one
        torch thread, 0.96 on two)."""
        if self.p.a >= 0 or len(refs.states) < 2:
            return self.p.a if self.p.a >= 0 else 0.3
        t, pool, pop = self.p.temperature, refs.pool, refs.population
        models = [view.model(s[v]) for s in refs.states]
        px = np.stack([prob(logits(m, pool.x), pool.y, t) for m in models])
        pz = np.stack([prob(logits(m, pop.x), pop.y, t) for m in models])
        ins = np.stack([m[v] for m in refs.pool_in])
        grid, aucs = np.round(np.linspace(0, 1, 11), 2), []
        for i in range(len(models)):
            rest = np.arange(len(models)) != i
            keep = (~ins[rest]).any(0)        # pool points some other reference did not train on
            member = ins[i][keep]
            if member.all() or not member.any():
                continue
            aucs.append([M.auc(rmia(px[i][keep], px[rest][:, keep], ins[rest][:, keep], pz[i], pz[rest], a,
                                    self.p.gamma, False), member) for a in grid])
        return float(grid[int(np.argmax(np.mean(aucs, 0)))]) if aucs else 0.3

    def attack(self, view, aux, targets):
        refs = references(view, aux, self.p, [v for v, _ in targets], self.p.online)
        t, pop, outs = self.p.temperature, refs.population, []
        for v, (rnd, state) in targets:
            c, model = aux.candidates[v], view.model(state)
            ref_models = [view.model(s[v]) for s in refs.states]
            px, pz = prob(logits(model, c.x), c.y, t), prob(logits(model, pop.x), pop.y, t)
            ref_px = np.stack([prob(logits(m, c.x), c.y, t) for m in ref_models])
            ref_pz = np.stack([prob(logits(m, pop.x), pop.y, t) for m in ref_models])
            ref_in = np.stack([m[v] for m in refs.cand_in])
            a = self.tune_a(view, refs, v) if not self.p.online else 0.0
            outs.append(Scores(v, "weights", rnd, rmia(px, ref_px, ref_in, pz, ref_pz, a, self.p.gamma,
                                                         self.p.online), "online" if self.p.online else "offline"))
        return outs


class Trajectory(_Membership):
    """Loss trajectory over the victim's logged rounds (M4); no reference models."""
    name = "mia_trajectory"
    main = "slope"
    outputs = {"slope": "minus the slope of the candidate's loss over the target's logged rounds; no reference models",
               "last": "the candidate's loss under the last logged target model; no reference models",
               "mean": "the candidate's mean loss over the logged rounds; no reference models"}

    @dataclass
    class Params(TargetParams):
        start_round: int = 1      # first round of the trajectory

    def attack(self, view, aux, targets):
        outs = []
        for v, _ in targets:
            c = aux.candidates[v]
            traj = [(r, s) for r, s in target_states(view, v, self.p.target_model, every_round=True)
                    if r >= self.p.start_round]
            losses, rnd = np.stack([ce(logits(view.model(s), c.x), c.y) for _, s in traj]), traj[-1][0]
            outs += [Scores(v, "weights", rnd, -trend_slope(losses), "slope"),
                     Scores(v, "weights", rnd, -losses[-1], "last"),
                     Scores(v, "weights", rnd, -losses.mean(0), "mean")]
        return outs


# ------------------------------------------------------------------------------------------ controls

@lru_cache(maxsize=4)
def control_world(device: str = "cpu", seed: int = 0, local_epochs: int = 8):
    """A FedAvg federation (embedded digits, 2 clients, 6 rounds x ``local_epochs``) whose clients each train on 30
    clean images and 30 canaries (images with a random wrong label, the mislabelled canaries of Privacy Meter's
    audits: points a model can only fit by memorising them). Candidates per victim: its 30 canaries and 90 images
    of its domain it never saw, also with a random wrong label. Returns (view, aux, members, fake): ``fake`` is a
    random member/non-member labelling (half each) of the non-members, for the negative control."""
    from fdg_audit.api import DataConfig, ModelConfig, load_data, load_method
    data = load_data(DataConfig(dataset="digits", domains=["rot0", "rot30", "rot60"]))
    k, rng = data.num_classes, np.random.default_rng(seed)
    *sources, pub = data.domains
    clients, cands, members, fake, samples = {}, {}, {}, {}, {}
    for d in sources:
        s = _cat([d.train, d.val])
        o = rng.permutation(len(s))
        canary, clean, val, rest = o[:30], o[30:60], o[60:80], o[80:]
        c = _sub(s, np.r_[canary, rest[:90]])
        c.y = (c.y + torch.as_tensor(rng.integers(1, k, len(c)))) % k
        clients[d.name] = (_cat([_sub(c, np.arange(30)), _sub(s, clean)]), _sub(s, val))
        p = rng.permutation(120)
        cands[d.name], members[d.name] = _relabel(_sub(c, p), 0), (p < 30).astype(float)
        fake[d.name] = np.zeros(120)
        fake[d.name][p >= 30] = rng.permutation(np.r_[np.ones(45), np.zeros(45)])
        samples[d.name] = _relabel(_sub(s, rest[90:130]), 0)
    params = load_method("fedavg").Params(rounds=6, local_epochs=local_epochs, batch_size=16, lr=0.05, weight_decay=0.0)
    view = federate("fedavg", params, ModelConfig(), clients, k, seed=seed, device=device, run_id="control")
    aux = Aux(public=_cat([pub.train, pub.val]), domain_samples=samples, candidates=cands, num_classes=k,
              domains=[d.name for d in sources])
    return view, aux, members, fake


__all__ = ["LossAttack", "LiRA", "RMIA", "Trajectory", "lira", "rmia", "trend_slope", "references",
           "target_states", "control_world"]
