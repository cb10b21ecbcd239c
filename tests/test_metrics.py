import math

import numpy as np
import pytest
import torch
from scipy.stats import binom
from sklearn.metrics import balanced_accuracy_score, roc_auc_score

from fdg_audit import metrics as M

g = torch.Generator().manual_seed(0)


def imgs(b=4, c=3, h=16, w=20, dtype=torch.float32):
    return torch.rand(b, c, h, w, generator=g, dtype=dtype)


# ---------------------------------------------------------------- image metrics


def test_mse_psnr_known_values():
    x = imgs()
    y = (x * 0.8 + 0.1).clamp(0, 1)
    assert torch.allclose(M.mse(x, y), ((x - y) ** 2).mean((1, 2, 3)))
    assert M.psnr(x, x).shape == (4,) and torch.all(M.psnr(x, x) == M.PSNR_CAP_DB)
    z = torch.full((2, 1, 8, 8), 0.5)
    assert torch.allclose(M.psnr(z + 0.1, z), torch.tensor([20.0, 20.0]), atol=1e-4)  # 10·log10(1/0.01)
    assert torch.allclose(M.psnr(2 * (z + 0.1), 2 * z, data_range=2.0), torch.tensor([20.0, 20.0]), atol=1e-4)
    assert torch.allclose(M.psnr(z + 0.5, z), torch.tensor([10 * math.log10(4)] * 2), atol=1e-4)


def test_aligned_psnr_undoes_shift_and_point_inversion():
    x = imgs(b=3)
    shifted = torch.roll(x, (5, -7), (-2, -1))
    inv = torch.roll(torch.flip(x, (-2, -1)), (1, 1), (-2, -1))  # x(-n mod N)
    assert torch.equal(inv[..., 1, 2], x[..., -1, -2])
    both = torch.roll(inv, (3, 11), (-2, -1))
    rec = torch.cat([x[:1], shifted[1:2], both[2:]])  # one of each kind in a single batch
    assert torch.all(M.psnr(rec, x)[1:] < 15)
    p, xa = M.aligned_psnr(rec, x, return_aligned=True)
    assert torch.all(p == M.PSNR_CAP_DB) and torch.equal(xa, x)
    assert torch.equal(M.aligned(rec, x), x)
    # aligned_psnr of an unrelated image is the max over all 2·H·W moves (brute force)
    a, b = imgs(b=1, h=6, w=5), imgs(b=1, h=6, w=5)
    a_inv = torch.roll(torch.flip(a, (-2, -1)), (1, 1), (-2, -1))
    brute = max(M.psnr(torch.roll(src, (i, j), (-2, -1)), b).item()
                for src in (a, a_inv) for i in range(6) for j in range(5))
    assert M.aligned_psnr(a, b).item() == pytest.approx(brute, abs=1e-4)


def ssim_reference(x, y, win=11, sigma=1.5, c1=1e-4, c2=9e-4):
    """Direct numpy SSIM on one grey image: centred weighted moments per 'valid' window."""
    t = np.arange(win) - (win - 1) / 2
    k = np.exp(-t**2 / (2 * sigma**2))
    w = np.outer(k, k) / np.outer(k, k).sum()
    vals = []
    for i in range(x.shape[0] - win + 1):
        for j in range(x.shape[1] - win + 1):
            a, b = x[i:i + win, j:j + win], y[i:i + win, j:j + win]
            ma, mb = (w * a).sum(), (w * b).sum()
            va, vb, cab = (w * (a - ma) ** 2).sum(), (w * (b - mb) ** 2).sum(), (w * (a - ma) * (b - mb)).sum()
            vals.append((2 * ma * mb + c1) * (2 * cab + c2) / ((ma**2 + mb**2 + c1) * (va + vb + c2)))
    return float(np.mean(vals))


