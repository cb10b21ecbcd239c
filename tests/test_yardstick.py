"""One yardstick for every reconstruction (fdg_audit.audit.scoring.score_reconstruction): re-identification's calibration,
the same number for the same image pair whatever produced it, and seeds that draw their own data."""
import numpy as np
import pytest
import torch

from conftest import tiny_scenario
from fdg_audit import metrics as M
from fdg_audit.api.attack import Aux, Reconstruction
from fdg_audit.data import DataConfig, load_data
from fdg_audit.scenario import load_raw, plan
from fdg_audit.audit import scoring
from fdg_audit.audit.scoring import N_DISTRACTORS, RENDERED_ID, Truth, score_reconstruction


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    data = load_data(DataConfig(dataset="mnist", family="rotated", domains=["rot0", "rot15", "rot30"],
                                per_domain=500, split_seed=3))
    return Truth(tmp_path_factory.mktemp("t"), "r", data)


def _aux(truth):
    return Aux(num_classes=10, domains=["rot0", "rot15"])   # rot30 held out: the attacker's public domain


def _row(rows, metric):
    return next(r for r in rows if r["metric"] == metric)


def test_reid_calibration_noisy_copy_at_22db_is_found_and_the_mean_image_is_not(truth):
    """A true image plus noise at about 22 dB PSNR picks itself out of 1 + 99 same-domain candidates (same class
    first); the public mean image does not (it sits at chance, 1 %)."""
    d = truth.data.domain("rot0")
    rows = np.arange(40)
    x = d.train.x[rows]
    g = torch.Generator().manual_seed(0)
    # noise that stays in [0, 1] (every pixel moves toward the other end), scaled per image to 22 dB exactly
    e = (1 - 2 * x) * torch.randn(x.shape, generator=g).abs()
    e = e * (10 ** (-22 / 10) / M.mse(e, torch.zeros_like(e))).sqrt().view(-1, 1, 1, 1)
    noisy = x + e
    assert float(noisy.min()) >= 0 and float(noisy.max()) <= 1
    assert torch.allclose(M.psnr(noisy, x), torch.full((len(x),), 22.0), atol=1e-3)
    out = Reconstruction("rot0", "weights", 1, noisy, rows=rows)
    truth.record = lambda v, n: {"idx": d.train.idx}   # the victim's record: its training images
    got, _ = score_reconstruction(out, truth, {}, _aux(truth))
    reid = _row(got, "reid")
    assert reid["value"] >= 0.95 and reid["baseline"] == pytest.approx(1 / (1 + N_DISTRACTORS))
    assert reid["n_distractors"] == N_DISTRACTORS
    mean = truth.public_images(["rot0", "rot15"])[0].mean(0, keepdim=True).expand_as(x).contiguous()
    got_m, _ = score_reconstruction(Reconstruction("rot0", "weights", 1, mean, rows=rows), truth, {}, _aux(truth))
    assert _row(got_m, "reid")["value"] <= 0.1
    # the mean image is one of the baselines: its PSNR is the baseline's (the flat image may be better)
    assert _row(got_m, "psnr")["value"] <= _row(got_m, "psnr")["baseline"] + 1e-6


def test_a_dim_copy_is_the_victims_image_and_a_blank_is_nobodys(truth):
    """Re-identification asks "is this the victim's image?", not "is it as bright": a copy of each true image at 35%
    of its contrast picks itself out of 1 + 99 candidates (plain MSE prefers a faint distractor: 0.10 of them
    here), and so does a recoloured copy; a constant image never does."""
    d = truth.data.domain("rot0")
    rows = np.arange(40)
    x = d.train.x[rows]
    dis, _, _ = truth.distractors(d.train.idx[rows], d.train.y[rows].numpy(), ["rot0"] * 40, d.train.idx, N_DISTRACTORS)
    assert M.reidentified(0.35 * x, x, dis).float().mean() >= 0.95
    B, D = dis.shape[:2]
    cand = torch.cat([x[:, None], dis], 1).flatten(0, 1)
    r = (0.35 * x)[:, None].expand(B, D + 1, *x.shape[1:]).reshape(cand.shape)
    plain = M.mse(M.aligned(r, cand), cand).view(B, D + 1)
    assert (plain[:, 0] < plain[:, 1:].amin(1)).float().mean() <= 0.5    # what the unstandardised rule scored
    rgb, drgb = x.expand(-1, 3, -1, -1), dis.expand(-1, -1, 3, -1, -1)
    tint = rgb * torch.tensor([0.9, 0.3, 0.6]).view(1, 3, 1, 1) + torch.tensor([0.0, 0.5, 0.2]).view(1, 3, 1, 1)
    assert M.reidentified(tint, rgb, drgb).float().mean() >= 0.95
    assert not M.reidentified(torch.full_like(x, 0.4), x, dis).any()


