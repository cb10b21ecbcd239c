"""Scoring: ground truth joined with attack outputs, apart from the attacks (breaching's habit).

``Truth`` holds a run's images by global id and the truth records victims wrote (truth/<run>/<victim>/*.npz);
``build_aux`` builds the auxiliary data an attack declared and the membership truth of its candidate pools;
``score`` turns one attack output into (metric, value, baseline) rows, with the per-item values behind each number
(fdg_audit.metrics.stats.Items) for the scorecard's intervals and held-out selection. Metric names are those of the
metric registry (fdg_audit.metrics.registry), which says the harm each measures.
"""
from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import numpy as np
import torch

from .. import metrics as M, records, seeding
from ..metrics import stats  # noqa: F401  (M.stats)
from ..attack import Audit, Aux, Estimate, Predictions, Reconstruction, Scores
from ..data.base import Split
from ..errors import UserError
from ..store.ledger import load_npz
from ..privacy.audit import audit_rows
from ..store.runfolder import RunFolder
from .guesses import GUESS_CLASS_MEAN, GUESS_MEAN, GUESS_MEAN_PHASE, GUESS_RANDOM_PHASE, RENDERED_ID  # noqa: F401
from .guesses import N_DISTRACTORS, _free_image, _match, free_guesses  # noqa: F401
from .guesses import matched_chance  # noqa: F401
from .guesses import rendered_pool  # noqa: F401  (re-exported for tests and the harness)