def test_ssim_properties_and_reference():
    x = imgs(b=2, c=3, h=24, w=24, dtype=torch.float64)
    y = (x + 0.2 * torch.randn(x.shape, generator=g, dtype=torch.float64)).clamp(0, 1)
    assert torch.allclose(M.ssim(x, x), torch.ones(2, dtype=torch.float64))
    assert torch.allclose(M.ssim(x, y), M.ssim(y, x))
    s = [M.ssim(x, (x + a * torch.randn(x.shape, generator=g, dtype=torch.float64)).clamp(0, 1)).mean().item()
         for a in (0.02, 0.1, 0.3)]
    assert 1 > s[0] > s[1] > s[2]
    a, b = x[:1, :1, :15, :17], y[:1, :1, :15, :17]
    assert M.ssim(a, b).item() == pytest.approx(ssim_reference(a[0, 0].numpy(), b[0, 0].numpy()), abs=1e-4)
    # channels are averaged
    per_ch = [M.ssim(x[:, c:c + 1], y[:, c:c + 1]) for c in range(3)]
    assert torch.allclose(M.ssim(x, y), sum(per_ch) / 3)
    with pytest.raises(ValueError):
        M.ssim(x[..., :8, :8], y[..., :8, :8])


def test_success_rate_and_label_counts():
    assert M.success_rate(torch.tensor([30.0, 25.0, 24.9, 10.0])) == 0.5
    assert M.success_rate(np.array([30.0, 12.0]), threshold=11) == 1.0
    # truth {0,0,1,2}, guess {0,1,1,3}: multiset overlap {0,1} = 2 of 4 -> 0.5
    acc = M.label_count_accuracy(torch.tensor([1, 2, 0, 1]), torch.tensor([2, 1, 1, 0]))
    assert acc.item() == pytest.approx(0.5)
    # truth {0,0,1,2}, guess {0,0,1,1}: overlap 3 of 4
    batched = M.label_count_accuracy(torch.tensor([[2, 2, 0, 0], [2, 1, 1, 0]]), torch.tensor([[2, 1, 1, 0]] * 2))
    assert torch.allclose(batched, torch.tensor([0.75, 1.0], dtype=torch.float64))
    # identity for equal totals: 1 - ½Σ|ĉ-c|/B == Σ min(ĉ, c)/B
    rng = np.random.default_rng(5)
    c = rng.multinomial(32, np.ones(10) / 10, size=20)
    c_hat = rng.multinomial(32, np.ones(10) / 10, size=20)
    assert np.allclose(M.label_count_accuracy(c_hat, c).numpy(), np.minimum(c_hat, c).sum(1) / 32)


def test_match_batch_recovers_permutation():
    truth = imgs(b=6)
    perm_true = torch.tensor([3, 0, 5, 1, 2, 4])  # no fixed points
    rec = torch.empty_like(truth)
    rec[perm_true] = truth + 0.05 * torch.randn(truth.shape, generator=g)  # rec[perm_true[i]] ~ truth[i]
    perm = M.match_batch(rec, truth)
    assert perm.dtype == torch.long and torch.equal(perm, perm_true)
    assert torch.allclose(M.matched_psnr(rec, truth), M.psnr(rec[perm_true], truth))
    assert M.matched_psnr(rec, truth).min() > M.psnr(rec, truth).max()
    # more reconstructions than truths, and an explicit cost matrix
    extra = torch.cat([rec, torch.rand(2, 3, 16, 20, generator=g)])
    assert torch.equal(M.match_batch(extra, truth), perm_true)
    cost = torch.ones(3, 3) - torch.eye(3)[[2, 0, 1]]  # truth i cheapest with rec [2,0,1][i]
    assert M.match_batch(torch.zeros(3, 1), torch.zeros(3, 1), cost=cost).tolist() == [2, 0, 1]


# ---------------------------------------------------------------- membership


def test_auc_and_roc_match_sklearn():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 500)
    s = y + rng.normal(0, 1.5, 500)
    s[:50] = np.round(s[:50])  # some ties
    assert M.auc(s, y) == pytest.approx(roc_auc_score(y, s))
    fpr, tpr, _ = M.roc(s, y)
    assert fpr[-1] == 1 and tpr[-1] == 1 and np.all(np.diff(fpr) >= 0)
    with pytest.raises(ValueError):
        M.auc(s, np.ones(500))


