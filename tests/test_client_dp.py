"""Client-level DP (DP-FedAvg) for every method: clipped updates, noise of the configured scale, accounting, audit."""
import csv
import math

import numpy as np
import pytest
import torch

from conftest import leakage_rows, tiny_scenario
from fdg_audit.errors import UserError
from fdg_audit.store.ledger import Ledger
from fdg_audit.protocol import load_method
from fdg_audit.privacy import epsilon, new_accountant
from fdg_audit.privacy.client_dp import UPDATE_KINDS, calibrate, noise

METHODS = ["fedavg", "feddg", "csac", "ccst", "fpl", "fedadg", "copa", "fedsr", "fedga"]
CLIP, SIGMA = 0.05, 0.7
# the shared tiny scenario on four rotated-digit domains of 24 images, two rounds of one local step, RDP accounting
BASE = dict(seeds=[0], data=dict(domains=["rot0", "rot15", "rot30", "rot45"], per_domain=24),
            train=dict(rounds=2, local_steps=1, batch_size=8, lr=0.1), privacy=dict(accountant="rdp"), methods=None)


def base(client: dict, *layers, **overrides) -> str:
    """BASE with client-level DP set by ``client`` (the [privacy.client] table)."""
    return tiny_scenario(BASE, dict(privacy=dict(accountant="rdp", client=client)), *layers, **overrides)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def updates(root):
    """Per run: (envelope, upload arrays, what the sender last received) for every client upload of an update kind."""
    led, out, received = Ledger.open(root), [], {}
    for e in led.envelopes:
        arrays = led.payload(e).arrays
        if e.sender == "server":
            received.setdefault((e.run, e.receiver), {}).update(arrays)
        elif e.kind in UPDATE_KINDS:
            out.append((e, arrays, dict(received.get((e.run, e.sender), {}))))
    return out


def test_every_method_uploads_clipped_updates_plus_noise_of_the_configured_scale(run_toml):
    text = base(dict(clip=CLIP, noise_multiplier=SIGMA),
                methods=[dict(name=m, **(dict(acquire_epochs=1) if m == "csac" else {})) for m in METHODS])
    root = run_toml(text)
    ups, count, norms = updates(root), {}, {m: [] for m in METHODS}
    for e, arrays, received in ups:
        n = count[(e.run, e.sender, e.round, e.kind)] = count.get((e.run, e.sender, e.round, e.kind), -1) + 1
        ev = [f for f in e.filters if f["mechanism"] == "client_dp"]
        assert len(ev) == 1 and ev[0]["mode"] == "local" and ev[0]["clip"] == CLIP
        floats = {k: v.double() for k, v in arrays.items() if v.is_floating_point()}
        ref = {k: received.get(k, received.get(f"{e.sender}/{k}")) for k in floats}
        upd = torch.cat([(v - (0 if ref[k] is None else ref[k].double())).flatten() for k, v in floats.items()])
        z = noise(e.run, e.sender, e.round, e.kind, n, len(upd)) * SIGMA * CLIP   # the filter's seeded noise
        clipped = upd - z
        norms[e.method].append(clipped.norm().item())
        assert clipped.norm() <= CLIP * 1.01, (e.method, e.kind, clipped.norm())   # the update was clipped to C
        assert upd.std().item() == pytest.approx(SIGMA * CLIP, rel=0.1)          # and carries sigma * C noise
        for k, v in arrays.items():   # non-float arrays go out as received
            if not v.is_floating_point() and ref.get(k) is not None:
                assert torch.equal(v, ref[k])
    assert set(norms) == set(METHODS) and all(norms.values())
    for m, ns in norms.items():      # updates are large here: clipping is active (norm = C) for every method
        assert max(ns) == pytest.approx(CLIP, rel=0.01), m
    rows = [r for r in read_csv(root / "privacy.csv") if r["mechanism"] == "client_dp"]
    assert {r["run"].split("/")[1] for r in rows} == set(METHODS)
    assert all(r["adjacency"].startswith("one client") for r in rows)