def test_distractors_are_of_the_victims_domain_not_held_by_it_and_same_class_first(truth):
    """A victim holding its whole domain's training split leaves 100 free images of it (its val split): the pool is
    topped up with images rendered by the domain's recipe from digits no domain of the run uses, so every image
    meets 99 distractors of its own class, none of which the victim held."""
    d = truth.data.domain("rot15")
    idx, y = d.train.idx[:5], d.train.y[:5].numpy()
    held = d.train.idx
    dis, n, same = truth.distractors(idx, y, ["rot15"] * 5, held, 99)
    assert dis.shape[:2] == (5, 99) and (n == 99).all() and (same == 99).all()
    px, py, pids = truth.pool["rot15"]
    ex, ey, eids = truth.extra["rot15"]
    free = ~np.isin(pids, held)
    assert int((py[free].numpy() == y[0]).sum()) < 99              # the run's own free images are too few
    used = np.concatenate([np.concatenate([c.train.idx, c.val.idx]) for c in truth.data.domains])
    assert not np.isin((np.asarray(eids) - RENDERED_ID) % 5000, used).any()   # digits no domain of the run uses
    cand_x, cand_y = torch.cat([px[free], ex]), torch.cat([py[free], ey])
    flat = cand_x.flatten(1)
    for b in range(5):
        pos = torch.cdist(dis[b].flatten(1), flat).argmin(1)
        assert torch.allclose(flat[pos], dis[b].flatten(1))          # each one is a free or rendered image ...
        assert (cand_y[pos].numpy() == y[b]).all()                   # ... of the victim's class
    # the rendered images are of the domain: rotated by its angle (the digit's mass sits where rot15's does)
    assert torch.allclose(ex.mean(0), px.mean(0), atol=0.08)


def test_one_scorer_same_pair_same_number_whatever_the_attack(truth):
    """The same images against the same truth score the same, whatever the channel, attack flags or variant: the
    old per-attack `aligned` and baseline switches no longer change the yardstick."""
    d = truth.data.domain("rot0")
    rows = np.arange(8)
    img = torch.roll(d.train.x[rows], (3, -2), (-2, -1)) * 0.9   # a shifted, dimmed copy
    outs = [Reconstruction("rot0", "amplitude_bank", 0, img, rows=rows, aligned=True, variant="box"),
            Reconstruction("rot0", "weights", 1, img, rows=rows, aligned=False, flat_baseline=True),
            Reconstruction("rot0", "weights", 1, img.flip(0), rows=None)]   # unordered: matched to the truth
    truth.record = lambda v, n: {"idx": d.train.idx[rows]}
    scored = [{r["metric"]: (r["value"], r["baseline"]) for r in score_reconstruction(o, truth, {}, _aux(truth))[0]}
              for o in outs]
    for m in ("reid", "psnr", "ssim", "success@20dB", "success@25dB"):
        assert scored[0][m] == pytest.approx(scored[1][m]), m
        assert scored[0][m][0] == pytest.approx(scored[2][m][0]), m
        if m != "reid":   # unordered images matched among 8: re-identification's chance is the matched one
            assert scored[0][m][1] == pytest.approx(scored[2][m][1]), m
    assert scored[2]["reid"][1] >= scored[0]["reid"][1]
    assert scored[0]["psnr"][0] > scored[0]["psnr_plain"][0] + 5   # aligned vs as returned: the shift is undone


def test_unordered_guesses_matched_among_many_images_hit_at_their_baseline_not_at_one_in_a_hundred(truth):
    """Free guesses (images of the victim's domain that nobody holds, and no candidate) returned as an unordered
    reconstruction of a 64-image victim: the matching lets each pick its nearest true image, so they are
    re-identified far more often than 1/100, and the baseline (the same matching on other free guesses and on
    noise, the higher) covers them."""
    x0, y0, ids0 = truth.pool["rot0"]
    by_idx, record = truth.by_idx, truth.record
    rng = np.random.default_rng(1)
    hits, bases = [], []
    try:
        for _ in range(16):
            perm = rng.permutation(len(ids0))
            own, guess = ids0[perm[:64]], perm[64:68]
            keep = np.setdiff1d(np.arange(len(ids0)), guess)
            truth.pool["rot0"] = (x0[keep], y0[keep], ids0[keep])     # the guesses are no candidate
            truth.by_idx = {int(g): ("pool", n, i) for n, (_, _, ii) in truth.pool.items() for i, g in enumerate(ii)}
            truth.record = lambda v, n, own=own: {"idx": own}
            got, _ = score_reconstruction(Reconstruction("rot0", "weights", 1, x0[guess], rows=None), truth, {},
                                          _aux(truth))
            hits.append(_row(got, "reid")["value"])
            bases.append(_row(got, "reid")["baseline"])
    finally:
        truth.pool["rot0"], truth.by_idx, truth.record = (x0, y0, ids0), by_idx, record
    assert np.mean(bases) > 0.08 and np.mean(hits) > 0.05       # far above 1/100
    assert np.mean(hits) < np.mean(bases) + 0.12                # 64 guesses: about 3 standard errors