class Truth:
    """A run's images by global id (``images``) and its victims' truth records (``record``). ``pool`` holds each
    domain's images (train + val); ``extra`` more images of the same domain that no client of the run held, rendered
    from the data source's unused digits (``rendered_pool``), so that re-identification has ``N_DISTRACTORS`` of
    the victim's class even where a client holds its whole domain."""

    def __init__(self, root: Path, run_id: str, data):
        self.root, self.run_id, self.data = Path(root), run_id, data
        self.pool = {d.name: (torch.cat([d.train.x, d.val.x]), torch.cat([d.train.y, d.val.y]),
                              np.concatenate([d.train.idx, d.val.idx])) for d in self.data.domains}
        self.extra = rendered_pool(data)
        self.by_idx = {}
        for src in ("pool", "extra"):
            for name, (x, y, idx) in getattr(self, src).items():
                for i, g in enumerate(idx):
                    self.by_idx[int(g)] = (src, name, i)

    def images(self, idx) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        locs = [self.by_idx[int(g)] for g in idx]
        x = torch.stack([getattr(self, s)[d][0][i] for s, d, i in locs])
        y = torch.stack([getattr(self, s)[d][1][i] for s, d, i in locs])
        return x, y, [d for _, d, _ in locs]

    def public_images(self, sources) -> tuple[torch.Tensor, torch.Tensor]:
        """The images and labels of the run's domains that are not ``sources`` (the held-out domain: an attacker's
        public data)."""
        rest = [v for n, v in self.pool.items() if n not in set(sources)] or list(self.pool.values())
        return torch.cat([v[0] for v in rest]), torch.cat([v[1] for v in rest])

    def held(self, victim: str, idx) -> np.ndarray:
        """Image ids the victim held: its training images (all of an aggregate "a+b"), and ``idx`` itself."""
        try:
            own = self.record(victim, records.TRAIN)["idx"]
        except (UserError, StopIteration, KeyError, ValueError):   # not a client of the data set: only idx
            own = []
        return np.union1d(np.asarray(own, np.int64), np.asarray(idx, np.int64))

    def distractors(self, idx, y, doms, held, n: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """For each true image, ``n`` images of its domain that the victim did not hold: those of its class first
        (the run's own images, then rendered ones of ``extra``), then the others, in an order drawn from the image's
        id (so every attack and channel meets the same candidates): a tensor (B, D, C, H, W) with D = the fewest any
        image has (at most ``n``), D per image and how many of the D are of the image's class."""
        picks, same_n = [], []
        for g, c, d in zip(np.asarray(idx), np.asarray(y), doms):
            rng = seeding.rng(seeding.SCORE, int(g))
            same, other = [], []
            for src in (self.pool, self.extra):
                if d not in src:
                    continue
                xs, ys, ids = src[d]
                free, yy = ~np.isin(ids, held), ys.numpy()
                same.append((xs, rng.permutation(np.flatnonzero(free & (yy == c)))))
                other.append((xs, rng.permutation(np.flatnonzero(free & (yy != c)))))
            chosen, left = [], n
            for xs, p in same + other:   # same class (the run's images, then rendered ones), then the others
                chosen.append(xs[p[:left]])
                left -= len(chosen[-1])
            picks.append(torch.cat(chosen))
            same_n.append(sum(len(p) for _, p in same))
        k = min((len(p) for p in picks), default=0)
        out = torch.stack([p[:k] for p in picks]) if picks else torch.empty(0)
        return out, np.full(len(picks), k), np.minimum(np.asarray(same_n, np.int64), k)

    def record(self, victim: str, name: str) -> dict:
        if name == records.TRAIN:
            return {"idx": np.concatenate([self.data.domain(v).train.idx for v in victim.split("+")])}
        f = RunFolder(self.root).truth_file(self.run_id, victim, name)
        if not f.exists():
            raise FileNotFoundError(f"no ground truth {f}")
        return load_npz(f, self.root)


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
    """Join one attack output with the truth through its class's scorer (``SCORERS``): (metric, value, baseline)
    rows, and for a Reconstruction the (truth, reconstruction, baseline) images as scored (matched and clamped; for
    the run folder's grids)."""
    scorer = next((SCORERS[c] for c in type(out).__mro__ if c in SCORERS), None)
    if scorer is None:
        raise TypeError(f"attack returned {type(out).__name__}; return one of "
                        f"{', '.join(c.__name__ for c in SCORERS)}")
    return scorer(out, truth, members, aux)


def _add(rows: list):
    """``add(metric, value, baseline, items, base_items)``: append one scorer row to ``rows``."""
    return lambda metric, value, baseline=float("nan"), items=None, base=None: rows.append(
        dict(metric=metric, value=float(value), baseline=float(baseline), items=items, base_items=base))


def score_membership(out: Scores, truth: Truth, members: dict, aux: Aux) -> tuple[list[dict], None]:
    """AUC (with its interval), the blind baseline and TPR at low FPR of membership scores."""
    rows = []
    add = _add(rows)
    vs = out.victims or [out.victim]
    lab = np.concatenate([members[v] for v in vs])
    ids = np.concatenate([_image_ids(np.arange(len(members[v])), v) for v in vs])
    blind = _blind_auc(aux, members, vs)
    base = 0.5 if np.isnan(blind) else max(0.5, blind)   # a leak only above what no model gives
    a, lo, hi = M.membership.auc_ci(out.scores, lab)
    add("auc", a, base, M.stats.Items("auc", np.asarray(out.scores, float), lab.astype(int), ids))
    add("auc_ci_low", lo, base)
    add("auc_ci_high", hi, base)
    add("blind_auc", blind, 0.5)
    for f in (0.01, 0.001, 0.0):
        add(f"tpr@{f:g}fpr", M.tpr_at_fpr(out.scores, lab, f), f)
    return rows, None


def score_predictions(out: Predictions, truth: Truth, members: dict, aux: Aux) -> tuple[list[dict], None]:
    """Balanced accuracy of predicted classes or domains.

    Domain predictions: client ids are domain names, so whoever knows the victim knows its domain. leakage.csv keeps
    chance (1/K, a guesser that does not know the victim) as the baseline; the per-item baseline the scorecard pairs
    with the attack is the known-victim guess (the victim's domain; for an aggregate "a+b" its largest domain), so a
    scorecard cell reports only what goes beyond the victim's name (a single-domain victim's cell is vacuous)."""
    rows = []
    add = _add(rows)
    rec = truth.record(out.victim, out.truth)
    idx = rec["idx"] if out.rows is None else rec["idx"][np.asarray(out.rows)]
    _, y, doms = truth.images(idx)
    true = y.numpy() if out.attribute == "class" else np.array([aux.domains.index(d) for d in doms])
    ids = _image_ids(idx)
    hit = lambda p: M.stats.Items("balanced_acc", (np.asarray(p) == true).astype(float), true, ids)  # noqa: E731
    if out.attribute == "class":
        add("class_balanced_acc", M.balanced_accuracy(out.pred, true, out.n_classes), M.chance(out.n_classes),
            hit(out.pred))
    else:   # leakage.csv: chance; per item (the scorecard's): what the victim's name gives
        guess = np.full(len(true), np.bincount(true).argmax())
        add("domain_balanced_acc", M.balanced_accuracy(out.pred, true, out.n_classes), M.chance(out.n_classes),
            hit(out.pred), hit(guess))
    return rows, None


def score_estimate(out: Estimate, truth: Truth, members: dict, aux: Aux) -> tuple[list[dict], None]:
    """Relative error of a size estimate, or the accuracy of label counts (one item: the victim)."""
    rows = []
    add = _add(rows)
    y = truth.data.domain(out.victim).train.y.numpy()
    one = lambda v: M.stats.Items("mean", np.array([float(v)]), ids=_image_ids([0], out.victim))  # noqa: E731
    if out.quantity == "n_samples":
        # baseline: guess the size of the attacker's own public set (a domain it holds), when it has one
        e = M.relative_error(float(np.ravel(out.value)[0]), len(y))
        eb = M.relative_error(len(aux.public.y), len(y)) if aux.public is not None else float("nan")
        add("n_samples_rel_error", e, eb, one(e), None if np.isnan(eb) else one(eb))
        return rows, None
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
    return rows, None


def score_audit(out: Audit, truth: Truth, members: dict, aux: Aux) -> tuple[list[dict], None]:
    """Empirical ε lower bounds of a DP audit (fdg_audit.privacy.audit)."""
    return audit_rows(out, truth.record(out.victim, out.truth)), None


ALIGNMENT = "aligned (best circular shift and point inversion, for every channel)"
BASELINE_KIND = ("reid, legible: the strongest free guess (free_guess), scored like the attack, never below chance; "
                 "PSNR, SSIM: better of the attacker's public mean image and the flat image (true channel means), "
                 "aligned the same way")
def score_reconstruction(out: Reconstruction, truth: Truth, members: dict, aux: Aux) -> tuple[list[dict], tuple]:
    """One scorer for every reconstruction, whatever the channel: each image is aligned to its true image (shift
    and point inversion: the ambiguities of Fourier magnitudes, applied to every channel alike); with ``rows`` None
    the images are first matched one to one to the victim's training images (Hungarian, on re-identification's
    distance).

    Headline ``reid`` (linkable): the reconstruction picks its true image out of the true image and
    ``N_DISTRACTORS`` images of the same domain that the victim did not hold, those of its class first (the run's
    own, then images rendered by the domain's recipe from digits no client held: ``rendered_pool``), by nearest
    neighbour on aligned standardised images. ``legible`` (per image 0/1): its aligned correlation with the true
    image is at least ``LEGIBLE_CORR`` (image.legible: textured noise won by a hair is not legible).
    Their baseline is the strongest guess an attacker has for free (``free_guesses``), scored exactly like the
    attack (the same matching, distractors and rule), never below ``chance``: 1/(1 + D) where the rows are known
    or one output meets one image, else (k outputs matched among N images, N = 1 included) the hit rate of k guesses
    that know nothing of the victim (unheld images of its domains, or noise: the higher) sent through the same
    matching and re-identification (``matched_chance``). Row ``reid_free`` is that
    free guess's re-identification against chance: for the bank, the true amplitude alone links an image (a
    fingerprint) when it is above chance, apart from what phase retrieval adds. Beside them: aligned PSNR
    (``psnr``), plain PSNR (``psnr_plain``), aligned SSIM, success at 20 and 25 dB, whose baseline per image is the
    better of the attacker's public mean image and the flat image at the true channel means, scored the same way.
    ``cpu_seconds`` and ``iterations`` are the attack's cost. Every row carries ``alignment``, ``baseline_kind``,
    ``plateau``, ``chance``, ``free_guess``, ``n_distractors`` and ``n_same_class`` (the fewest over images)."""
    I = M.stats.Items
    rec = truth.record(out.victim, out.truth)
    idx = rec["idx"] if out.rows is None else rec["idx"][np.asarray(out.rows)]
    x, y, doms = truth.images(idx)
    r = out.images.detach().cpu().float().clamp(0, 1)
    pred = None if out.labels is None else np.asarray(out.labels)
    held = truth.held(out.victim, idx)
    victim, match = (idx, x, y, doms), out.rows is None
    pub = (aux.public.x, aux.public.y) if aux.public is not None else truth.public_images(aux.domains)
    ri, ci, r, hit, leg, n_dis, n_same = _reid(truth, r, victim, held, match)
    plain = out.images.detach().cpu().float().clamp(0, 1)[ri]
    k = len(out.images)
    chance = matched_chance(truth, k, victim, held) if match and max(k, len(idx)) > 1 else \
        1.0 / (1 + (int(n_dis.min()) if len(n_dis) else 0))
    paired = not match or len(idx) == 1   # the free guess meets the attack's true images in the attack's order
    free, g_hit, g_leg = _strongest_guess(truth, out, victim, held, match, pub, aux.num_classes)
    idx, x, y, doms = idx[ci], x[ci], y[ci], [doms[i] for i in ci]
    pred = None if pred is None else pred[ri]
    b = _free_image(x, pub[0])
    ids = _image_ids(idx)
    per = lambda v: I("mean", np.asarray(v, float), ids=ids)  # noqa: E731  (per-image values)
    like = lambda v: per(v if paired else np.full(len(ids), np.mean(v)))  # noqa: E731  (the guess's, per image)
    rows = []
    add = _add(rows)
    base = max(chance, float(g_hit.mean()))
    add("reid", hit.mean(), base, per(hit), like(g_hit) if g_hit.mean() >= chance else per(np.full(len(ids), chance)))
    add("reid_free", g_hit.mean(), chance, like(g_hit), per(np.full(len(ids), chance)))
    add("legible", leg.mean(), g_leg.mean(), per(leg), like(g_leg))
    _quality_rows(add, per, (r, plain, x, b), pred, y, aux.num_classes)
    if np.isfinite(out.cpu_seconds):
        add("cpu_seconds", out.cpu_seconds)
    if out.iterations:
        add("iterations", out.iterations)
    extra = dict(alignment=ALIGNMENT, baseline_kind=BASELINE_KIND, plateau=out.plateau or "fixed budget",
                 chance=chance, free_guess=free, n_distractors=int(n_dis.min()) if len(n_dis) else 0,
                 n_same_class=int(n_same.min()) if len(n_same) else 0)
    return [row | extra for row in rows], (x, r, b)


def _reid(truth: Truth, r: torch.Tensor, victim: tuple, held: np.ndarray, match: bool) -> tuple:
    """Images ``r`` scored as an attack's: matched one to one to the victim's images (Hungarian on standardised
    aligned MSE; the surplus of the larger set left out) when ``match``, else row by row; aligned to their true images;
    re-identified among their distractors and judged legible. (ri, ci, aligned images, hits, legible, D, same-class
    count), hits and legible as numpy 0/1 per matched image."""
    idx, x, y, doms = victim
    ri, ci = _match(r, x) if match else (np.arange(len(r)), np.arange(len(r)))
    xs, ra = x[ci], M.aligned(r[ri], x[ci])
    dis, n_dis, n_same = truth.distractors(idx[ci], y.numpy()[ci], [doms[i] for i in ci], held, N_DISTRACTORS)
    hit = M.reidentified(ra, xs, dis)
    leg = M.legible(ra, xs)
    return ri, ci, ra, hit.numpy().astype(float), leg.numpy().astype(float), n_dis, n_same


def _strongest_guess(truth: Truth, out, victim: tuple, held: np.ndarray, match: bool, pub: tuple,
                     num_classes: int) -> tuple:
    """The free guess (``free_guesses``) that re-identifies most, then is legible most, scored like the attack:
    (its name, its hits, its legible flags)."""
    guesses = {name: _reid(truth, g, victim, held, match)[3:5]
               for name, g in free_guesses(out, victim[1], pub, num_classes, victim[0]).items()}
    free = max(guesses, key=lambda k: (guesses[k][0].mean(), guesses[k][1].mean()))
    return (free, *guesses[free])


def _quality_rows(add, per, images: tuple, pred, y: torch.Tensor, num_classes: int) -> None:
    """PSNR (aligned, plain, max), SSIM and success at 20 and 25 dB against the free image, and the label's accuracy
    where the attack inferred labels; ``images`` = (aligned, plain, true, free image)."""
    r, plain, x, b = images
    ps, pb = M.psnr(r, x), M.psnr(b, x)
    add("psnr", ps.mean(), pb.mean(), per(ps), per(pb))
    add("psnr_plain", M.psnr(plain, x).mean(), pb.mean())
    add("psnr_max", ps.max(), pb.max())
    ss, sb = M.ssim(r, x), M.ssim(b, x)
    add("ssim", ss.mean(), sb.mean(), per(ss), per(sb))
    for t in (20.0, 25.0):
        add(f"success@{t:g}dB", M.success_rate(ps, t), M.success_rate(pb, t), per(ps >= t), per(pb >= t))
    if pred is not None:
        ok = pred == y.numpy()
        add("label_acc", float(ok.mean()), M.chance(num_classes), per(ok))


# The one table from output class to its scorer: a new output type adds its class (fdg_audit/attack.py) and a
# line here (and its metrics to fdg_audit/metrics/registry.py).
SCORERS = {Reconstruction: score_reconstruction, Scores: score_membership, Predictions: score_predictions,
           Estimate: score_estimate, Audit: score_audit}


def _image_ids(idx, victim: str = "") -> np.ndarray:
    """Item identities for the held-out split: global image ids, or pool positions salted by the victim's name."""
    salt = (zlib.crc32(victim.encode()) & 0x7FFFFFFF) << 32 if victim else 0
    return np.asarray(idx, np.int64) + np.int64(salt)


_BLIND: dict = {}   # blind AUC by candidate pool content: every attack and output of a run shares its pools


def _blind_auc(aux: Aux, members: dict, victims: list) -> float:
    """The blind baseline (``metrics.membership.blind_auc``) of these victims' candidates, pooled; NaN when the
    attacker's aux has no candidates for one of them."""
    if any(v not in aux.candidates for v in victims):
        return float("nan")
    x = torch.cat([aux.candidates[v].x for v in victims]).cpu().numpy()
    y = torch.cat([aux.candidates[v].y for v in victims]).cpu().numpy()
    m = np.concatenate([members[v] for v in victims])
    if min(m.sum(), len(m) - m.sum()) < 2:
        return float("nan")
    key = hashlib.blake2b(x.tobytes() + y.tobytes() + m.tobytes(), digest_size=16).hexdigest()
    if key not in _BLIND:
        _BLIND[key] = M.membership.blind_auc(x, y, m, n_classes=aux.num_classes)
    return _BLIND[key]