def test_client_accountant_equals_a_standalone_opacus_accountant(run_toml):
    text = base(dict(clip=1.0, noise_multiplier=SIGMA), train=dict(rounds=3),
                methods=[dict(name="fedavg"), dict(name="copa")])
    rows = read_csv(run_toml(text) / "privacy.csv")
    from opacus.accountants import RDPAccountant
    for method, per_round in (("fedavg", 1), ("copa", 2)):      # COPA releases trunk and head every round
        mine = [r for r in rows if f"/{method}/" in r["run"] and r["party"] == "rot15" and r["adversary"] == "server"]
        assert [int(r["round"]) for r in mine] == [1, 2, 3]
        for r in mine:
            acc = RDPAccountant()
            for _ in range(int(r["round"]) * per_round):
                acc.step(noise_multiplier=SIGMA, sample_rate=1.0)
            assert float(r["epsilon"]) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)


def test_target_epsilon_calibrates_sigma_with_opacus(run_toml):
    text = base(dict(clip=1.0, target_epsilon=4.0), methods=[dict(name="csac", acquire_epochs=1)])
    rows = [r for r in read_csv(run_toml(text) / "privacy.csv") if r["round"] == "2" and r["adversary"] == "server"]
    sigma = calibrate(4.0, 1e-5, 1.0, 3, "rdp")
    assert rows and all(float(r["noise_multiplier"]) == pytest.approx(sigma) for r in rows)
    assert all(float(r["epsilon"]) == pytest.approx(4.0, abs=0.05) for r in rows)   # acquisition + 2 rounds


def test_central_mode_noise_and_refusal(run_toml):
    """Each upload carries sigma C / sqrt(K); CSAC's fusion is no uniform mean and is refused."""
    central = dict(clip=0.05, noise_multiplier=0.7, mode="central")
    with pytest.raises(UserError, match="uniform mean"):
        run_toml(base(central, methods=[dict(name="csac")]), name="a")
    root = run_toml(base(central, methods=[dict(name="fedavg", weighting="uniform")]), name="b")
    for e, arrays, received in updates(root):
        upd = torch.cat([(v.double() - received[k].double()).flatten() for k, v in arrays.items()])
        assert e.filters[0]["mode"] == "central"
        assert upd.std().item() == pytest.approx(0.7 * 0.05 / math.sqrt(3), rel=0.1)   # sigma C / sqrt(K), K = 3


# ten clients (5 source domains x 2), no learning, central client-level DP at sigma 0.7, C 0.05
def central_ten(*methods: dict, **client) -> str:
    """The shared tiny scenario with ten clients, no learning and central client-level DP at sigma 0.7, C 0.05
    (``client``: more keys of the [privacy.client] table), running ``methods``."""
    return tiny_scenario(
        seeds=[0], data=dict(domains=["rot0", "rot15", "rot30", "rot45", "rot60", "rot75"], per_domain=10,
                             clients_per_domain=2),
        train=dict(rounds=3, local_steps=1, batch_size=4, lr=1e-12, weight_decay=0.0),
        privacy=dict(client=dict(clip=0.05, noise_multiplier=0.7, mode="central", **client)), methods=list(methods))


