"""The generic attack: what any artifact reveals, learned with the method's own client code (no method-specific
knowledge). It applies to every kind a client uploads (``consumes = ("*",)``), so every channel of every method,
a user's new one included, gets a cell.

The attacker (the server: it receives every upload) runs the observed protocol (``view.method`` with
``view.params``, Kerckhoffs) offline on images it holds (``aux.domain_samples`` of each source domain and
``aux.public``), through ``federate`` (the mechanism of LiRA's reference federations), stopped after the round in which
the victim sent the kind (``until_round``). Each shadow client's upload of that kind, beside the images the client
held, is one (artifact, images) pair. From these pairs:

- **link** (``Scores``, variant ``"link"``): membership by linkability. For each candidate image of
  ``aux.candidates[victim]`` the attacker computes what the method sends for a client holding only that image, and
  scores how well it explains the observed artifact: for an array with one row per image (detected on the shadow
  pairs: its first dimension follows the client's image count, e.g. FedDG's bank), minus the distance to the nearest
  observed row; for any other array, minus the mean squared difference on the entries the single-image artifact
  fills (e.g. its class's row of a per-class aggregate). Scored like every membership cell (AUC, TPR at low FPR,
  blind baseline).
- **decoder** (``Reconstruction``, variant ``"decoder"``, prior "learned"): a small network trained on the pairs
  maps the artifact back to images: one image per row for per-image arrays (up to ``max_rows`` rows per victim),
  else one mean image per class the network finds present (class means: on an aggregate its cell reads its level
  against chance, honestly). Images are matched to the victim's training images by the one reconstruction scorer
  (re-identification among 100, PSNR, against the public mean and flat images); ``labels`` (the class read from the
  artifact) are scored as ``label_acc``.
- **attribute**: the class: ``labels`` above, and for an aggregate the label counts (``Estimate``, variant
  ``"decoder"``: counts, distribution, existence F1 against the uniform prior); the domain (``Predictions``,
  attribute "domain", one row per victim: a single-domain client's name already says it, so its scorecard cell is
  the increment over that guess).

Artifact features: every array of the payload (update statistics ``stat/*`` excluded) and every numeric scalar,
flattened, zero-padded to the longest shadow artifact, standardised on the shadow pairs and, above ``dim``
features, projected by a fixed seeded random matrix. Kinds in ``skip`` (model states, attacked by the weight attacks)
and ``n_samples`` (attacked by dataset_size) are left out unless named in ``kinds``; a kind only the server sends is not
a client's upload and is not read here.

Controls (the same code end to end, on 8x8 digits, 4 clients of 6 images): FedDG's amplitude bank, a channel known to
leak, must be linked (AUC >= 0.9); a method that sends its images as they are (``RawMethod``) must be decoded (a decoded
image's nearest candidate is a member in >= 90% of cases, chance 50%); a method that sends a data-independent random
vector (``NoiseMethod``) must be neither linked (|AUC - 0.5| <= 0.25) nor decoded (at most chance + 0.25).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fdg_audit.api import DataConfig, ModelConfig, Split, UserError, load_data, load_method, records, seeding
from fdg_audit.api.attack import (Attack, AttackParams, Control, Estimate, Predictions, Reconstruction, Scores,
                                  Skipped, federate, sample_victims)
from fdg_audit.api.method import MethodPlugin, Reply


@dataclass
class Params(AttackParams):
    kinds: list = field(default_factory=list)   # kinds to attack ([] = every kind a client uploaded, less skip)
    skip: list = field(default_factory=lambda: ["weights", "delta", "head", "n_samples", "metric", "public_aux"])
    pairs: int = 32               # shadow clients, i.e. (artifact, images) pairs, per kind and client size
    max_size: int = 32            # images per shadow client: the victim's n_samples when seen, capped here (else 8)
    group: int = 8                # shadow clients per shadow federation (>= 2)
    steps: int = 300              # decoder training steps
    max_rows: int = 8             # per-image artifacts: rows decoded per victim
    dim: int = 1024               # artifact features above this are randomly projected to it

    def __post_init__(self):
        if self.group < 2 or self.pairs < 2 or self.max_size < 1 or self.steps < 1 or self.dim < 8:
            raise UserError("generic_artifact: group and pairs >= 2, max_size and steps >= 1, dim >= 8 "
                            f"(got group={self.group}, pairs={self.pairs}, max_size={self.max_size}, "
                            f"steps={self.steps}, dim={self.dim})")


# ------------------------------------------------------------------------------------------- shadow pairs

def _sub(s: Split, rows) -> Split:
    rows = np.asarray(rows)
    return Split(s.x[torch.as_tensor(rows)], s.y[torch.as_tensor(rows)], np.asarray(s.idx)[rows])


def shadow_uploads(method: str, params, model_cfg, clients: list[Split], kind: str, until: int, k: int,
                   group: int, seed: int, device) -> list:
    """What the method's clients send of ``kind`` (their first such upload, by round ``until``) when they hold
    ``clients[i]``: one payload (or None) per client, from shadow federations of ``group`` clients."""
    params = dataclasses.replace(params, rounds=max(int(params.rounds), until, 1), participation=1.0)
    out = []
    for g in range(0, len(clients), group):
        part = clients[g:g + group]
        if len(part) < 2:   # a protocol may need two clients (FedDG's relay): pad with a copy, not returned
            part = part + part
        names = [f"shadow{g + i}" for i in range(len(part))]
        view = federate(method, params, model_cfg, {n: (s, s) for n, s in zip(names, part)}, k,
                        seed=seeding.seed_int(seed, "generic", g), device=device, run_id=f"generic{g}",
                        until_round=until)
        for n in names[:len(clients[g:g + group])]:
            ms = sorted(view.messages(kind=kind, sender=n), key=lambda m: m.seq)
            out.append(ms[0].payload if ms else None)
    return out


def arrays_of(payload) -> dict[str, np.ndarray]:
    """The payload's arrays and numeric scalars, as float arrays by name (scalars as "scalar:<name>")."""
    out = {n: a.detach().cpu().double().numpy() for n, a in payload.arrays.items()
           if not a.dtype.is_complex}
    for n, v in payload.scalars.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"scalar:{n}"] = np.array([float(v)])
    return out


