"""Policy-loss modes (gspo, gpg, clip_cov, kl_cov, geo_mean) against transcriptions of verl 0.9.1's
definitions: loss value, the three metrics and the gradient w.r.t. log_prob, in float64. Fast unit
tests; the authority is tests/conformance, which calls verl itself."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.algos.registry import POLICY_LOSSES, accepted_kwargs, get_policy_loss_fn
from rlhf_core.algos.correction_specs import RolloutCorrection

MODES = ["gspo", "gpg", "clip_cov", "kl_cov", "geo_mean"]
ALL_MODES = sorted(set(POLICY_LOSSES.names()) - {"vanilla"})
"""Every mode for the contract tests (the transcriptions above cover MODES; tests/conformance covers all)."""
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KNOBS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, clip_cov_ratio=0.05, clip_cov_lb=1.0,
             clip_cov_ub=5.0, kl_cov_ratio=0.05, ppo_kl_coef=0.1, dro_beta=0.5, tau_pos=1.0, tau_neg=1.05,
             rollout_correction=RolloutCorrection(rollout_is="token", bypass_mode=True, loss_type="reinforce"))


# ---------------------------------------------------------------------------------------------
# verl's definitions (inputs are 0 at padding, as verl's are)
# ---------------------------------------------------------------------------------------------


def _mm(x, mask):
    m = mask.to(torch.float64)
    return (x * m).sum() / (m.sum() + 1e-8)


def ref_agg(loss_mat, mask, mode, num_tokens=None, num_seqs=None, scale=None):
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * m).sum() / (m.sum() if num_tokens is None else num_tokens)
    if mode == "token-sum":
        return (loss_mat * m).sum()
    per_seq = (loss_mat * m).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / (m.sum(-1) + 1e-8)
    alive = (m.sum(-1) > 0).to(loss_mat.dtype)
    value = (per_seq * alive).sum() / (alive.sum() if num_seqs is None else num_seqs)
    if mode == "seq-mean-token-sum-norm":
        value = value / (m.shape[-1] if scale is None else scale)
    return value


def ref_gspo(old, new, adv, mask, low, high, agg, scale, **_):
    log_ratio = new - old
    seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    token = torch.clamp(new - new.detach() + seq.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(token)
    plain, clipped = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    loss = ref_agg(torch.maximum(plain, clipped), mask, agg, scale=scale)
    return loss, {"pg_clipfrac": _mm((clipped > plain).double(), mask), "pg_clipfrac_lower": 0.0,
                  "ppo_kl": _mm(-log_ratio, mask)}


def ref_gpg(old, new, adv, mask, agg, scale, **_):
    return ref_agg(-new * adv, mask, agg, scale=scale), {}


def ref_clip_cov(old, new, adv, mask, low, high, agg, scale, cov_ratio, lb, ub, **_):
    log_ratio = new - old
    ratio = torch.exp(log_ratio)
    plain, clipped = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    already = (clipped > plain) & (mask > 0)
    cov = ((adv - _mm(adv, mask)) * (new - _mm(new.detach(), mask))).detach().clone()
    cov[mask == 0] = -torch.inf
    cov[already] = -torch.inf
    budget = max(int(cov_ratio * mask.sum().item()), 1)
    found = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    if len(found) > 0:
        found = found[torch.randperm(len(found))[: min(budget, len(found))]]
    corr = torch.ones_like(adv)
    corr[found[:, 0], found[:, 1]] = 0
    loss = ref_agg(torch.maximum(plain, clipped) * corr, mask, agg, scale=scale)
    return loss, {"pg_clipfrac": _mm((corr == 0).double(), mask), "ppo_kl": _mm(-log_ratio, mask)}


def ref_kl_cov(old, new, adv, mask, agg, scale, kl_ratio, coef, **_):
    log_ratio = new - old
    plain = -adv * torch.exp(log_ratio)
    penalised = plain + coef * log_ratio.abs()
    losses = plain.clone()
    flat_valid = torch.nonzero(mask.reshape(-1) > 0, as_tuple=True)[0]
    a, p = adv[mask > 0].detach(), new[mask > 0].detach()
    if len(a) > 0:
        cov = (a - a.mean()) * (p - p.mean())
        top = flat_valid[torch.topk(cov, max(1, int(len(cov) * kl_ratio))).indices]
        width = adv.shape[1]
        losses[top // width, top % width] = penalised[top // width, top % width]
    return ref_agg(losses, mask, agg, scale=scale), {"ppo_kl": _mm(log_ratio.abs(), mask)}


def ref_geo_mean(old, new, adv, mask, low, high, **_):
    log_ratio = new - old
    sign = torch.sign(adv)
    bounded = torch.clamp(log_ratio, -low, high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    n = mask.sum(-1)
    ratio = torch.exp((pessimistic * mask).sum(-1) / (n + 1e-8))
    seq_adv = (adv * mask).sum(-1) / (n + 1e-8)
    loss = torch.mean(-seq_adv * ratio)
    outside = log_ratio != bounded
    return loss, {"pg_clipfrac": _mm((outside & (adv > 0)).double(), mask),
                  "pg_clipfrac_lower": _mm((outside & (adv < 0)).double(), mask), "ppo_kl": _mm(-log_ratio, mask)}


REFS = {"gspo": ref_gspo, "gpg": ref_gpg, "clip_cov": ref_clip_cov, "kl_cov": ref_kl_cov, "geo_mean": ref_geo_mean}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _batch(masks, seed, batch=12, length=17):
    gen = torch.Generator().manual_seed(seed)
    mask = masks.make(gen, batch, length)
    old = torch.randn(batch, length, generator=gen, dtype=torch.float64) * 1.5 - 2
    # A per-row drift too, so that gspo's sequence ratio leaves its clip range for some rows.
    new = old + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64) + 0.3 * torch.randn(
        batch, 1, generator=gen, dtype=torch.float64)
    # Per-row advantages with some per-token noise, large enough that |cov| reaches clip_cov's (1, 5).
    adv = 2 * torch.randn(batch, 1, generator=gen, dtype=torch.float64) + 0.5 * torch.randn(
        batch, length, generator=gen, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    return mask, *(torch.where(mask, x, zero) for x in (old, new, adv))


def _ours(mode, old, new, adv, mask, **offered):
    fn = get_policy_loss_fn(mode)
    everything = dict(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
                      global_num_tokens=None, global_num_seqs=None, loss_scale_factor=None, **KNOBS)
    everything.update(offered)
    return fn(**accepted_kwargs(fn, everything))


def _ref(mode, old, new, adv, mask, agg="token-mean", scale=None):
    return REFS[mode](old, new, adv, mask, low=KNOBS["clip_ratio_low"], high=KNOBS["clip_ratio_high"], agg=agg,
                      scale=scale, cov_ratio=KNOBS["clip_cov_ratio"], lb=KNOBS["clip_cov_lb"],
                      ub=KNOBS["clip_cov_ub"], kl_ratio=KNOBS["kl_cov_ratio"], coef=KNOBS["ppo_kl_coef"])


def _loss_and_grad(call, new):
    leaf = new.clone().requires_grad_(True)
    torch.manual_seed(1234)  # clip_cov draws its tokens from the default generator, as verl
    loss, metrics = call(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), metrics, grad


# ---------------------------------------------------------------------------------------------
# against verl
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_matches_verl(masks, mode, agg, seed):
    mask, old, new, adv = _batch(masks, seed)
    scale = 20.0 if agg == "seq-mean-token-sum-norm" else None
    loss, metrics, grad = _loss_and_grad(
        lambda lp: _ours(mode, old, lp, adv, mask, loss_agg_mode=agg, loss_scale_factor=scale), new)
    ref_loss, ref_metrics, ref_grad = _loss_and_grad(lambda lp: _ref(mode, old, lp, adv, mask, agg, scale), new)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    for name, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad
        want = float(torch.as_tensor(ref_metrics.get(name, 0.0)).detach())  # a quantity verl does not log for this mode is 0 here
        assert float(value) == pytest.approx(want, abs=1e-6), name


def test_inputs_exercise_the_selections(masks):
    """The comparison above would be vacuous if clip_cov zeroed nothing or nothing were clipped."""
    mask, old, new, adv = _batch(masks, 0)
    torch.manual_seed(0)
    assert float(_ours("clip_cov", old, new, adv, mask)[1]["pg_clipfrac"]) > 0
    assert float(_ours("gspo", old, new, adv, mask)[1]["pg_clipfrac"]) > 0
    geo = _ours("geo_mean", old, new, adv, mask)[1]
    assert float(geo["pg_clipfrac"]) > 0 and float(geo["pg_clipfrac_lower"]) > 0
    assert (~mask.any(-1)).any()  # a fully masked row is present


def test_geo_mean_equals_verl_without_fully_masked_rows(masks):
    mask, old, new, adv = _batch(masks, 1)
    keep = mask.any(-1)
    rows = (mask[keep], old[keep], new[keep], adv[keep])
    loss, _, grad = _loss_and_grad(lambda lp: _ours("geo_mean", rows[1], lp, rows[3], rows[0]), rows[2])
    ref_loss, _, ref_grad = _loss_and_grad(lambda lp: _ref("geo_mean", rows[1], lp, rows[3], rows[0]), rows[2])
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# our contract
# ---------------------------------------------------------------------------------------------


def test_gspo_follows_loss_agg_mode(masks):
    """verl 0.9.1 aggregates gspo with the actor's loss_agg_mode (earlier verl forced seq-mean-token-mean)."""
    mask, old, new, adv = _batch(masks, 4)
    losses = {agg: float(_ours("gspo", old, new, adv, mask, loss_agg_mode=agg)[0]) for agg in AGG_MODES}
    assert len(set(losses.values())) == len(AGG_MODES)