@pytest.mark.parametrize("f", [0.3, 0.5, 1.0])
def test_central_aggregate_carries_the_configured_multiplier_at_any_participation(run_toml, f):
    """Ten clients, no learning (lr 1e-12: every update is about 1e-12), so the change of the global model between two
    broadcasts is the aggregate's noise alone. Divided by the mean's sensitivity C / m (m = round(f K) clients asked),
    its standard deviation is the aggregate's noise multiplier: sigma at every f (sigma sqrt(f) before, when each
    client added sigma C / sqrt(K) for all K = 10)."""
    root = run_toml(central_ten(dict(name="fedavg", weighting="uniform", participation=f)), name=f"f{f}")
    led = Ledger.open(root)
    glob = {}
    for e in led.select(kind="weights", sender="server"):
        glob.setdefault(e.round, led.payload(e).arrays)
    m = max(1, round(f * 10))
    mult = []
    for t in sorted(glob)[1:-1]:
        if t + 1 in glob:
            d = torch.cat([(glob[t + 1][k].double() - glob[t][k].double()).flatten() for k in glob[t]
                           if glob[t][k].is_floating_point()])
            mult.append(d.std().item() / (0.05 / m))
    assert mult and all(x == pytest.approx(0.7, rel=0.05) for x in mult), mult
    # accounting at q = 1 over the rounds each client released in; per adversary: the aggregate (clients) at sigma,
    # each upload (server without secure aggregation, eavesdropper) at sigma / sqrt(m)
    from opacus.accountants import create_accountant
    last = {}
    for r in read_csv(root / "privacy.csv"):
        last[(r["party"], r["adversary"])] = r
    parties = {p for p, _ in last}
    assert parties == {e.sender for e in led.select(kind="weights") if e.sender != "server"}
    for p in parties:
        released = {e.round for e in led.select(kind="weights", sender=p)}
        for adv, s in (("server", m ** -0.5), ("client", 1.0), ("eavesdropper", m ** -0.5)):
            r = last[(p, adv)]
            assert int(r["steps"]) == len(released) and float(r["sample_rate"]) == 1.0
            acc = create_accountant(r["accountant"])
            for _ in released:
                acc.step(noise_multiplier=0.7 * s, sample_rate=1.0)
            assert float(r["epsilon"]) == pytest.approx(acc.get_epsilon(float(r["delta"])), rel=1e-6)
            assert (r["headline"] == "True") == (adv == "client")


def test_accountant_matches_google_pld_over_gappy_releases():
    """The client-level accountant (Opacus PRV) against Google's dp-accounting PLD accountant for the same releases:
    rounds 0, 2, 3 and 7 (gaps cost nothing: q = 1 against the server that samples), two releases in round 3 (one
    step at sigma / sqrt 2), local mode with a mean-taking server: the curious client reads the mean of K = 5."""
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import PLDAccountant
    from fdg_audit.privacy.client_dp import ClientDP, ClientDPFilter, check, plan_check
    sigma, delta = 1.3, 1e-5
    c = check(ClientDP(clip=1.0, noise_multiplier=sigma), "privacy.client")
    plan_check(c, load_method("fedavg"), load_method("fedavg").Params(rounds=8, participation=0.5, weighting="uniform"),
               10, delta, "prv", "privacy.client")
    f = ClientDPFilter(c, delta, "prv")
    for rnd in (0, 2, 3, 3, 7):
        _, _, ev = f("weights", {"w": torch.ones(20)}, {}, dict(run="r", round=rnd, sender="c0"))
    for adv, s in (("server", 1.0), ("client", 5 ** 0.5)):
        pld = PLDAccountant()
        pld.compose(dp_accounting.GaussianDpEvent(sigma * s), count=3)
        pld.compose(dp_accounting.GaussianDpEvent(sigma * s / 2 ** 0.5), count=1)
        assert ev["epsilon_by"][adv] == pytest.approx(pld.get_epsilon(delta), rel=0.02), adv
    assert ev["steps"] == 4 and ev["sample_rate"] == 1.0