def test_noise_matched_among_a_whole_domain_is_at_its_baseline_and_a_copy_is_above(truth):
    """Four images of uniform noise returned as an unordered reconstruction of a 240-image victim (a whole-domain
    client): matched on the re-identification distance, each takes the best of 240 true images against the 99
    distractors of that image's class, so noise is "re-identified" far above 1/100. The baseline's chance sends
    noise through the same matching, so it says so (the textured outputs of a failed update inversion scored 0.50
    against a real-image chance of 0.27 before); noisy copies of the victim's images stay re-identified."""
    d = truth.data.domain("rot0")
    own = d.train.idx[:240]
    record = truth.record
    g = torch.Generator().manual_seed(5)
    hits, bases = [], []
    try:
        truth.record = lambda v, n: {"idx": own}
        for _ in range(6):
            got, _ = score_reconstruction(Reconstruction("rot0", "weights", 1, torch.rand(4, 1, 28, 28, generator=g),
                                                         rows=None), truth, {}, _aux(truth))
            hits.append(_row(got, "reid")["value"])
            bases.append(_row(got, "reid")["baseline"])
        copies = (d.train.x[torch.randperm(240, generator=g)[:4]] + 0.1 * torch.randn(4, 1, 28, 28, generator=g))
        got, _ = score_reconstruction(Reconstruction("rot0", "weights", 1, copies.clamp(0, 1), rows=None), truth, {},
                                      _aux(truth))
    finally:
        truth.record = record
    assert np.mean(bases) >= 0.4 and np.mean(hits) >= 0.3            # the best of 240: far above 1/100
    assert np.mean(hits) <= np.mean(bases) + 0.2                      # 24 noise images: about 2 standard errors
    assert _row(got, "reid")["value"] == 1.0 and _row(got, "reid")["baseline"] < 1.0


def test_two_seeds_of_one_folder_draw_different_victims_and_methods_share_them(tmp_path):
    f = tmp_path / "s.toml"
    draw = dict(name="draw", seeds=[0, 1], threads=None, report=None, model=None, train=None, data=None,
                datasets=[dict(label="small", dataset="mnist", family="rotated", domains=["rot0", "rot75"],
                               per_domain=200, client_sizes=[1, 4], targets=["rot75"], split_seed=11)],
                methods=[dict(name="fedavg"), dict(name="csac")])
    f.write_text(tiny_scenario(draw))
    runs = plan(load_raw(str(f)))
    held = {(r["method"].name, r["seed"]): [c.train.idx.tolist() for c in r["data"].clients("rot0")] for r in runs}
    assert held[("fedavg", 0)] != held[("fedavg", 1)]   # each seed its own victims
    assert held[("fedavg", 0)] == held[("csac", 0)]     # paired by seed across methods
    assert {r["ds"].draw for r in runs} == {0, 1}
    # the run's DataConfig rebuilds the same data (what the scorer and the harness load from the folder)
    r = runs[0]
    again = load_data(r["ds"]).clients("rot0")
    assert [c.train.idx.tolist() for c in again] == held[("fedavg", 0)]
    # seeds_draw_data = false: one split for every seed
    f.write_text(tiny_scenario(draw, seeds_draw_data=False))
    runs = plan(load_raw(str(f)))
    same = [[c.train.idx.tolist() for c in r["data"].clients("rot0")] for r in runs]
    assert all(s == same[0] for s in same)


def test_score_dispatches_on_the_output_class_through_one_table(monkeypatch):
    """``score`` looks the output's class (or its nearest base class) up in ``SCORERS``: a new output type is one
    entry there, a subclass of an output is scored as its base, and an unknown type names the types it takes."""
    from dataclasses import dataclass

    from fdg_audit.audit import scoring
    from fdg_audit.api.attack import Scores

    @dataclass
    class Count:
        victim: str
        value: float

    class MyScores(Scores):
        pass

    monkeypatch.setitem(scoring.SCORERS, Count, lambda out, truth, members, aux: (
        [dict(metric="count", value=out.value, baseline=0.0)], None))
    assert scoring.score(Count("v", 3.0), None, {}, None) == ([dict(metric="count", value=3.0, baseline=0.0)], None)
    m = np.r_[np.ones(10), np.zeros(10)]
    mine = scoring.score(MyScores("v", "weights", 1, m.copy()), None, {"v": m}, Aux())[0]
    base = scoring.score(Scores("v", "weights", 1, m.copy()), None, {"v": m}, Aux())[0]
    np.testing.assert_equal([(r["metric"], r["value"]) for r in mine], [(r["metric"], r["value"]) for r in base])
    assert base[0]["metric"] == "auc" and base[0]["value"] == 1.0
    with pytest.raises(TypeError, match="Reconstruction, Scores, Predictions, Estimate, Audit, Count"):
        scoring.score("junk", None, {}, None)