def test_tpr_at_fpr():
    y = np.array([1] * 100 + [0] * 100)
    assert M.tpr_at_fpr(np.r_[np.ones(100), np.zeros(100)], y, 0.01) == 1.0  # perfect separation
    assert M.tpr_at_fpr(np.r_[np.zeros(100), np.ones(100)], y, 0.01) == 0.0  # inverted
    # hand-made: 10 non-members, 4 members; one false positive is allowed per 0.1 of FPR
    neg = np.array([0.9, 0.8, 0.7, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0])
    pos = np.array([0.95, 0.85, 0.75, 0.45])
    s, lab = np.r_[pos, neg], np.r_[np.ones(4), np.zeros(10)]
    assert M.tpr_at_fpr(s, lab, 0.1) == 0.5  # threshold 0.85: FP {0.9}
    assert M.tpr_at_fpr(s, lab, 0.2) == 0.75  # threshold 0.75: FP {0.9, 0.8}
    assert M.tpr_at_fpr(s, lab, 0.35) == 0.75  # 0.45 would need 4 FPs
    assert M.tpr_at_fpr(s, lab, 0.4) == 1.0
    assert M.tpr_at_fpr(s, lab, 0.0) == 0.25  # 0.95 above every non-member
    # resolution rule: 10 non-members cannot resolve 5 % FPR
    assert math.isnan(M.tpr_at_fpr(s, lab, 0.05))
    assert M.resolvable(1000, 0.001) and not M.resolvable(999, 0.001) and M.resolvable(10000, 1e-4)
    # random scores: TPR ~ FPR
    rng = np.random.default_rng(2)
    yr = rng.integers(0, 2, 40000)
    t = M.tpr_at_fpr(rng.random(40000), yr, 0.1)
    assert abs(t - 0.1) < 0.02