def test_same_ledger_in_both_engines_with_client_dp(run_toml):
    text = tiny_scenario(BASE, data=dict(domains=["rot0", "rot15", "rot30"]),    # two client processes are enough
                         privacy=dict(accountant="rdp", client=dict(clip=0.05, noise_multiplier=0.7),
                                      artifacts=dict(n_samples=dict(rows="count", clip=1.0, noise_multiplier=3.0))),
                         methods=[dict(name="fedavg")])
    a, b = run_toml(text, name="a"), run_toml(text, 'engine="process"', name="b")
    assert [e.sha256 for e in Ledger.open(a).envelopes] == [e.sha256 for e in Ledger.open(b).envelopes]
    led = Ledger.open(a)
    counts = [led.payload(e).scalars["n"] for e in led.select(kind="n_samples")]
    assert counts and all(isinstance(n, int) and n >= 1 for n in counts) and len(set(counts)) > 1   # noised
    rows = read_csv(a / "privacy.csv")
    assert {r["adjacency"] for r in rows if r["mechanism"] == "gaussian_rows:n_samples"} == \
        {"one example (add/remove: the count moves by 1)"}
    total = [r for r in rows if r["mechanism"] == "total" and r["party"] == "rot15" and r["round"] == "2"
             and r["adversary"] == "server"]
    acc = new_accountant("rdp")
    acc.history = [(3.0, 1.0, 1), (0.35, 1.0, 2)]     # the count, and client_dp at sigma / 2 (example level)
    assert len(total) == 1 and float(total[0]["epsilon"]) == pytest.approx(epsilon(acc, 1e-5), rel=1e-6)


def audit(seed: int, sigma: float, rounds: int = 1, **mode) -> str:
    """BASE on 16 images per domain: FedAvg (a uniform mean when ``mode`` is given, e.g. central) at clip 0.5 and
    ``sigma``, 256 update canaries per client and the client-level audit."""
    return tiny_scenario(BASE, seeds=[seed], data=dict(per_domain=16), train=dict(rounds=rounds),
                         privacy=dict(accountant="rdp", client=dict(clip=0.5, noise_multiplier=sigma, **mode),
                                      audit=dict(update_canaries=256)),
                         methods=[dict(name="fedavg", **(dict(weighting="uniform") if mode else {}))],
                         attacks=[dict(name="dp_audit_client", canaries=256)])


def test_client_audit_bound_below_accountant_and_positive_without_noise(run_toml):
    from conftest import leakage_rows
    for seed in (0, 1, 2):
        root = run_toml(audit(seed, 1.0), name=f"s{seed}")
        lb = leakage_rows(root, metric="eps_lb_one_run")
        theory = leakage_rows(root, metric="eps_theory")
        assert len(lb) == 3 and len(theory) == 3
        for a, t in zip(lb, theory):
            assert 0.0 <= float(a["value"]) <= float(t["value"]) < math.inf
    root = run_toml(audit(0, 0.0), name="clean")
    lb = [float(r["value"]) for r in leakage_rows(root, metric="eps_lb_one_run")]
    assert len(lb) == 3 and min(lb) > 2.0                    # every canary found: the one-run maximum for 256
    assert all(math.isinf(float(r["value"])) for r in leakage_rows(root, metric="eps_theory"))
    member = np.load(root / "truth" / "rotated/fedavg/rot0/s0" / "rot15" / "update_canaries.npz")["member"]
    assert len(member) == 256 and 90 < member.sum() < 166


def test_central_audit_reads_the_broadcast_aggregate(run_toml):
    """Central mode: the audit scores the global model's change between broadcasts (rounds - 1 releases)."""
    from conftest import leakage_rows
    for sigma, check in ((0.0, lambda lb, t: lb > 2.0 and math.isinf(t)), (1.0, lambda lb, t: 0.0 <= lb <= t)):
        root = run_toml(audit(0, sigma, rounds=3, mode="central"), name=f"c{sigma}")
        lb = leakage_rows(root, metric="eps_lb_one_run")
        theory = leakage_rows(root, metric="eps_theory")
        assert len(lb) == 3 and {r["output"] for r in lb} == {"aggregate"}
        assert all(check(float(a["value"]), float(t["value"])) for a, t in zip(lb, theory))


REFUSING = ["csac", "ccst", "fpl", "fedsr", "copa", "fedga", "fedadg"]


