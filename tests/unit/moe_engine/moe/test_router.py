import itertools
import math
from collections import Counter

import pytest
import torch
from tolerances import assert_close_to_scale, tolerance

from moe_engine.config import MoEConfig, RoutingMode, ScoreFunc
from moe_engine.moe.router import Router, expert_counts

# The weights against softmax(x @ W^T) written out: the same fp32 products over d_model = 16,
# perhaps summed in another order, then the softmax's sum over the experts.
SCORE_TOL = tolerance(torch.float32, 16, depth=2)


def make_router(d_model=16, device="cpu", **kwargs) -> Router:
    """Initialised on the CPU (from the global seed), then moved: the same weights on every device."""
    router = Router(d_model, MoEConfig(**kwargs))
    torch.nn.init.normal_(router.weight, std=0.5)
    return router.to(device)


def randn(*shape, device, seed=None):
    """Normal inputs drawn on the CPU (the same values on every device), then moved."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device)


def assert_distinct_per_token(expert_TK):
    sorted_TK = expert_TK.sort(dim=1).values
    assert (sorted_TK[:, 1:] != sorted_TK[:, :-1]).all()


def test_random_routing_is_uniform_and_distinct(device):
    tokens, experts, k = 20000, 16, 4
    router = make_router(device=device, num_experts=experts, top_k=k, routing="random", routing_seed=3)
    expert_TK = router(randn(tokens, 16, device=device)).expert_TK.cpu()
    assert_distinct_per_token(expert_TK)
    counts = expert_counts(expert_TK, experts).double()
    # Each expert is in a token's k-subset with probability k/E, independently across tokens.
    p = k / experts
    mean, std = tokens * p, math.sqrt(tokens * p * (1 - p))
    assert (counts - mean).abs().max() < 5 * std
    # ...and every expert is equally likely in every slot, not just overall.
    first_slot = expert_counts(expert_TK[:, :1], experts).double()
    assert (first_slot - tokens / experts).abs().max() < 5 * math.sqrt(tokens / experts)


def test_random_routing_seeds_reproduce_and_differ(device):
    x = randn(512, 16, device=device)

    def route(seed):
        return make_router(device=device, num_experts=8, top_k=2, routing="random", routing_seed=seed)(x).expert_TK

    assert torch.equal(route(1), route(1))
    assert not torch.equal(route(1), route(2))
    router = make_router(device=device, num_experts=8, top_k=2, routing="random", routing_seed=1)
    first, second = router(x).expert_TK, router(x).expert_TK
    assert not torch.equal(first, second), "successive steps must draw new routings"
    router.reset_routing_generator()
    assert torch.equal(router(x).expert_TK, first)


@pytest.mark.parametrize("tokens, experts, k", [(64, 8, 2), (96, 12, 3), (10, 4, 4)])
def test_balanced_routing_is_exact(tokens, experts, k, device):
    router = make_router(device=device, num_experts=experts, top_k=k, routing="balanced")
    expert_TK = router(randn(tokens, 16, device=device)).expert_TK
    assert_distinct_per_token(expert_TK)
    counts = expert_counts(expert_TK, experts)
    assert counts.tolist() == [tokens * k // experts] * experts


@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.5])
def test_skewed_routing_follows_zipf(exponent, device):
    tokens, experts, k = 40000, 16, 4
    router = make_router(device=device, num_experts=experts, top_k=k, routing="skewed", zipf_exponent=exponent)
    expert_TK = router(randn(tokens, 16, device=device)).expert_TK.cpu()
    assert_distinct_per_token(expert_TK)
    # Gumbel-top-k draws without replacement; its first pick has exactly the Zipf probabilities.
    zipf = [1 / (e + 1) ** exponent for e in range(experts)]
    p = torch.tensor([z / sum(zipf) for z in zipf], dtype=torch.float64)
    first = expert_counts(expert_TK[:, :1], experts).double()
    std = (tokens * p * (1 - p)).sqrt()
    assert ((first - tokens * p).abs() < 5 * std).all()
    # The fitted log-log slope of the first-pick frequencies recovers the exponent.
    log_rank = torch.log(torch.arange(1, experts + 1, dtype=torch.float64))
    log_freq = torch.log(first / tokens)
    slope = torch.cov(torch.stack([log_rank, log_freq]))[0, 1] / log_rank.var()
    assert abs(-slope.item() - exponent) < 0.1
    # Popularity is monotone in the overall counts too.
    overall = expert_counts(expert_TK, experts)
    assert overall[0] > overall[experts // 2] > overall[-1]


def sampling_without_replacement_law(p: list[float], k: int) -> dict[tuple[int, ...], float]:
    """Exact probability of each ordered k-tuple of distinct experts when they are drawn one at a
    time, each draw with probability proportional to p among the experts not drawn yet."""
    law = {}
    for picks in itertools.permutations(range(len(p)), k):
        prob, left = 1.0, 1.0
        for e in picks:
            prob *= p[e] / left
            left -= p[e]
        law[picks] = prob
    return law


def assert_binomial_counts(counts_E: torch.Tensor, p_E: list[float], trials: int, what: str) -> None:
    """Each count within 5 standard deviations of its binomial expectation."""
    for e, (count, p) in enumerate(zip(counts_E.tolist(), p_E)):
        mean, std = trials * p, math.sqrt(trials * p * (1 - p))
        assert abs(count - mean) < 5 * std, f"{what}: expert {e} got {count}, expected {mean:.0f} +- {std:.0f}"


@pytest.mark.parametrize("experts, k, exponent", [(4, 2, 1.0), (5, 3, 1.5)])
def test_skewed_routing_draws_all_picks_without_replacement(experts, k, exponent, device):
    """The joint law of a token's k picks, not only the first: sampling without replacement with the
    Zipf weights, checked on each expert's inclusion, on the second pick and on the ordered k-tuples."""
    tokens = 40000
    router = make_router(
        device=device, num_experts=experts, top_k=k, routing="skewed", zipf_exponent=exponent, routing_seed=5
    )
    expert_TK = router(randn(tokens, 16, device=device, seed=0)).expert_TK.cpu()
    zipf = [1 / (e + 1) ** exponent for e in range(experts)]
    p = [z / sum(zipf) for z in zipf]
    law = sampling_without_replacement_law(p, k)
    assert sum(law.values()) == pytest.approx(1.0)

    inclusion = [sum(q for picks, q in law.items() if e in picks) for e in range(experts)]
    second = [sum(q for picks, q in law.items() if picks[1] == e) for e in range(experts)]
    assert_binomial_counts(expert_counts(expert_TK, experts), inclusion, tokens, "inclusion")
    assert_binomial_counts(expert_counts(expert_TK[:, 1], experts), second, tokens, "second pick")

    # Pearson's statistic over the ordered tuples has mean df and standard deviation sqrt(2 df).
    observed = Counter(map(tuple, expert_TK.tolist()))
    assert set(observed) <= set(law)
    chi2 = sum((observed[picks] - tokens * q) ** 2 / (tokens * q) for picks, q in law.items())
    df = len(law) - 1
    assert chi2 < df + 5 * math.sqrt(2 * df), (chi2, df)