def test_all_modes_are_registered():
    assert set(MODES) <= set(POLICY_LOSSES.names())


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", sorted(set(ALL_MODES) - {"bypass_mode"}))  # bypass's weights are per call
def test_micro_batch_shares_add_up_to_the_batch_loss(masks, mode, agg):
    mask, old, new, adv = _batch(masks, 2)
    # Per-call selections (clip_cov's draw, kl_cov's top-k) differ between splits by design (verl's
    # per-micro-batch semantics): switch them off to check the aggregation alone.
    knobs = dict(loss_agg_mode=agg, loss_scale_factor=20.0, clip_cov_lb=1e9, ppo_kl_coef=0.0)
    n_tok, n_seq = mask.sum(), mask.shape[0]
    full, _, full_grad = _loss_and_grad(lambda lp: _ours(mode, old, lp, adv, mask, **knobs, global_num_tokens=n_tok,
                                                         global_num_seqs=n_seq), new)
    parts, grads = [], []
    for rows in (slice(0, 5), slice(5, None)):
        part, _, grad = _loss_and_grad(lambda lp: _ours(mode, old[rows], lp, adv[rows], mask[rows], **knobs,
                                                        global_num_tokens=n_tok, global_num_seqs=n_seq), new[rows])
        parts.append(part)
        grads.append(grad)
    torch.testing.assert_close(sum(parts), full, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat(grads), full_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_junk_at_padding_reaches_neither_loss_nor_gradient(masks, mode):
    mask, old, new, adv = _batch(masks, 3)
    gen = torch.Generator().manual_seed(7)
    clean = _loss_and_grad(lambda lp: _ours(mode, old, lp, adv, mask), new)
    dirty = _loss_and_grad(lambda lp: _ours(mode, masks.scramble(old, mask, gen), lp,
                                            masks.scramble(adv, mask, gen), mask), masks.scramble(new, mask, gen))
    assert torch.isfinite(dirty[2]).all()
    torch.testing.assert_close(dirty[0], clean[0], rtol=0, atol=0)
    torch.testing.assert_close(dirty[2], clean[2], rtol=0, atol=0)
    for name in clean[1]:
        torch.testing.assert_close(dirty[1][name], clean[1][name], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["geo_mean", "sapo"])
def test_forced_aggregation_ignores_loss_agg_mode(masks, mode):
    mask, old, new, adv = _batch(masks, 4)
    losses = {float(_ours(mode, old, new, adv, mask, loss_agg_mode=agg)[0]) for agg in AGG_MODES}
    assert len(losses) == 1


@pytest.mark.parametrize("mode", ALL_MODES)
def test_all_masked_call_gives_zero_loss_and_metrics(mode):
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    loss, metrics = _ours(mode, zeros, zeros.clone().requires_grad_(True), zeros, torch.zeros(2, 3, dtype=torch.bool))
    assert float(loss.detach()) == 0 and all(float(v) == 0 for v in metrics.values())


@pytest.mark.parametrize("mode,knob", [("clip_cov", "clip_cov_ratio"), ("kl_cov", "kl_cov_ratio")])
def test_a_non_positive_selection_ratio_is_refused(masks, mode, knob):
    mask, old, new, adv = _batch(masks, 5)
    with pytest.raises(ValueError, match=rf"{knob} must be > 0.*actor\.policy_loss\.{knob}"):
        _ours(mode, old, new, adv, mask, **{knob: 0.0})


def test_kl_cov_penalises_the_highest_covariance_tokens():
    # One row, four tokens; ratio 0.5 of 4 tokens selects the top two covariances.
    adv = torch.tensor([[2.0, -2.0, 1.0, 0.0]], dtype=torch.float64)
    new = torch.tensor([[-1.0, -3.0, -2.0, -2.0]], dtype=torch.float64)
    old = new - 0.5
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, metrics = _ours("kl_cov", old, new, adv, mask, kl_cov_ratio=0.5, ppo_kl_coef=1.0)
    # cov = (A - 0.25) * (lp + 2): [1.75, 2.25, 0, 0] -> tokens 0 and 1 get + |0.5|.
    plain = (-adv * torch.exp(torch.tensor(0.5, dtype=torch.float64))).sum()
    torch.testing.assert_close(loss, (plain + 2 * 0.5) / 4)
    assert float(metrics["ppo_kl"]) == pytest.approx(0.5)