def per_image(arts: list[dict], sizes: list[int]) -> list[str]:
    """Arrays with one row per image: present in every artifact, first dimension equal to the client's image
    count, and those counts not all equal (else a fixed-size array could pass)."""
    if len(set(sizes)) < 2 or not arts:
        return []
    names = set.intersection(*(set(a) for a in arts))
    return sorted(n for n in names if all(a[n].ndim >= 1 and a[n].shape[0] == s for a, s in zip(arts, sizes)))


def rows_of(art: dict, names: list[str]) -> np.ndarray:
    """(rows, features) of the per-image arrays, concatenated per row."""
    return np.concatenate([art[n].reshape(len(art[n]), -1) for n in names], 1)


def flat_of(art: dict, names: list[str], length: int | None = None) -> np.ndarray:
    """The other arrays flattened in name order, zero-padded (or cut) to ``length`` (None: as they are)."""
    v = np.concatenate([art[n].ravel() for n in sorted(art) if n not in names] or [np.zeros(0)])
    return v if length is None else np.pad(v, (0, max(0, length - len(v))))[:length]


class Features:
    """Standardisation on the shadow artifacts and a fixed random projection to at most ``dim`` features."""

    def __init__(self, train: np.ndarray, dim: int, seed: int):
        self.mu, self.sd = train.mean(0), train.std(0) + 1e-6
        d = train.shape[1]
        self.proj = None
        if d > dim:
            self.proj = seeding.rng(seed, "generic-projection").standard_normal((d, dim)) / np.sqrt(dim)

    def __call__(self, v: np.ndarray) -> torch.Tensor:
        z = (v - self.mu) / self.sd
        return torch.as_tensor(z @ self.proj if self.proj is not None else z, dtype=torch.float32)



def link_scores(observed: dict, singles: list, names: list[str]) -> np.ndarray:
    """How well each single-image artifact explains the observed one (higher: more likely a member)."""
    out = np.zeros(len(singles))
    for i, s in enumerate(singles):
        if s is None:
            out[i] = np.nan
            continue
        s = arrays_of(s)
        score = 0.0
        if names:
            r, q = rows_of(observed, names), rows_of(s, names)
            score -= float(np.sqrt(((r[:, None, :] - q[None]) ** 2).mean(-1)).min())
        rest = [n for n in s if n not in names and n in observed and observed[n].shape == s[n].shape]
        if rest:
            a, b = (np.concatenate([d[n].ravel() for n in rest]) for d in (observed, s))
            mask = b != 0
            score -= float(((a - b)[mask] ** 2).mean()) if mask.any() else 0.0
        out[i] = score
    return np.nan_to_num(out, nan=np.nanmin(out) if np.isfinite(out).any() else 0.0)



