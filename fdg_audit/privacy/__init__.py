"""Differential privacy: DP-SGD in local training, Gaussian mechanisms on shared artifacts, canaries, privacy.csv.

One scenario-level ``[privacy]`` table configures every run (a ``[[methods]]`` entry may carry its own
``privacy = {...}`` whose keys replace the scenario's)::

    [privacy]
    dp_sgd = true              # sample-level DP-SGD (Opacus) in every Client.fit
    noise_multiplier = 1.0     # sigma of DP-SGD
    max_grad_norm = 1.0        # per-example clipping bound C of DP-SGD
    delta = 1e-5               # the delta every epsilon is reported at
    accountant = "prv"         # "prv" (Opacus' default) | "rdp"

    [privacy.artifacts]        # per-row clip + Gaussian noise at the sender, for data-derived artifacts
    amplitude_bank = { clip = 50.0, noise_multiplier = 1.0 }

    [privacy.audit]            # canaries for DP audits (attacks/dp_audit.py)
    canaries = 64

    [privacy.client]           # client-level DP on every model-like upload (client_dp.py), any method
    clip = 1.0
    noise_multiplier = 1.0     # or target_epsilon = 8.0 (sigma calibrated with Opacus)
    mode = "local"             # local (untrusted server) | central (trusted aggregator)

Mechanisms and their accounting (each party keeps one accountant per mechanism for the whole run, never reset):

* ``dp_sgd`` (``dpsgd.py``): Opacus ``PrivacyEngine.make_private`` each time a client trains through
  ``Client.fit`` (one engine per client, so its accountant persists over rounds), Poisson sampling with
  rate 1/ceil(n/B); the event (sigma, C, q, steps, epsilon) rides on the client's next reply envelope.
* ``gaussian_rows`` (``artifacts.py``): a bus filter on the artifact kinds named in ``[privacy.artifacts]``;
  ``rows = "count"`` noises a count (``n_samples``) instead.
* ``client_dp`` (``client_dp.py``): client-level DP's clip + Gaussian noise on each client's model update.
* ``total``: where one party runs several mechanisms, their histories composed in one accountant, under the
  example-level relation (client_dp enters at sigma / 2: one example moves a clipped update by at most 2C).

Neighbouring relations (the ``adjacency`` column of privacy.csv): dp_sgd: add/remove one example (Opacus);
gaussian_rows: one example's row replaced by the null record (zero-out), or for ``rows = "count"`` one example
added/removed; client_dp: one client's update replaced by zero; total: one example (any of the above).

``privacy.csv`` (one row per run, party, mechanism and round in which that mechanism released something) is
built from the accounting events in ``messages.jsonl``: what was recorded is what was accounted.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field

from .. import records
from ..bus import ARTIFACT_KINDS
from ..errors import UserError
from ..params import typed
from .accounting import epsilon, new_accountant
from .artifacts import ArtifactMechanism, GaussianRows
from .canaries import canary_frequencies, insert_canaries
from .client_dp import ADJACENCY as CLIENT_ADJACENCY
from .client_dp import UPDATE_KINDS, ClientDP, ClientDPFilter, canary_coins, check, plan_check
from .dpsgd import PerSample, refuse

ACCOUNTANTS = ("prv", "rdp")
PRIVACY_FIELDS = ["run", "party", "mechanism", "round", "adversary", "headline", "covers", "epsilon", "delta",
                  "noise_multiplier", "clip", "sample_rate", "accountant", "steps", "adjacency"]
ADVERSARIES = ("server", "client", "eavesdropper")
ADJACENCY = {"dp_sgd": "one example (add/remove)", "gaussian_rows": "one example (zero-out: its row -> null record)",
             "count": "one example (add/remove: the count moves by 1)", "client_dp": CLIENT_ADJACENCY,
             "total": "one example (composed: every mechanism of this party)"}


@dataclass
class AuditConfig:
    canaries: int = 0               # canary slots appended to each audited client's training split
    clients: list = field(default_factory=list)       # audited clients (empty = every source client)
    seed: int = 0                   # public seed of the canary images and labels (the auditor regenerates them)
    out: str = "null"               # a slot without its canary: "null" (black image, zero-out) | "absent"
    update_canaries: int = 0        # canary clients summed into audited clients' updates (client_dp.py)
    gradient_canaries: int = 0      # Dirac gradient canaries in audited clients' DP-SGD steps (dpsgd.py)


@dataclass
class PrivacyConfig:
    dp_sgd: bool = False
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    accountant: str = "prv"
    artifacts: dict = field(default_factory=dict)     # kind -> ArtifactMechanism
    audit: AuditConfig = field(default_factory=AuditConfig)
    client: ClientDP | None = None                    # [privacy.client]: client-level DP (client_dp.py)


def privacy_config(raw: dict | None, where: str = "privacy") -> PrivacyConfig | None:
    """The validated config of a ``[privacy]`` table; None when it asks for nothing."""
    raw = dict(raw or {})
    arts, aud, cli = raw.pop("artifacts", {}) or {}, raw.pop("audit", {}) or {}, raw.pop("client", None)
    cfg = typed(PrivacyConfig, raw, where)
    if cli:
        cfg.client = check(typed(ClientDP, cli, f"{where}.client"), f"{where}.client")
    if not isinstance(arts, dict):
        raise UserError(f"{where}.artifacts must be a table, e.g. amplitude_bank = {{ clip = 50.0, noise_multiplier = 1.0 }}")
    for kind, m in arts.items():
        if kind in ("weights", "delta"):
            raise UserError(f"{where}.artifacts.{kind}: model updates are privatized by DP-SGD or client-level DP, "
                            "not per-row noise: use dp_sgd = true or a [privacy.client] table")
        if kind not in ARTIFACT_KINDS:
            raise UserError(f"{where}.artifacts.{kind}: unknown artifact kind; known: {sorted(ARTIFACT_KINDS)}")
        mech = typed(ArtifactMechanism, m, f"{where}.artifacts.{kind}")
        if not mech.clip > 0 or mech.noise_multiplier < 0:
            raise UserError(f"{where}.artifacts.{kind}: need clip > 0 and noise_multiplier >= 0, got "
                            f"clip = {mech.clip}, noise_multiplier = {mech.noise_multiplier}")
        if not isinstance(mech.passthrough, list):
            raise UserError(f"{where}.artifacts.{kind}.passthrough must be a list of names, e.g. [\"classes\"]")
        if mech.rows not in ("image", "aggregate", "count"):
            raise UserError(f"{where}.artifacts.{kind}.rows = {mech.rows!r}: use \"image\", \"aggregate\" or "
                            "\"count\" (noised scalar counts, e.g. n_samples)")
        cfg.artifacts[kind] = mech
    cfg.audit = typed(AuditConfig, aud, f"{where}.audit")
    if cfg.accountant not in ACCOUNTANTS:
        raise UserError(f"{where}.accountant = {cfg.accountant!r}: use one of {', '.join(ACCOUNTANTS)}")
    if not 0 < cfg.delta < 1:
        raise UserError(f"{where}.delta = {cfg.delta}: use a probability in (0, 1), e.g. 1e-5")
    if cfg.dp_sgd and (cfg.noise_multiplier < 0 or not cfg.max_grad_norm > 0):
        raise UserError(f"{where}: DP-SGD needs noise_multiplier >= 0 and max_grad_norm > 0")
    if cfg.audit.canaries < 0 or cfg.audit.out not in ("null", "absent"):
        raise UserError(f"{where}.audit: canaries must be >= 0 and out \"null\" or \"absent\"")
    if cfg.audit.update_canaries < 0 or (cfg.audit.update_canaries and cfg.client is None):
        raise UserError(f"{where}.audit.update_canaries = {cfg.audit.update_canaries}: update canaries audit "
                        "client-level DP: add a [privacy.client] table (noise_multiplier = 0.0 for a non-private run)")
    if cfg.audit.gradient_canaries < 0 or (cfg.audit.gradient_canaries and not cfg.dp_sgd):
        raise UserError(f"{where}.audit.gradient_canaries = {cfg.audit.gradient_canaries}: gradient canaries audit "
                        "DP-SGD: set dp_sgd = true (noise_multiplier = 0.0 for a non-private run)")
    return cfg if (cfg.dp_sgd or cfg.artifacts or cfg.audit.canaries or cfg.client) else None


def check_run(cfg: PrivacyConfig | None, model_cfg, data, method=None, params=None, engine: str = "local") -> None:
    """Checks that need the model, data and method: BatchNorm under DP-SGD, methods that refuse DP-SGD, client-level
    DP settings (clients per round, sampling rate, calibrated sigma), audited clients, canary count."""
    if cfg is None:
        return
    if cfg.dp_sgd and method is not None:
        refuse(method)
    if cfg.client is not None and method is not None:
        k = (len(data.names) - 1) * data.clients_per_domain   # source clients of a run
        plan_check(cfg.client, method, params, k, cfg.delta, cfg.accountant, "privacy.client", engine)
    if cfg.dp_sgd and model_cfg.norm == "batch":
        raise UserError("model.norm = \"batch\" with privacy.dp_sgd: Opacus refuses BatchNorm (it mixes the "
                        "examples of a batch): set model.norm = \"group\"")
    cpd = data.clients_per_domain
    ok = set(data.names) if cpd == 1 else {f"{d}/{k}" for d in data.names for k in range(cpd)}
    bad = [c for c in cfg.audit.clients if c not in ok]
    if bad:
        raise UserError(f"privacy.audit.clients: {bad[0]!r} is not a client of {data.name}: use some of "
                        + (f"{data.names}" if cpd == 1 else f"its clients \"<domain>/<k>\", k < {cpd}, e.g. "
                           f"\"{data.names[0]}/0\""))
    most = len(canary_frequencies(data.size, cfg.audit.seed))
    if cfg.audit.canaries > most:
        raise UserError(f"privacy.audit.canaries = {cfg.audit.canaries}: at most {most} distinct canaries fit "
                        f"{data.size}x{data.size} images")


def per_sample(loss_fn, grad_sample=None) -> PerSample:
    """Mark a local loss as a mean of per-example terms (see ``PerSample``). Default cross-entropy needs no mark."""
    return PerSample(loss_fn, grad_sample)


def prepare_client(client) -> None:
    """Per-client private state, built once when the client is built: DP-SGD state and audit canaries."""
    cfg = client.privacy
    client.dp_state = None
    if cfg.audit.canaries:
        insert_canaries(client, cfg.audit)
    a = cfg.audit
    if a.update_canaries and (not a.clients or client.id in a.clients):
        client.record_truth(records.UPDATE_CANARIES, member=canary_coins(client.run_id, client.id, a.update_canaries,
                                                                   a.seed))


def build_filters(cfg: PrivacyConfig | None) -> dict:
    if cfg is None:
        return {}
    out = {kind: [GaussianRows(kind, m, cfg.delta, cfg.accountant)] for kind, m in cfg.artifacts.items()}
    if cfg.client is not None:
        f = ClientDPFilter(cfg.client, cfg.delta, cfg.accountant, cfg.audit)
        for kind in cfg.client.kinds:
            out[kind] = out.get(kind, []) + [f]
    return out


# ------------------------------------------------------------------------------------------- privacy.csv

def privacy_rows(envelopes) -> list[dict]:
    """One row per (run, party, mechanism, round, adversary) with accounting events in the envelopes, plus a
    ``total`` row per round and adversary for parties with several mechanisms (their histories composed in one
    accountant). ``epsilon`` is the one that holds against that adversary (a mechanism's ``epsilon_by``; the same
    for every adversary where the event has none), ``covers`` the artifact kinds the mechanism protects, and
    ``headline`` marks the adversary the mechanism's configured budget is for."""
    latest: dict = {}
    for e in envelopes:
        for ev in e.filters or []:
            if not isinstance(ev, dict) or "epsilon" not in ev:
                continue
            mech = ev["mechanism"] + (f":{ev['kind']}" if ev.get("kind") else "")
            ev = dict(ev, adjacency=ev.get("adjacency") or ADJACENCY.get(ev.get("rows") if ev.get("rows") == "count"
                                                                          else ev["mechanism"], ""))
            key = (e.run, e.sender, mech, e.round)
            if key not in latest or ev["steps"] >= latest[key]["steps"]:
                latest[key] = ev
    rows = []
    for (run, party, mech, rnd), ev in latest.items():
        for adv in ADVERSARIES:
            rows.append(dict(run=run, party=party, mechanism=mech, round=rnd, adversary=adv,
                             headline=adv == ev.get("headline", "server"), covers=" ".join(covers(ev)),
                             epsilon=ev.get("epsilon_by", {}).get(adv, ev["epsilon"]), delta=ev["delta"],
                             noise_multiplier=ev["noise_multiplier"], clip=ev["clip"], sample_rate=ev["sample_rate"],
                             accountant=ev["accountant"], steps=ev["steps"], adjacency=ev["adjacency"]))
    by_party: dict = {}
    for (run, party, mech, rnd), ev in latest.items():
        by_party.setdefault((run, party), {}).setdefault(mech, []).append((rnd, ev))
    for (run, party), mechs in by_party.items():
        if len(mechs) < 2:
            continue
        for rnd in sorted({r for evs in mechs.values() for r, _ in evs}):
            for adv in ADVERSARIES:
                hist, delta, acc, kinds = [], None, None, []
                for evs in mechs.values():
                    past = [ev for r, ev in evs if r <= rnd]
                    if past:
                        ev = max(past, key=lambda v: v["steps"])
                        s = ev.get("adversary_scale", {}).get(adv, 1.0)
                        hist += [(h[0] * s, h[1], h[2]) for h in ev.get("example_history", ev["history"])]
                        delta, acc, kinds = ev["delta"], ev["accountant"], kinds + covers(ev)
                a = new_accountant(acc)
                a.history = hist
                rows.append(dict(run=run, party=party, mechanism="total", round=rnd, adversary=adv, headline=False,
                                 covers=" ".join(dict.fromkeys(kinds)), epsilon=epsilon(a, delta), delta=delta,
                                 noise_multiplier="", clip="", sample_rate="", accountant=acc,
                                 steps=sum(h[2] for h in hist), adjacency=ADJACENCY["total"]))
    rows.sort(key=lambda r: (r["run"], r["party"], r["mechanism"], r["round"], ADVERSARIES.index(r["adversary"])))
    return rows


def covers(ev: dict) -> list[str]:
    """The artifact kinds a mechanism's event protects: its ``covers``, else its ``kind`` (one artifact kind), else
    the model-like uploads (example-level DP-SGD protects what is computed from the privately trained model)."""
    return list(ev.get("covers") or ([ev["kind"]] if ev.get("kind") else UPDATE_KINDS))


def privacy_csv(envelopes) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=PRIVACY_FIELDS)
    w.writeheader()
    w.writerows(privacy_rows(envelopes))
    return buf.getvalue()


__all__ = ["PrivacyConfig", "ArtifactMechanism", "ClientDP", "AuditConfig", "privacy_config", "check_run", "per_sample",
           "epsilon", "new_accountant", "prepare_client", "build_filters", "privacy_rows", "privacy_csv",
           "PRIVACY_FIELDS"]