def test_tpr_interval_covers_the_models_tpr_and_resamples_whole_models():
    """The cluster bootstrap over target models: across repeated pools from one generator, the 95% interval of TPR at
    1% FPR covers the population TPR in most pools; with a strong per-model effect (candidates of a model shift
    together) it is wider than the bootstrap that ignores models (each candidate its own group); unmeasurable
    (fewer than 100 non-members): (nan, nan)."""
    from scipy.stats import norm
    truth = 1 - norm.cdf(norm.ppf(0.99) - 1.0)            # members N(1, 1), non-members N(0, 1)
    rng, cover = np.random.default_rng(0), []
    for _ in range(40):
        y = np.tile([1, 0], 600)
        s = rng.normal(0, 1, 1200) + y
        lo, hi = M.tpr_interval(s, y, np.arange(1200) // 20, 0.01, b=300, seed=1)
        cover.append(lo <= truth <= hi)
    assert np.mean(cover) >= 0.8, np.mean(cover)
    g = np.arange(1200) // 20
    s = rng.normal(0, 1, 1200) + y + rng.normal(0, 1.5, 60)[g]
    clustered, flat = M.tpr_interval(s, y, g, 0.01, b=300), M.tpr_interval(s, y, np.arange(1200), 0.01, b=300)
    assert clustered[1] - clustered[0] > flat[1] - flat[0]
    assert all(math.isnan(v) for v in M.tpr_interval(s[:150], y[:150], g[:150], 0.01))
    # the weighted cumulative sums give what drawing the models and reading each resample's ROC gives (tied scores,
    # both tie rules)
    s = np.round(s, 1)
    for ties in ("step", "interpolate"):
        picks = np.random.default_rng(2).integers(0, 60, (50, 60))
        idx = [np.concatenate([np.flatnonzero(g == k) for k in p]) for p in picks]
        direct = [M.tpr_at_fpr(s[i], y[i], 0.01, ties) for i in idx]
        assert M.tpr_interval(s, y, g, 0.01, ties, b=50, seed=2) == pytest.approx(tuple(np.quantile(direct,
                                                                                                    [0.025, 0.975])))


def test_balanced_accuracy_and_friends():
    rng = np.random.default_rng(3)
    true = rng.integers(0, 5, 300)
    pred = np.where(rng.random(300) < 0.6, true, rng.integers(0, 5, 300))
    assert M.balanced_accuracy(pred, true) == pytest.approx(balanced_accuracy_score(true, pred))
    assert M.balanced_accuracy([0, 0, 0, 1], [0, 0, 0, 0], n_classes=3) == pytest.approx(0.75)
    assert M.balanced_accuracy([0, 1, 1, 1], [0, 1, 1, 2]) == pytest.approx((1 + 1 + 0) / 3)
    assert M.chance(4) == 0.25
    constant = M.balanced_accuracy(np.zeros(300, int), true)  # always guessing one class = chance
    assert constant == pytest.approx(M.chance(5))
    # present: pred {0,1,3}, true {0,2,3}: TP=2, FP=1, FN=1 -> F1 = 2/3
    assert M.existence_f1([2, 1, 0, 5], [1, 0, 3, 2]) == pytest.approx(2 / 3)
    assert M.existence_f1([0, 0], [0, 0]) == 1.0
    assert np.allclose(M.relative_error([110, 45], [100, 50]), [0.1, 0.1])


# ---------------------------------------------------------------- DP audits


def test_clopper_pearson_identities():
    assert M.clopper_pearson_upper(5, 5, 0.05) == 1.0
    n, a = 200, 0.05
    assert M.clopper_pearson_upper(0, n, a) == pytest.approx(1 - a ** (1 / n))  # P[Bin(n,p)=0] = a
    for k in (1, 17, 100):
        u = M.clopper_pearson_upper(k, n, a)
        assert binom.cdf(k, n, u) == pytest.approx(a, rel=1e-6)  # exact tail identity
        assert u > k / n


def test_eps_lower_bound():
    n = 1000
    assert M.eps_lower_bound(500, n, 500, n) == 0.0  # chance-level test
    assert M.eps_lower_bound(n, n, n, n) == 0.0
    ub = 1 - 0.025 ** (1 / n)  # perfect test: both bounds 1 - (α/2)^(1/n)
    assert M.eps_lower_bound(0, n, 0, n) == pytest.approx(math.log((1 - ub) / ub))
    assert M.eps_lower_bound(0, n, 0, n, delta=1e-3) == pytest.approx(math.log((1 - 1e-3 - ub) / ub))
    # asymmetric: only the second inequality binds
    fpr, fnr = M.clopper_pearson_upper(10, n, 0.025), M.clopper_pearson_upper(400, n, 0.025)
    assert M.eps_lower_bound(10, n, 400, n) == pytest.approx(math.log((1 - fnr) / fpr))
    # monotone: fewer errors -> larger bound; more trials -> larger bound
    e = [M.eps_lower_bound(k, n, k, n) for k in (300, 200, 100, 30, 5)]
    assert all(a < b for a, b in zip(e, e[1:])) and e[0] > 0
    assert M.eps_lower_bound(10, 100, 10, 100) < M.eps_lower_bound(100, 1000, 100, 1000)


def test_one_run_p_value_matches_formula():
    m, r, v, eps, delta = 200, 60, 45, 0.7, 1e-3
    q = math.exp(eps) / (1 + math.exp(eps))
    tail = sum(binom.pmf(k, r, q) for k in range(v, r + 1))
    corr = max(sum(binom.pmf(k, r, q) for k in range(v - i, v)) / i for i in range(1, v + 1))
    assert M.one_run_p_value(m, r, v, eps, delta) == pytest.approx(tail + 2 * m * delta * corr, rel=1e-9)
    assert M.one_run_p_value(m, r, v, eps, 0.0) == pytest.approx(tail, rel=1e-9)


def test_one_run_eps():
    m, r, beta = 1000, 1000, 0.05
    # all guesses right, δ = 0: P[W >= r] = q^r = β  =>  ε = logit(β^(1/r))
    q = beta ** (1 / r)
    assert M.one_run_eps(m, r, r, 0.0, beta) == pytest.approx(math.log(q / (1 - q)), abs=1e-5)
    assert M.one_run_eps(m, r, r, 0.0, beta) > 5  # non-DP-like perfect attack: large bound
    assert M.one_run_eps(m, r, r // 2, 1e-5) == 0.0  # chance
    assert M.one_run_eps(m, 100, 50, 0.0) == 0.0
    vs = [500, 540, 600, 700, 800, 900, 1000]
    e = [M.one_run_eps(m, r, v, 1e-5) for v in vs]
    assert all(a <= b for a, b in zip(e, e[1:])) and e[1] > 0 and e[0] == 0
    # δ only weakens the bound
    assert M.one_run_eps(m, r, 800, 1e-3) < M.one_run_eps(m, r, 800, 0.0)
    # the bound is a boundary: p just below β at ε_lb, not below just above it
    eps = M.one_run_eps(m, r, 800, 1e-5)
    assert M.one_run_p_value(m, r, 800, eps, 1e-5) < beta <= M.one_run_p_value(m, r, 800, eps + 1e-4, 1e-5)
    # soundness on a truly ε-DP guesser (randomized response, ε = 1): bound stays below 1
    rng = np.random.default_rng(4)
    v_dp = int((rng.random(r) < math.exp(1) / (1 + math.exp(1))).sum())
    assert M.one_run_eps(m, r, v_dp, 0.0) < 1.0


def test_device_agnostic_outputs_stay_on_input_device():
    x, y = imgs(b=2), imgs(b=2)
    for f in (M.mse, M.psnr, M.aligned_psnr, M.ssim, M.matched_psnr):
        out = f(x, y)
        assert out.device == x.device and out.shape == (2,)
    assert M.match_batch(x, y).device == x.device


# ---------------------------------------------------------------- the metric registry

def test_registry_covers_every_metric_the_scorer_writes():
    """Each metric name the scorer and the DP audit emit has one registry entry (unit, direction, range, harm)."""
    import re
    from pathlib import Path

    from fdg_audit.errors import UserError
    from fdg_audit.metrics import registry as R
    src = Path(M.__file__).parents[1]
    names = set(re.findall(r'add\("([^"]+)"', (src / "audit" / "scoring.py").read_text()))
    names |= set(re.findall(r'row\("([^"]+)"', (src / "privacy" / "audit.py").read_text()))
    names |= {f"tpr@{f:g}fpr" for f in (0.01, 0.001, 0.0)} | {f"{a}_balanced_acc" for a in ("class", "domain")}
    assert len(names) >= 18 and names <= set(R.METRICS)
    for name in names:
        m = R.info(name)
        assert m.harm in R.HARMS and m.lo < m.hi and m.label
    assert R.info("psnr").hi == M.PSNR_CAP_DB and R.harm_of("label_acc") == "class"
    assert R.stronger("n_samples_rel_error", 0.1, 0.3) and R.stronger("auc", 0.7, 0.6)
    assert not R.stronger("auc", float("nan"), 0.1)
    assert [R.card_metrics(h) for h in ("reconstruction", "class")] == [("reid",), ("label_acc", "class_balanced_acc")]
    with pytest.raises(UserError, match=r"'lpips'.*fdg_audit/metrics/registry.py"):
        R.info("lpips")


def test_an_empty_heldout_half_is_nan_for_its_run_not_an_error():
    """A held-out half can be left without items (few candidates, all on one side): that run's value is NaN and the
    estimate comes from the other runs, for every item kind."""
    from fdg_audit.metrics.stats import Items, estimate
    for kind, y in (("auc", np.array([0, 1, 0, 1])), ("mean", None), ("balanced_acc", np.array([0, 1, 0, 1]))):
        empty = Items(kind, np.array([]), None if y is None else np.array([], int), np.array([], np.int64))
        full = Items(kind, np.array([0.1, 0.9, 0.3, 0.8]) if kind == "auc" else np.array([1.0, 0.0, 1.0, 1.0]), y,
                     np.arange(4))
        m, lo, hi = estimate([empty, full])
        assert np.isfinite(m) and m == full.stat()