class Decoder(torch.nn.Module):
    """Artifact features -> targets (images, class and domain scores, flattened): a ridge regression, closed form,
    plus a small network fitted to its residual."""

    def __init__(self, z: torch.Tensor, t: torch.Tensor, ridge: float = 1.0, hidden: int = 256):
        super().__init__()
        z1 = torch.cat([z, torch.ones(len(z), 1)], 1).double()
        a = z1.T @ z1 + ridge * len(z) * torch.eye(z1.shape[1], dtype=torch.float64)
        self.w = torch.linalg.solve(a, z1.T @ t.double()).float()
        self.net = torch.nn.Sequential(torch.nn.Linear(z.shape[1], hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, t.shape[1]))
        torch.nn.init.zeros_(self.net[2].weight)
        torch.nn.init.zeros_(self.net[2].bias)

    def forward(self, z):
        return torch.cat([z, torch.ones(len(z), 1)], 1) @ self.w + self.net(z)


def train_decoder(z: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, steps: int, seed: int) -> Decoder:
    """Fit the decoder to targets ``t`` (rows of flattened images and one-hot scores), the squared error of each
    entry weighted by ``weight`` (0 where a target is unknown: an absent class's image, an unknown domain)."""
    torch.manual_seed(seeding.seed_int(seed, "generic-decoder"))
    net = Decoder(z, t * (weight > 0))
    opt = torch.optim.Adam(net.net.parameters(), lr=1e-3)
    gen = seeding.torch_gen(seed, "generic-batches")
    for _ in range(steps):
        j = torch.randint(len(z), (min(64, len(z)),), generator=gen)
        loss = (((net(z[j]) - t[j]) ** 2) * weight[j]).sum() / weight[j].sum().clamp_min(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


# ------------------------------------------------------------------------------------------- the attack

def _pairs(arts: list, clients: list, cdom: list, names: list, k: int, shape: tuple, seed: int) -> tuple:
    """The decoder's training pairs from the shadow artifacts: one (row, image) pair per image where the artifact
    has per-image rows (``names``), else one (artifact, class means and label shares) pair per client.
    (features z, images, slot mask, classes, domains, flat length)."""
    c, s = shape
    if names:   # one (row, image) pair per image
        z = np.concatenate([rows_of(a, names) for a in arts])
        img = torch.cat([cl.x for cl in clients]).float().unsqueeze(1)   # (rows, 1 slot, C, H, W)
        mask = torch.ones(len(z), 1, dtype=torch.bool)
        cls = torch.cat([cl.y for cl in clients]).long()
        dom = torch.as_tensor(np.concatenate([np.full(len(cl.y), d) for cl, d in zip(clients, cdom)]))
        cap = seeding.rng(seed, "generic-rows").permutation(len(z))[:4000]
        z, img, mask, cls, dom = z[cap], img[cap], mask[cap], cls[cap], dom[cap]
        length = 0
    else:       # one (artifact, class means) pair per client
        length = max(len(flat_of(a, [])) for a in arts)
        z = np.stack([flat_of(a, [], length) for a in arts])
        img = torch.zeros(len(arts), k, c, s, s)
        mask = torch.zeros(len(arts), k, dtype=torch.bool)
        cls = torch.zeros(len(arts), k)
        for i, cl in enumerate(clients):
            for j in range(k):
                sel = cl.y == j
                if sel.any():
                    img[i, j], mask[i, j] = cl.x[sel].float().mean(0), True
            cls[i] = torch.bincount(cl.y.long(), minlength=k)[:k].float() / len(cl.y)
        dom = torch.as_tensor(cdom)
    return z, img, mask, cls, dom, length


class GenericArtifact(Attack):
    name = "generic_artifact"
    consumes = ("*",)             # every kind a client uploads (less Params.skip)
    adversary = "server"
    aux = ("public", "domain_samples", "candidates")
    outputs = {"link": "the method's own client code run on each candidate alone (shadow federations)",
               "decoder": "a decoder trained on (artifact, images) pairs from shadow federations of the observed "
                          "protocol on the attacker's public images"}
    priors = {"decoder": "learned"}
    budget = {"decoder": (("steps",), "")}
    knows = ("architecture", "local_hyperparams")
    Params = Params

    def __init__(self, params=None, device: str = "cpu"):
        super().__init__(params, device)
        if self.p.kinds:
            self.consumes = tuple(self.p.kinds)
        else:
            self.ignores = tuple(self.p.skip)

    def cost(self) -> dict:
        """Per victim: its shadow pairs (pairs / group federations) and decoder; per candidate image (2 per member,
        at most 30 members: the candidate pools): its single-image federation share. Loaded-machine estimates."""
        return {"victim": 2.0 + 0.5 * self.p.pairs / self.p.group + 0.005 * self.p.steps, "image": 0.1,
                "max_images": 30}

    def run(self, view, aux) -> list:
        p, outs = self.p, []
        kinds = set(p.kinds) if p.kinds else None
        first = {}
        for m in sorted(view.messages(), key=lambda m: m.seq):
            if m.sender in view.clients and m.sender != view.me and \
                    (m.kind in kinds if kinds is not None else m.kind not in p.skip):
                first.setdefault((m.kind, m.sender), m)
        by_kind = {}
        for (kind, victim), m in first.items():
            by_kind.setdefault(kind, []).append(m)
        for kind, msgs in sorted(by_kind.items()):
            msgs = sample_victims(view, msgs, p.max_victims, key=lambda m: m.sender)
            outs += self.attack_kind(view, aux, kind, msgs)
        return outs

    def pool(self, aux) -> tuple[Split, np.ndarray]:
        """The attacker's images: every source domain's public samples (domain index) and the public domain (-1)."""
        doms = [d for d in aux.domains if d in aux.domain_samples]
        parts = [aux.domain_samples[d] for d in doms] + ([aux.public] if aux.public is not None else [])
        if not parts:
            raise UserError("generic_artifact needs aux public or domain_samples images")
        x = torch.cat([s.x for s in parts])
        y = torch.cat([s.y for s in parts])
        dom = np.concatenate([np.full(len(s.y), i if i < len(doms) else -1) for i, s in enumerate(parts)])
        return Split(x, y, np.arange(len(y))), dom

    def attack_kind(self, view, aux, kind: str, msgs: list) -> list:
        p, k, dev = self.p, aux.num_classes or view.shape[2], view.device
        until = max(m.round for m in msgs)
        pool, dom = self.pool(aux)
        settings = view.settings
        sizes = {}
        for m in msgs:
            n = next((s.payload.scalars.get("n") for s in view.messages(kind="n_samples", sender=m.sender)), None)
            sizes[m.sender] = int(min(p.max_size, n)) if isinstance(n, (int, float)) and n >= 1 else min(8, p.max_size)
        outs = []
        for size in sorted(set(sizes.values())):
            group = [m for m in msgs if sizes[m.sender] == size]
            t0 = time.process_time()
            rng = seeding.rng(p.seed, view.run_id, kind, size)
            small = 2 if size == 1 else max(1, size // 2)   # two sizes: per-image arrays follow the count
            clients, sz, cdom = [], [], []
            for j in range(p.pairs):
                n = size if j % 2 == 0 else small
                d = j % (len(aux.domains) + 1) - 1 if len(set(dom.tolist())) > 1 else -1
                src = np.flatnonzero(dom == d) if d >= 0 and (dom == d).any() else np.arange(len(pool.y))
                rows = rng.choice(src, n, replace=n > len(src))
                clients.append(_sub(pool, rows))
                sz.append(n)
                cdom.append(int(np.bincount(dom[rows] + 1).argmax()) - 1)
            arts = shadow_uploads(view.method, settings, view.model_cfg, clients, kind, until, k, p.group,
                                  seeding.seed_int(p.seed, view.run_id, kind, size), dev)
            keep = [i for i, a in enumerate(arts) if a is not None]
            if len(keep) < 2:
                outs += [Skipped(m.sender, kind, m.round, "the method's clients sent no such artifact for the "
                                 "attacker's images in shadow federations") for m in group]
                continue
            arts = [arrays_of(arts[i]) for i in keep]
            clients, sz, cdom = [clients[i] for i in keep], [sz[i] for i in keep], [cdom[i] for i in keep]
            names = per_image(arts, sz)
            outs += self.decode(view, aux, kind, group, arts, clients, cdom, names, k, time.process_time() - t0)
            outs += self.link(view, aux, kind, group, names, until, k)
        return outs

    def decode(self, view, aux, kind, group, arts, clients, cdom, names, k, spent) -> list:
        p, (c, s, _) = self.p, view.shape
        t0 = time.process_time()
        n_dom = len(aux.domains)
        z, img, mask, cls, dom, length = _pairs(arts, clients, cdom, names, k, (c, s), p.seed)
        feats = Features(z, p.dim, p.seed)
        slots, px = img.shape[1], c * s * s
        onehot = lambda v, n: F.one_hot(v.clamp_min(0), n).float()  # noqa: E731
        nd = max(1, n_dom)
        cls_t = onehot(cls, k) if names else torch.cat([mask.float(), cls], 1)
        t = torch.cat([img.flatten(1), cls_t, onehot(dom.long(), nd)], 1)
        w = torch.cat([mask.float().repeat_interleave(px, 1), torch.ones_like(cls_t),
                       (dom >= 0).float()[:, None].expand(-1, nd)], 1)
        net = train_decoder(feats(z), t, w, p.steps, p.seed)
        split = lambda o: (o[:, :slots * px].view(-1, slots, c, s, s), o[:, slots * px:-nd], o[:, -nd:])  # noqa: E731
        cost = (time.process_time() - t0) + spent
        outs = []
        for m in group:
            art = arrays_of(m.payload)
            with torch.no_grad():
                if names:
                    try:
                        r = rows_of(art, names)
                    except (KeyError, ValueError):
                        outs.append(Skipped(m.sender, kind, m.round, "the artifact lacks the per-image arrays of "
                                            "the shadow artifacts", "decoder"))
                        continue
                    pick = np.sort(seeding.rng(p.seed, view.run_id, m.sender).permutation(len(r))[:p.max_rows])
                    rec, lc, ld = split(net(feats(r[pick])))
                    images, labels = rec[:, 0], lc.argmax(1).numpy()
                    d = int(np.bincount(ld.argmax(1).numpy(), minlength=nd).argmax())
                else:
                    rec, lc, ld = split(net(feats(flat_of(art, [], length)[None])))
                    present = lc[0, :k] > 0.5
                    if not present.any():
                        present[lc[0, :k].argmax()] = True
                    images, labels = rec[0, present], np.flatnonzero(present.numpy())
                    share = lc[0, k:].clamp_min(0).numpy()
                    share = share / share.sum() if share.sum() > 0 else np.full(k, 1.0 / k)
                    outs.append(Estimate(m.sender, kind, m.round, "label_counts", share * len(clients[0].y),
                                         variant="decoder"))
                    d = int(ld[0].argmax())
            outs.append(Reconstruction(m.sender, kind, m.round, images.clamp(0, 1), truth=records.TRAIN,
                                       variant="decoder", labels=labels, cpu_seconds=cost, iterations=p.steps,
                                       plateau=""))
            if n_dom > 1:
                outs.append(Predictions(m.sender, kind, m.round, "domain", np.array([d]), n_dom,
                                        truth=records.TRAIN, rows=np.array([0]), variant="decoder"))
        return outs

    def link(self, view, aux, kind, group, names, until, k) -> list:
        outs = []
        for m in group:
            cand = aux.candidates.get(m.sender)
            if cand is None or len(cand.y) < 2:
                continue
            singles = shadow_uploads(view.method, view.settings, view.model_cfg,
                                     [_sub(cand, [i]) for i in range(len(cand.y))], kind, until, k, self.p.group,
                                     seeding.seed_int(self.p.seed, view.run_id, m.sender), view.device)
            outs.append(Scores(m.sender, kind, m.round, link_scores(arrays_of(m.payload), singles, names),
                               variant="link"))
        return outs

    def control(self) -> list[Control]:
        from attacks.generic_controls import control_run   # the controls' methods subclass FedAvg: loaded when used
        bank = control_run("feddg", "amplitude_bank", self.p)
        raw = control_run("attacks.generic_controls:RawMethod", "scalar", self.p)
        noise = control_run("attacks.generic_controls:NoiseMethod", "scalar", self.p)
        return [Control("FedDG's bank linked to its images (AUC)", "auc", bank["auc"], 0.9),
                Control("images sent as they are: decoded image nearest a member (chance 0.5)", "reid", raw["reid"],
                        0.9),
                Control("data-independent artifact: |AUC - 0.5|", "auc", abs(noise["auc"] - 0.5), 0.25,
                        positive=False),
                Control("data-independent artifact: decoded image nearest a member, above chance 0.5", "reid",
                        noise["reid"] - noise["chance"], 0.25, positive=False)]