@pytest.mark.parametrize("method", METHODS)
def test_dp_sgd_refused_at_plan_time_naming_client_level_dp(method):
    """plan() (no training) refuses dp_sgd for every method without a per-example objective, in one line."""
    import tomllib

    from fdg_audit.scenario import plan
    raw = tomllib.loads(tiny_scenario(BASE, methods=[dict(name=method)]))
    raw["datasets"] = [raw.pop("data")]
    raw["privacy"]["dp_sgd"] = True
    if method not in REFUSING:
        assert len(plan(raw)) == 1
        return
    with pytest.raises(UserError) as e:
        plan(raw)
    msg = str(e.value)
    assert "\n" not in msg and f"method {method!r}" in msg and "use client-level DP instead" in msg


def adaptive_filter(sigma, clip=0.1, mode="local", k=50, **adaptive):
    from fdg_audit.protocol import load_method
    from fdg_audit.privacy.client_dp import ClientDP, ClientDPFilter, check, plan_check

    class P:
        rounds, participation, weighting = 40, 1.0, "uniform"

    c = check(ClientDP(clip=clip, noise_multiplier=sigma, mode=mode, adaptive=dict(adaptive)), "privacy.client")
    plan_check(c, load_method("fedavg"), P, k, 1e-5, "rdp", "privacy.client")
    return ClientDPFilter(c, 1e-5, "rdp")


def test_adaptive_clip_converges_to_the_target_quantile_of_update_norms():
    """Synthetic updates (log-normal norms, 50 clients a round): C_t moves geometrically to the gamma-quantile.
    Central mode: the count's noise sigma_b = K / 20 (the paper's default) is on the sum, 0.05 on the share."""
    f = adaptive_filter(1.0, clip=0.2, mode="central", target_quantile=0.3, lr=0.5)
    g = torch.Generator().manual_seed(0)
    norms = torch.exp(torch.randn(50, generator=g) * 0.5)            # fixed clients, quantiles known exactly
    clips = []
    for rnd in range(1, 41):
        for i, r in enumerate(norms):
            d = torch.randn(20, generator=g, dtype=torch.float64)
            f("weights", {"w": (d / d.norm() * r).float()}, {}, dict(run="r", round=rnd, sender=f"c{i}"))
        clips.append(f.clips["r"][1])
    assert clips[0] == 0.2 and clips[1] == pytest.approx(0.2 * math.exp(0.5 * 0.3), rel=0.05)   # geometric step
    q = torch.quantile(norms, 0.3).item()
    share = [(norms <= c).float().mean().item() for c in clips[-10:]]
    assert abs(sum(share) / 10 - 0.3) < 0.12, share                 # clipped share hovers at the target
    assert 0.6 * q < sum(clips[-10:]) / 10 < 1.6 * q