@pytest.mark.parametrize("mode", list(RoutingMode))
def test_every_mode_gives_router_gradients(mode, device):
    router = make_router(device=device, num_experts=8, top_k=2, routing=mode, normalize_top_k=False)
    x = randn(64, 16, device=device).requires_grad_()
    out = router(x)
    (out.weight_TK * randn(64, 2, device=device)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert x.grad.abs().sum() > 0
    # Weights are the real scores of the chosen experts.
    scores = torch.softmax(x.detach() @ router.weight.detach().T, dim=-1)
    assert_close_to_scale(out.weight_TK, scores.gather(1, out.expert_TK), SCORE_TOL)


def _softmax(row):
    m = max(row)
    exps = [math.exp(v - m) for v in row]
    return [e / sum(exps) for e in exps]


def test_aux_and_z_loss_match_hand_computation(device):
    # Identity router weight: the logits are the inputs themselves.
    logits = [[2.0, 0.0, -1.0], [0.5, 1.5, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.5]]
    router = Router(3, MoEConfig(num_experts=3, top_k=1, aux_loss_weight=0.1, z_loss_weight=0.01)).to(device)
    with torch.no_grad():
        router.weight.copy_(torch.eye(3))
    out = router(torch.tensor(logits, device=device))

    probs = [_softmax(row) for row in logits]
    chosen = [max(range(3), key=lambda e: row[e]) for row in probs]  # [0, 1, 2, 1]
    assert out.expert_TK.flatten().tolist() == chosen
    fraction = [chosen.count(e) / 4 for e in range(3)]
    mean_prob = [sum(p[e] for p in probs) / 4 for e in range(3)]
    aux = 3 * sum(f * p for f, p in zip(fraction, mean_prob))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 4

    # The logits are exact (one nonzero product each); the fp32 side then rounds in the softmax or
    # logsumexp over 3 experts, the mean over 4 tokens and the sum over 3 experts (double: exact here).
    rel = tolerance(torch.float32, 4, depth=3)
    assert out.aux_loss.item() == pytest.approx(aux, rel=rel)
    assert out.z_loss.item() == pytest.approx(z, rel=rel)
    assert out.loss.item() == pytest.approx(0.1 * aux + 0.01 * z, rel=rel)
    assert out.weight_TK.flatten().tolist() == pytest.approx([p[c] for p, c in zip(probs, chosen)], rel=rel)


def test_sigmoid_scores_with_top_k_renormalisation(device):
    router = make_router(device=device, num_experts=6, top_k=3, score_func=ScoreFunc.SIGMOID, normalize_top_k=True)
    x = randn(32, 16, device=device)
    out = router(x)
    scores = torch.sigmoid(x @ router.weight.detach().T)
    top = scores.topk(3, dim=-1)
    assert torch.equal(out.expert_TK, top.indices)
    # Logits over d_model = 16, the sigmoid, the renormalising sum over k.
    renormalised = top.values / top.values.sum(-1, keepdim=True)
    assert_close_to_scale(out.weight_TK, renormalised, tolerance(torch.float32, 16, depth=3))
    # The balance loss sees scores normalised per token.
    probs = scores / scores.sum(-1, keepdim=True)
    counts = expert_counts(out.expert_TK, 6).float()
    expected = 6 * (counts / (32 * 3) * probs.mean(0)).sum()
    # ...then the mean over the 32 tokens and the sum over the experts.
    assert out.aux_loss.item() == pytest.approx(expected.item(), rel=tolerance(torch.float32, 32, depth=5))


def test_expert_bias_shifts_selection_not_weights(device):
    router = make_router(device=device, num_experts=4, top_k=1, expert_bias_rate=0.5)
    x = randn(200, 16, device=device)
    before = router(x)
    counts = expert_counts(before.expert_TK, 4)
    router.update_expert_bias(counts)
    # Over-loaded experts lose bias, under-loaded ones gain it, by exactly the rate.
    mean = counts.float().mean()
    expected = 0.5 * torch.sign(mean - counts.float())
    assert torch.equal(router.expert_bias, expected)

    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
    after = router(x)
    assert (after.expert_TK == 3).all()
    scores = torch.softmax(x @ router.weight.detach().T, dim=-1)
    assert_close_to_scale(after.weight_TK[:, 0], scores[:, 3], SCORE_TOL)


def test_expert_bias_disabled_by_default(device):
    router = make_router(device=device, num_experts=4, top_k=1)
    router.update_expert_bias(torch.tensor([10, 0, 0, 0], device=device))
    assert torch.equal(router.expert_bias, torch.zeros(4, device=device))


def _group_limited_reference(scores_TE, bias_E, n_groups, top_groups, top_k):
    """Per token, in plain Python: score each group by the sum of its two best biased scores, keep the
    top_groups groups, take the top_k experts among theirs."""
    num_experts = scores_TE.shape[1]
    per_group = num_experts // n_groups
    chosen = []
    for row in (scores_TE + bias_E).tolist():
        groups = [sorted(row[g * per_group : (g + 1) * per_group], reverse=True) for g in range(n_groups)]
        group_score = [sum(values[:2]) for values in groups]
        kept = sorted(range(n_groups), key=lambda g: -group_score[g])[:top_groups]
        candidates = [e for g in kept for e in range(g * per_group, (g + 1) * per_group)]
        chosen.append(sorted(sorted(candidates, key=lambda e: -row[e])[:top_k]))
    return chosen


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("experts, groups, top_groups, k", [(16, 4, 2, 3), (12, 6, 3, 4), (8, 8, 3, 2)])
def test_group_limited_routing_matches_a_per_token_loop(score_func, experts, groups, top_groups, k, device):
    torch.manual_seed(0)
    router = make_router(
        device=device,
        num_experts=experts,
        top_k=k,
        n_groups=groups,
        top_groups=top_groups,
        score_func=score_func,
        normalize_top_k=True,
        routed_scaling_factor=2.5,
    )
    # A bias that reorders the groups: selection must use it, the weights must not.
    router.expert_bias.copy_(torch.randn(experts) * 0.3)
    x_TD = torch.randn(256, 16).to(device)
    out = router(x_TD)
    logits_TE = x_TD @ router.weight.detach().T
    scores_TE = torch.sigmoid(logits_TE) if score_func == "sigmoid" else torch.softmax(logits_TE, dim=-1)
    expected = _group_limited_reference(scores_TE.cpu(), router.expert_bias.cpu(), groups, top_groups, k)
    assert out.expert_TK.sort(dim=1).values.tolist() == expected
    # Weights: the chosen experts' unbiased scores, renormalised, times the scaling factor (logits over
    # d_model = 16, the score, the sum over k).
    chosen_TK = scores_TE.gather(1, out.expert_TK)
    weight_tol = tolerance(torch.float32, 16, depth=3)
    assert_close_to_scale(out.weight_TK, 2.5 * chosen_TK / chosen_TK.sum(-1, keepdim=True), weight_tol)
    # ...with gradients to the router weight through those weights.
    out.weight_TK.square().sum().backward()
    reference = router.weight.detach().clone().requires_grad_()
    ref_scores = torch.sigmoid(x_TD @ reference.T) if score_func == "sigmoid" else torch.softmax(x_TD @ reference.T, -1)
    ref_chosen = ref_scores.gather(1, out.expert_TK)
    (2.5 * ref_chosen / ref_chosen.sum(-1, keepdim=True)).square().sum().backward()
    # The chain back through the same three steps, then the sum over the 256 tokens.
    assert_close_to_scale(router.weight.grad, reference.grad, tolerance(torch.float32, 256, depth=7))


def test_group_limit_changes_the_choice_and_spares_benchmark_modes(device):
    """The limit bites (some tokens' unlimited top-k leave the chosen groups), and random routing
    ignores it (benchmark modes stay as they are)."""
    torch.manual_seed(1)
    x_TD = torch.randn(512, 16).to(device)
    limited = make_router(device=device, num_experts=16, top_k=3, n_groups=4, top_groups=1)
    free = make_router(device=device, num_experts=16, top_k=3)
    free.weight.data.copy_(limited.weight.data)
    limited_TK, free_TK = limited(x_TD).expert_TK, free(x_TD).expert_TK
    assert not torch.equal(limited_TK.sort(1).values, free_TK.sort(1).values)
    # Every token's experts come from its one chosen group of four.
    assert ((limited_TK // 4) == (limited_TK[:, :1] // 4)).all()
    random_limited = make_router(
        device=device, num_experts=16, top_k=2, n_groups=8, top_groups=1, routing="random", routing_seed=5
    )
    random_free = make_router(device=device, num_experts=16, top_k=2, routing="random", routing_seed=5)
    assert torch.equal(random_limited(x_TD).expert_TK, random_free(x_TD).expert_TK)
