"""Scoring: ground truth joined with attack outputs, apart from the attacks (breaching's habit).

``Truth`` holds a run's images by global id and the truth records victims wrote (truth/<run>/<victim>/*.npz);
``build_aux`` builds the auxiliary data an attack declared and the membership truth of its candidate pools;
``score`` turns one attack output into (metric, value, baseline) rows, with the per-item values behind each number
(fdg_audit.metrics.stats.Items) for the scorecard's intervals and held-out selection. Metric names are those of the
metric registry (fdg_audit.metrics.registry), which says the harm each measures.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch

from . import metrics as M
from .api.attack import Audit, Aux, Estimate, Predictions, Reconstruction, Scores
from .data import Split
from .ledger import load_npz
from .privacy.audit import audit_rows
from .runfolder import RunFolder


def _matched(rec: torch.Tensor, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(rows of ``rec``, rows of ``x``) paired one to one by the Hungarian algorithm on per-image MSE (every image
    of the smaller set gets a distinct partner)."""
    if len(rec) <= len(x):
        return np.arange(len(rec)), M.match_batch(x, rec).cpu().numpy()
    return M.match_batch(rec, x).cpu().numpy(), np.arange(len(x))


class Truth:
    """A run's images by global id (``images``) and its victims' truth records (``record``)."""

    def __init__(self, root: Path, run_id: str, data):
        self.root, self.run_id, self.data = Path(root), run_id, data
        self.pool = {d.name: (torch.cat([d.train.x, d.val.x]), torch.cat([d.train.y, d.val.y]),
                              np.concatenate([d.train.idx, d.val.idx])) for d in self.data.domains}
        self.by_idx = {}
        for name, (x, y, idx) in self.pool.items():
            for i, g in enumerate(idx):
                self.by_idx[int(g)] = (name, i)

    def images(self, idx) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        locs = [self.by_idx[int(g)] for g in idx]
        x = torch.stack([self.pool[d][0][i] for d, i in locs])
        y = torch.stack([self.pool[d][1][i] for d, i in locs])
        return x, y, [d for d, _ in locs]

    def record(self, victim: str, name: str) -> dict:
        if name == "train":
            return {"idx": np.concatenate([self.data.domain(v).train.idx for v in victim.split("+")])}
        f = RunFolder(self.root).truth_file(self.run_id, victim, name)
        if not f.exists():
            raise FileNotFoundError(f"no ground truth {f}")
        return load_npz(f)


def build_aux(data, target: str, need: tuple, seed: int = 0) -> tuple[Aux, dict]:
    """The attacker's auxiliary data (the ``need``ed parts) for a run holding out ``target``, and the membership
    truth of its candidate pools."""
    t = data.domain(target)
    aux = Aux(num_classes=data.num_classes, domains=[d.name for d in data.domains if d.name != target])
    members = {}
    if "layout" in need:
        aux.layout = dict(data.layout)
    if "public" in need:
        aux.public = Split(torch.cat([t.train.x, t.val.x]), torch.cat([t.train.y, t.val.y]),
                           np.concatenate([t.train.idx, t.val.idx]))
    rng = np.random.default_rng(seed)
    for d in data.domains:
        if d.name == target:
            continue
        half = len(d.val.y) // 2
        if "domain_samples" in need:
            aux.domain_samples[d.name] = Split(d.val.x[half:], d.val.y[half:], d.val.idx[half:])
        for c in data.clients(d.name):   # one victim per client (the domain itself with one client per domain)
            if c is not d and "domain_samples" in need:
                aux.domain_samples[c.name] = aux.domain_samples[d.name]
            if "candidates" not in need:
                continue
            # non-members come from the first half of the domain's val split (the second half is public); with
            # several clients per domain they are shared: no client of the domain trained on them
            n = min(half, len(c.train.y))
            if n == 0:
                continue
            mi, out = rng.choice(len(c.train.y), n, replace=False), rng.choice(half, n, replace=False)
            x = torch.cat([c.train.x[mi], d.val.x[out]])
            y = torch.cat([c.train.y[mi], d.val.y[out]])
            lab = np.r_[np.ones(n), np.zeros(n)]
            p = rng.permutation(2 * n)
            # ids are positions in the pool: global image ids would reveal the train/val split (membership)
            aux.candidates[c.name] = Split(x[p], y[p], np.arange(2 * n))
            members[c.name] = lab[p]
    return aux, members