def test_adaptive_clip_noise_split_and_accountant_at_the_effective_sigma():
    """The update carries sigma_Delta C_t with (sigma_Delta^-2 + (2 sigma_b)^-2)^-1/2 = sigma, and the accountant's
    epsilon equals Opacus' at sigma (the pair is one Gaussian mechanism)."""
    from opacus.accountants import RDPAccountant

    from fdg_audit.privacy.client_dp import split_noise
    f = adaptive_filter(1.2, clip=0.5, k=40, bit_noise=2.0)
    sd = split_noise(1.2, 2 * 2.0)
    assert (sd ** -2 + 4.0 ** -2) ** -0.5 == pytest.approx(1.2) and sd > 1.2
    for rnd in (1, 2, 3):
        w = torch.full((4000,), 10.0)                              # norm 632 >> C: clipped
        out, _, ev = f("weights", {"w": w}, {}, dict(run="r", round=rnd, sender="c0"))
        clip = ev["clip"]
        resid = out["w"].double() - w.double() * clip / w.double().norm()
        assert resid.std().item() == pytest.approx(sd * clip, rel=0.05)
        assert ev["update_noise_multiplier"] == pytest.approx(sd) and ev["bit_noise"] == 2.0
        acc = RDPAccountant()
        for _ in range(rnd):
            acc.step(noise_multiplier=1.2, sample_rate=1.0)
        assert ev["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    with pytest.raises(UserError, match="bit_noise"):
        adaptive_filter(6.0, k=40, bit_noise=2.0)                  # 2 sigma_b <= sigma: no budget left for the update
    with pytest.raises(UserError, match="engine"):
        from fdg_audit.privacy.client_dp import ClientDP, check, plan_check
        plan_check(check(ClientDP(adaptive={"lr": 0.2}), "p"), load_method("fedavg"),
                   load_method("fedavg").Params(rounds=2), 3, 1e-5, "rdp", "p", engine="process")




def test_csac_dp_fusion_under_central_dp_carries_at_least_the_configured_multiplier(run_toml):
    """CSAC with ``fusion = "dp"`` (rho = 2) under central client-level DP, ten clients, no learning (lr 1e-12, one
    acquisition epoch): each upload carries sigma rho C / sqrt(K), the distances their own noise, and the fused
    model's change between broadcasts divided by the largest weight's sensitivity rho C / K has a standard deviation
    of at least sigma. The paper's fusion is refused in central mode, and the distances need stat_noise."""
    with pytest.raises(UserError, match="fusion = \"dp\""):
        run_toml(central_ten(dict(name="csac", acquire_epochs=1), stat_noise=3.0), name="a")
    with pytest.raises(UserError, match="stat_noise"):
        run_toml(central_ten(dict(name="csac", acquire_epochs=1, fusion="dp")), name="b")
    root = run_toml(central_ten(dict(name="csac", acquire_epochs=1, fusion="dp"), stat_noise=3.0), name="c")
    led = Ledger.open(root)
    glob = {}
    for e in led.select(kind="weights", sender="server"):
        glob.setdefault(e.round, led.payload(e).arrays)
    mult = []
    for t in sorted(glob)[:-1]:
        d = torch.cat([(glob[t + 1][k].double() - glob[t][k].double()).flatten() for k in glob[t]
                       if glob[t][k].is_floating_point()])
        mult.append(d.std().item() / (2 * 0.05 / 10))
    for e in led.select(kind="weights"):
        if e.sender != "server":
            ev = e.filters[0]
            assert ev["stat_noise"] == 3.0 and ev["update_noise_multiplier"] == pytest.approx((0.7 ** -2 - 3 ** -2) ** -0.5)
    assert mult and all(0.95 * 0.7 <= x <= 2 * 0.7 for x in mult), mult    # sigma sqrt(K sum w^2): 1 to rho
    ups = [e for e in led.select(kind="weights", round=2) if e.sender != "server"]
    upd = [torch.cat([(led.payload(e).arrays[k].double() - glob[1][k].double()).flatten() for k in glob[1]
                      if glob[1][k].is_floating_point()]) for e in ups]
    sigma_u = (0.7 ** -2 - 3 ** -2) ** -0.5
    assert upd and all(u.std().item() == pytest.approx(sigma_u * 2 * 0.05 / math.sqrt(10), rel=0.1) for u in upd)
    # attacks read the uploads as model states: the update statistics are not in their payloads
    from fdg_audit.audit.harness import run_attacks
    run_attacks(root, [{"name": "mia_loss"}], quiet=True)
    got = leakage_rows(root, attack="mia_loss")
    assert got and not [r for r in got if str(r.get("status", "ok")).startswith("failed")]


def test_box_weights_stay_in_the_box_sum_to_one_and_keep_the_order():
    from methods.csac import box_weights
    g = torch.Generator().manual_seed(0)
    for rho in (1.0, 1.5, 2.0, 4.0):
        for _ in range(20):
            d = torch.randn(7, generator=g).abs() * torch.rand(7, generator=g) * 10
            w = box_weights(d, rho)
            assert float(w.sum()) == pytest.approx(1.0)
            assert float(w.min()) >= 1 / (rho * 7) - 1e-9 and float(w.max()) <= rho / 7 + 1e-9
            order = torch.argsort(d)
            assert bool((w[order][1:] >= w[order][:-1] - 1e-12).all())