def test_free_guess_is_scored_like_the_attack_and_is_the_reid_baseline(truth):
    """The weights' free guess is the public class mean of the inferred label: sent as an attack's output it scores
    exactly its own baseline (the same matching, distractors and rule), and the reid baseline is never below
    chance. Four outputs for a one-image victim get the matched chance of 4 guesses (not 1/(1 + D))."""
    d = truth.data.domain("rot0")
    px, py = truth.public_images(["rot0", "rot15"])
    record = truth.record
    try:
        for i in range(6):
            truth.record = lambda v, n, i=i: {"idx": d.train.idx[i:i + 1]}
            c = int(d.train.y[i])
            mean = px[py == c].mean(0, keepdim=True)
            got, _ = score_reconstruction(Reconstruction("rot0", "weights", 1, mean, labels=[c]), truth, {},
                                          _aux(truth))
            reid, free = _row(got, "reid"), _row(got, "reid_free")
            assert reid["free_guess"] == scoring.GUESS_CLASS_MEAN
            assert reid["value"] == free["value"]                       # the guess itself scores its baseline
            assert reid["baseline"] == max(reid["chance"], free["value"])
            assert reid["chance"] == pytest.approx(1 / (1 + N_DISTRACTORS)) and reid["n_same_class"] == N_DISTRACTORS
        four = torch.rand(4, *d.train.x.shape[1:], generator=torch.Generator().manual_seed(0))
        got, _ = score_reconstruction(Reconstruction("rot0", "weights", 1, four, labels=[0, 1, 2, 3]), truth, {},
                                      _aux(truth))
        assert _row(got, "reid")["chance"] > 1.5 / (1 + N_DISTRACTORS)    # best of 4 guesses for one image
    finally:
        truth.record = record


def test_bank_free_guess_is_the_true_amplitude_and_noise_with_its_spectrum_is_not_legible(truth):
    """A bank output's free guesses keep the true amplitude (random phase; a public class mean's phase): the
    stronger is named and is the reid baseline; with a random phase the image correlates little with its true
    image (textured noise with its spectrum), so it is not legible, while a dimmed shifted copy of the true image
    is. (On empty-background digits a class mean's phase can give a legible guess: that is what it is for.)"""
    from fdg_audit import records
    d = truth.data.domain("rot0")
    rows = np.arange(12)
    x = d.train.x[rows]
    record = truth.record
    try:
        truth.record = lambda v, n: {"idx": d.train.idx}
        pub = truth.public_images(["rot0", "rot15"])
        out = Reconstruction("rot0", "amplitude_bank", 0, torch.roll(x, (2, 1), (-2, -1)) * 0.7, truth=records.AMP,
                             rows=rows, aligned=True)
        got, _ = score_reconstruction(out, truth, {}, _aux(truth))
        reid, leg, free = _row(got, "reid"), _row(got, "legible"), _row(got, "reid_free")
        assert reid["free_guess"] in (scoring.GUESS_RANDOM_PHASE, scoring.GUESS_MEAN_PHASE)
        assert reid["value"] == 1.0 and leg["value"] == 1.0
        assert reid["baseline"] == max(reid["chance"], free["value"])
        guesses = scoring.free_guesses(out, x, pub, 10, d.train.idx[rows])
        assert all(g.shape == x.shape for g in guesses.values())
        rnd = guesses[scoring.GUESS_RANDOM_PHASE]   # the amplitude is the true one (up to the [0, 1] clamp) ...
        assert float(M.aligned_corr(rnd, x).mean()) < 0.5                  # ... the image is not legible
        amp_err = (torch.fft.fft2(rnd).abs() - torch.fft.fft2(x).abs()).abs().mean() / torch.fft.fft2(x).abs().mean()
        assert float(amp_err) < 0.5
        got, _ = score_reconstruction(Reconstruction("rot0", "amplitude_bank", 0, rnd, truth=records.AMP, rows=rows,
                                                     aligned=True), truth, {}, _aux(truth))
        assert _row(got, "legible")["value"] <= 0.25   # rarely: a sparse digit's blob can correlate
    finally:
        truth.record = record