def score(out, truth: Truth, members: dict, aux: Aux) -> tuple[list[dict], tuple | None]:
    """Join one attack output with the truth: (metric, value, baseline) rows, and for a Reconstruction the
    (truth, reconstruction, baseline) images as scored (matched and clamped; for the run folder's grids).

    Domain predictions: client ids are domain names, so whoever knows the victim knows its domain. leakage.csv keeps
    chance (1/K, a guesser that does not know the victim) as the baseline; the per-item baseline the scorecard pairs
    with the attack is the known-victim guess (the victim's domain; for an aggregate "a+b" its largest domain), so a
    scorecard cell reports only what goes beyond the victim's name (a single-domain victim's cell is vacuous)."""
    rows, images = [], None
    add = lambda metric, value, baseline=float("nan"), items=None, base=None: rows.append(  # noqa: E731
        dict(metric=metric, value=float(value), baseline=float(baseline), items=items, base_items=base))
    I = M.stats.Items
    if isinstance(out, Reconstruction):
        rec = truth.record(out.victim, out.truth)
        idx = rec["idx"] if out.rows is None else rec["idx"][np.asarray(out.rows)]
        x, y, _ = truth.images(idx)
        r = out.images.detach().cpu().float().clamp(0, 1)
        if out.flat_baseline and out.rows is not None:
            b = x.mean((2, 3), keepdim=True).expand_as(x).clone()
        elif out.baseline is not None:
            b = out.baseline.cpu().float()
        else:
            b = (aux.public.x if aux.public is not None else x).mean(0, keepdim=True).expand_as(r)
        xb, pred = x, None if out.labels is None else np.asarray(out.labels)
        if out.rows is None:  # match each image (baselines on their own) to a distinct true image
            ri, ci = _matched(r, x)
            bi, bc = _matched(b, x)
            r, b, xb, x, y = r[ri], b[bi], x[bc], x[ci], y[ci]
            pred = None if pred is None else pred[ri]
        ps = M.aligned_psnr(r, x) if out.aligned else M.psnr(r, x)
        bs = M.aligned_psnr(b, xb) if out.aligned else M.psnr(b, xb)
        ss = M.ssim(M.aligned(r, x) if out.aligned else r, x)
        sb = M.ssim(M.aligned(b, xb) if out.aligned else b, xb)
        # item ids: the true image each value is scored against (the baseline's own matching when matched apart)
        ids, bids = (_image_ids(idx), _image_ids(idx)) if out.rows is not None else \
            (_image_ids(idx[ci]), _image_ids(idx[bc]))
        per = lambda v, i=ids: I("mean", np.asarray(v, float), ids=i)  # noqa: E731  (per-image values)
        add("psnr", ps.mean(), bs.mean(), per(ps), per(bs, bids))
        add("psnr_max", ps.max(), bs.max())
        add("ssim", ss.mean(), sb.mean(), per(ss), per(sb, bids))
        add("success@25dB", M.success_rate(ps, 25.0), M.success_rate(bs, 25.0), per(ps >= 25.0),
            per(bs >= 25.0, bids))
        if pred is not None:
            hit = pred == y.numpy()
            add("label_acc", float(hit.mean()), M.chance(aux.num_classes), per(hit))
        images = (x, r, b)
    elif isinstance(out, Scores):
        vs = out.victims or [out.victim]
        lab = np.concatenate([members[v] for v in vs])
        ids = np.concatenate([_image_ids(np.arange(len(members[v])), v) for v in vs])
        add("auc", M.auc(out.scores, lab), 0.5, I("auc", np.asarray(out.scores, float), lab.astype(int), ids))
        for f in (0.01, 0.001, 0.0):
            add(f"tpr@{f:g}fpr", M.tpr_at_fpr(out.scores, lab, f), f)
    elif isinstance(out, Predictions):
        rec = truth.record(out.victim, out.truth)
        idx = rec["idx"] if out.rows is None else rec["idx"][np.asarray(out.rows)]
        _, y, doms = truth.images(idx)
        true = y.numpy() if out.attribute == "class" else np.array([aux.domains.index(d) for d in doms])
        ids = _image_ids(idx)
        hit = lambda p: I("balanced_acc", (np.asarray(p) == true).astype(float), true, ids)  # noqa: E731
        if out.attribute == "class":
            add("class_balanced_acc", M.balanced_accuracy(out.pred, true, out.n_classes), M.chance(out.n_classes),
                hit(out.pred))
        else:   # leakage.csv: chance; per item (the scorecard's): what the victim's name gives (``score``)
            guess = np.full(len(true), np.bincount(true).argmax())
            add("domain_balanced_acc", M.balanced_accuracy(out.pred, true, out.n_classes), M.chance(out.n_classes),
                hit(out.pred), hit(guess))
    elif isinstance(out, Estimate):
        y = truth.data.domain(out.victim).train.y.numpy()
        one = lambda v: I("mean", np.array([float(v)]), ids=_image_ids([0], out.victim))  # noqa: E731  (item: victim)
        if out.quantity == "n_samples":
            # baseline: guess the size of the attacker's own public set (a domain it holds), when it has one
            e = M.relative_error(float(np.ravel(out.value)[0]), len(y))
            eb = M.relative_error(len(aux.public.y), len(y)) if aux.public is not None else float("nan")
            add("n_samples_rel_error", e, eb, one(e), None if np.isnan(eb) else one(eb))
        else:
            counts = np.bincount(y, minlength=len(out.value))
            prior = np.full(len(counts), len(y) / len(counts))
            acc, accb = M.label_count_accuracy(np.asarray(out.value), counts), M.label_count_accuracy(prior, counts)
            add("label_count_acc", acc, accb, one(acc), one(accb))
            # the distribution alone (1 - total variation): the estimate rescaled to the true total, so an error in
            # the victim's size (scored as dataset_size) does not count twice; the prior is already at that total
            v = np.asarray(out.value, float)
            dist = float(M.label_count_accuracy(v * len(y) / v.sum(), counts)) if v.sum() > 0 else float("nan")
            add("label_dist_acc", dist, accb, one(dist), one(accb))
            add("label_existence_f1", M.existence_f1(np.asarray(out.value), counts),
                M.existence_f1(np.ones(len(counts)), counts))
    elif isinstance(out, Audit):
        rows += audit_rows(out, truth.record(out.victim, out.truth))
    else:
        raise TypeError(f"attack returned {type(out).__name__}; return Reconstruction, Scores, Predictions, "
                        "Estimate or Audit")
    return rows, images


def _image_ids(idx, victim: str = "") -> np.ndarray:
    """Item identities for the held-out split: global image ids, or pool positions salted by the victim's name."""
    salt = (zlib.crc32(victim.encode()) & 0x7FFFFFFF) << 32 if victim else 0
    return np.asarray(idx, np.int64) + np.int64(salt)
