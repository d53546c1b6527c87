"""Speculative sampling is lossless: the first two generated tokens follow the target's exact distribution.

A tiny-vocabulary target/drafter pair gives the target's exact joint law of (token 1, token 2) from its
logits; 20,000 speculative samples (Sampling.seed = 0..19,999: draws are keyed by seed and position) are
compared with it by a chi-square test. The same test is run on deliberately broken acceptance rules, which
must fail it. The logits the rounds need depend only on the prompt and on token 1, so they are computed once
and `verify` is called directly; `test_direct_rounds_are_what_generate_does` ties that to `generate`.
Also: `warp` (temperature, top-k, top-p), greedy verify on hand-made logits, and a few exact properties.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import make_tiny
from kit.draft import ModelDrafter
from kit.generate import generate
from kit.graphs import StageRunner
from kit.load import load_stage
from kit.verify import Sampling, next_token, sample, verify, warp

torch.set_grad_enabled(False)

V, HIDDEN, LAYERS = 12, 32, 2
PROMPT = [3, 7, 5, 9]
N = 20_000
ALPHA = 0.001
PLAIN = Sampling(temperature=1.0)
WARPED = Sampling(temperature=0.8, top_k=6, top_p=0.85)


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- chi-square without scipy

def chi2_sf(x: float, df: int) -> float:
    """Upper tail P(X > x) of a chi-square with df degrees of freedom (Wilson-Hilferty normal approximation,
    accurate to a few per cent of the p-value for df >= 10 in the range that matters here)."""
    h = 2 / (9 * df)
    z = ((x / df) ** (1 / 3) - (1 - h)) / math.sqrt(h)
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2_quantile(q: float, df: int) -> float:
    """The x with P(X <= x) = q, by the same approximation (normal quantile by bisection on erfc)."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < q:
            lo = mid
        else:
            hi = mid
    h = 2 / (9 * df)
    return df * (1 - h + lo * math.sqrt(h)) ** 3


def test_chi2_approximation_against_known_quantiles():
    # chi-square tables: 0.999 quantiles for df 10, 50, 100
    for df, x in [(10, 29.588), (50, 86.661), (100, 149.449)]:
        assert abs(chi2_quantile(1 - ALPHA, df) - x) / x < 0.01
        assert 0.0008 < chi2_sf(x, df) < 0.0012
    assert abs(chi2_sf(99.334, 100) - 0.5) < 0.01  # the median


def goodness_of_fit(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> tuple[float, int, float, int]:
    """(statistic, degrees of freedom, p-value, samples in impossible cells). Cells expected below 5 are pooled."""
    n = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for x in samples:
        counts[x] = counts.get(x, 0) + 1
    impossible = sum(c for x, c in counts.items() if law.get(x, 0.0) <= 0.0)
    big = [x for x, p in law.items() if n * p >= 5]
    bins = [(counts.get(x, 0), n * law[x]) for x in big]
    rest_p = sum(p for x, p in law.items() if x not in set(big))
    if rest_p > 0:
        bins.append((n - impossible - sum(o for o, _ in bins), n * rest_p))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    return stat, df, chi2_sf(stat, df), impossible


def assert_matches(samples, law, what: str) -> None:
    stat, df, p, impossible = goodness_of_fit(samples, law)
    assert impossible == 0, f"{what}: {impossible} samples the target can never produce"
    assert p > ALPHA, f"{what}: chi2 {stat:.1f} on {df} df, p = {p:.2e} (threshold {chi2_quantile(1 - ALPHA, df):.1f})"


def assert_rejected(samples, law, what: str) -> None:
    stat, df, p, impossible = goodness_of_fit(samples, law)
    assert impossible > 0 or p < ALPHA, f"{what} passed: chi2 {stat:.1f} on {df} df, p = {p:.3f}"


# ---------------------------------------------------------------- the model pair, computed once

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Logits of target and drafter after the prompt ([V]) and after the prompt + each token 1 ([V, V])."""
    root = tmp_path_factory.mktemp("pair")
    out = {}
    for name, seed in (("target", 0), ("drafter", 1)):
        folder = make_tiny(root / name, "llama3", vocab=V, hidden=HIDDEN, layers=LAYERS, seed=seed)
        stage = load_stage(str(folder), 0, LAYERS, max_len=32, progress=False)
        first = stage.step(torch.tensor(PROMPT))[0, -1]
        second = []
        for t in range(V):
            stage.rewind(len(PROMPT))
            second.append(stage.step(torch.tensor([t]))[0, -1])
        out[name] = (first, torch.stack(second))
        out[name + "_dir"] = folder
    return out


def exact_law(pair, s: Sampling) -> dict[tuple[int, int], float]:
    """The target's own P(token 1, token 2) under sampling settings s."""
    first, second = pair["target"]
    p1, p2 = warp(first[None], s)[0].double(), warp(second, s).double()
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(V) for b in range(V) if p1[a] * p2[a, b] > 0}


def speculate(pair, rule, s: Sampling, k: int, sampled_drafts: bool, seeds: range) -> list[tuple[tuple[int, int], int]]:
    """For each seed, tokens 1 and 2 exactly as generate() makes them with `rule` as the verifier, and how
    many drafts round 1 accepted. Round 1 drafts k tokens (k <= 2) at position n; if it commits only one
    token, round 2 drafts again after it. A draft is the drafter's argmax (a point mass), or with
    `sampled_drafts` a draw from its warped distribution q, passed to the verifier as draft_probs. The row
    after the last draft only feeds the bonus token, which falls beyond token 2 when k = 2, so a flat row
    stands in for it there."""
    n = len(PROMPT)
    (t_first, t_second), (d_first, d_second) = pair["target"], pair["drafter"]
    q_first, q_second = warp(d_first[None], s)[0], warp(d_second, s)  # the warp does not depend on the seed
    flat = torch.zeros(V)
    out = []
    for seed in seeds:
        s = Sampling(s.temperature, s.top_p, s.top_k, seed)

        def draft(logits: torch.Tensor, q: torch.Tensor, position: int) -> int:
            return sample(q, s, position, salt=2) if sampled_drafts else int(logits.argmax())

        d1 = draft(d_first, q_first, n)
        d2 = draft(d_second[d1], q_second[d1], n + 1)
        drafts = [d1, d2][:k]
        rows = [t_first, t_second[d1], flat][: k + 1]
        qs = torch.stack([q_first, q_second[d1]][:k]) if sampled_drafts else None
        accepted, nxt = rule(torch.stack(rows), drafts, s, n, qs)
        committed = drafts[:accepted] + [nxt]
        if len(committed) >= 2:
            out.append(((committed[0], committed[1]), accepted))
            continue
        t1 = committed[0]
        d = draft(d_second[t1], q_second[t1], n + 1)
        a2, nxt = rule(torch.stack([t_second[t1], flat]), [d], s, n + 1, q_second[t1][None] if sampled_drafts else None)
        out.append(((t1, ([d][:a2] + [nxt])[0]), accepted))
    return out


def draw(pair, rule, s, k, sampled_drafts) -> list[tuple[int, int]]:
    return [tokens for tokens, _ in speculate(pair, rule, s, k, sampled_drafts, range(N))]


# ---------------------------------------------------------------- broken verifiers (same signature as verify)

def verify_accept_all(logits, drafts, s, position, draft_probs=None):
    """BROKEN: every draft is accepted, then the bonus token is drawn from p."""
    K = len(drafts)
    return K, sample(warp(logits, s)[K], s, position + K)


def verify_resample_from_p(logits, drafts, s, position, draft_probs=None):
    """BROKEN: the right acceptance test, but a rejected draft is replaced by a draw from p, not from the
    residual max(p - q, 0)."""
    p = warp(logits, s)
    K = len(drafts)
    for i, d in enumerate(drafts):
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        u = torch.rand(1, generator=_gen(s, position + i)).item()
        if u * q_d >= float(p[i, d]):
            return i, sample(p[i], s, position + i)
    return K, sample(p[K], s, position + K)


def verify_ignore_q(logits, drafts, s, position, draft_probs=None):
    """BROKEN: accepts a draft with probability p(d), as if every draft were a point mass, even when it was
    sampled from q; the residual is the right one."""
    p = warp(logits, s)
    K = len(drafts)
    for i, d in enumerate(drafts):
        u = torch.rand(1, generator=_gen(s, position + i)).item()
        if u >= float(p[i, d]):
            residual = (p[i] - draft_probs[i]).clamp_min(0.0) if draft_probs is not None else p[i].clone()
            if draft_probs is None:
                residual[d] = 0.0
            return i, sample(residual / residual.sum(), s, position + i)
    return K, sample(p[K], s, position + K)


def _gen(s: Sampling, position: int) -> torch.Generator:
    return torch.Generator().manual_seed((s.seed * 1_000_003 + position * 7919 + 1) % (2**63))


# ---------------------------------------------------------------- the distribution tests

@pytest.mark.timeout(300)
@pytest.mark.parametrize("s", [PLAIN, WARPED], ids=["t1", "t0.8-topk6-topp0.85"])
@pytest.mark.parametrize("k, sampled_drafts", [(1, False), (2, False), (2, True)],
                         ids=["k1-argmax", "k2-argmax", "k2-sampled"])
def test_speculative_sampling_follows_the_target(pair, s, k, sampled_drafts):
    law = exact_law(pair, s)
    runs = speculate(pair, verify, s, k, sampled_drafts, range(N))
    assert_matches([tokens for tokens, _ in runs], law, f"verify k={k} sampled={sampled_drafts} {s}")
    # round 1 accepts as often as theory says (a verifier that rejects more is lossless but useless)
    paths = [(accepted,) for _, accepted in runs]
    law = acceptance_law(pair, s, k, sampled_drafts)
    assert_matches(paths, law, f"drafts accepted in round 1, k={k} sampled={sampled_drafts} {s}")
    assert sum(p > 0.02 for p in law.values()) >= 2  # the test saw both rejections and acceptances


def acceptance_law(pair, s: Sampling, k: int, sampled_drafts: bool) -> dict[tuple[int], float]:
    """P(round 1 accepts a drafts), a = 0..k. Point-mass drafts d: P(accept) = p(d); drafts from q:
    P(accept) = sum min(p, q), and the accepted draft is distributed as min(p, q)."""
    (t_first, t_second), (d_first, d_second) = pair["target"], pair["drafter"]
    p1, p2 = warp(t_first[None], s)[0].double(), warp(t_second, s).double()
    if sampled_drafts:
        q1, q2 = warp(d_first[None], s)[0].double(), warp(d_second, s).double()
        first = torch.minimum(p1, q1)
        a1, a2 = float(first.sum()), float((first * torch.minimum(p2, q2).sum(-1)).sum())
    else:
        d1 = int(d_first.argmax())
        a1 = float(p1[d1])
        a2 = a1 * float(p2[d1, int(d_second[d1].argmax())])
    law = [1 - a1, a1] if k == 1 else [1 - a1, a1 - a2, a2]
    return {(a,): p for a, p in enumerate(law) if p > 0}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rule, k, sampled_drafts, s", [
    (verify_accept_all, 2, False, PLAIN),
    (verify_accept_all, 2, True, WARPED),
    (verify_resample_from_p, 1, False, PLAIN),
    (verify_resample_from_p, 2, True, PLAIN),
    (verify_ignore_q, 2, True, PLAIN),
], ids=["accept-all-argmax", "accept-all-sampled-warped", "resample-p-argmax", "resample-p-sampled", "ignore-q"])
def test_broken_acceptance_rules_fail_the_same_test(pair, rule, k, sampled_drafts, s):
    assert_rejected(draw(pair, rule, s, k, sampled_drafts), exact_law(pair, s), rule.__name__)


def verify_never_accept(logits, drafts, s, position, draft_probs=None):
    """LOSSLESS BUT USELESS: rejects every draft and draws the token from p."""
    return 0, sample(warp(logits, s)[0], s, position)


def test_a_verifier_that_never_accepts_is_caught(pair):
    runs = speculate(pair, verify_never_accept, PLAIN, 2, True, range(5000))
    assert_matches([t for t, _ in runs], exact_law(pair, PLAIN), "never-accept tokens")  # right law...
    assert_rejected([(a,) for _, a in runs], acceptance_law(pair, PLAIN, 2, True), "never-accept")  # ...no speed


@pytest.mark.parametrize("s", [PLAIN, WARPED], ids=["t1", "warped"])
def test_target_only_sampling_follows_the_target(pair, s):
    first, _ = pair["target"]
    p = warp(first[None], s)[0]
    law = {(t,): float(p[t]) for t in range(V) if p[t] > 0}
    assert_matches([(next_token(first, Sampling(s.temperature, s.top_p, s.top_k, seed), len(PROMPT)),)
                    for seed in range(N)], law, "next_token")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [1, 2])
def test_direct_rounds_are_what_generate_does(pair, k):
    """For the same seeds, generate() with the drafter model produces the very tokens `speculate` does, so
    the distribution tests above are tests of generate's sampling."""
    target = StageRunner(load_stage(str(pair["target_dir"]), 0, LAYERS, max_len=32, progress=False))
    drafter = ModelDrafter(load_stage(str(pair["drafter_dir"]), 0, LAYERS, max_len=32, progress=False), V)
    for seed in range(150):
        s = Sampling(WARPED.temperature, WARPED.top_p, WARPED.top_k, seed)
        g = generate([target], drafter, PROMPT, max_new_tokens=3, k=k, sampling=s)
        assert tuple(g.token_ids[:2]) == speculate(pair, verify, WARPED, k, False, range(seed, seed + 1))[0][0], seed


# ---------------------------------------------------------------- exact properties of verify and warp

def test_greedy_verify_on_hand_made_logits():
    target = [3, 1, 4, 1, 5]
    logits = torch.full((5, 8), -1.0)
    for row, t in enumerate(target):
        logits[row, t] = 2.0
        logits[row, (t + 1) % 8] = 1.9  # a close second
    g = Sampling()
    assert verify(logits, [3, 1, 4, 1], g, 10) == (4, 5)  # all accepted: the bonus token
    assert verify(logits, [3, 1, 7, 1], g, 10) == (2, 4)  # first mismatch: the target's own token
    assert verify(logits, [4, 1, 4, 1], g, 10) == (0, 3)
    assert verify(logits[:1], [], g, 10) == (0, 3)
    assert verify(logits[:3], [3, 1], g, 10) == (2, 4)
    assert next_token(logits[2], g, 10) == 4


def test_sampled_verify_exact_cases():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    s = Sampling(temperature=1.0, top_k=4)
    p = warp(logits, s)
    drafts = [int(torch.multinomial(p[i], 1)) for i in range(3)]
    for seed in range(200):  # q = p: every draft is accepted (the ratio is 1)
        assert verify(logits, drafts, Sampling(1.0, top_k=4, seed=seed), 7, draft_probs=p[:3])[0] == 3
    outside = [int(p[0].argmin())]  # a point-mass draft the target can never produce: always rejected
    for seed in range(200):
        accepted, token = verify(logits[:2], outside, Sampling(1.0, top_k=4, seed=seed), 7)
        assert accepted == 0 and token != outside[0] and p[0, token] > 0
    a = verify(logits, drafts, Sampling(1.0, seed=5), 7)
    assert a == verify(logits, drafts, Sampling(1.0, seed=5), 7)  # draws are keyed, not stateful
    assert len({verify(logits, drafts, Sampling(1.0, seed=x), 7) for x in range(50)}) > 1


def test_warp_temperature_top_k_top_p():
    torch.manual_seed(1)
    logits = torch.randn(64, 50) * 2
    torch.testing.assert_close(warp(logits, Sampling(0.7)), torch.softmax(logits / 0.7, -1))
    torch.testing.assert_close(warp(logits, Sampling(1.0, top_k=50, top_p=1.0)), torch.softmax(logits, -1))
    for k in (1, 2, 7, 49):
        w = warp(logits, Sampling(1.0, top_k=k))
        assert ((w > 0).sum(-1) == k).all()  # exactly k survive
        top = logits.topk(k, -1).indices
        assert (w.gather(-1, top) > 0).all()  # and they are the k largest
        torch.testing.assert_close(w.gather(-1, top), torch.softmax(logits.gather(-1, top), -1))
    for top_p in (0.1, 0.5, 0.9, 0.99):
        w = warp(logits, Sampling(1.0, top_p=top_p))
        probs = torch.softmax(logits, -1)
        sorted_p, _ = probs.sort(-1, descending=True)
        cum = sorted_p.cumsum(-1)
        for row in range(logits.shape[0]):
            if (cum[row] - top_p).abs().min() < 1e-5:
                continue  # too close to call in float32
            keep = int((cum[row] < top_p).sum()) + 1  # the smallest prefix with mass >= top_p
            kept = w[row] > 0
            assert int(kept.sum()) == keep
            assert float(probs[row][kept].sum()) >= top_p
            if not kept.all():
                assert float(probs[row][kept].min()) >= float(probs[row][~kept].max())
            torch.testing.assert_close(w[row][kept], probs[row][kept] / probs[row][kept].sum())
    # hand-made: masses 0.5, 0.3, 0.15, 0.05
    hand = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None]
    assert (warp(hand, Sampling(1.0, top_p=0.45)) > 0).sum() == 1
    assert (warp(hand, Sampling(1.0, top_p=0.75)) > 0).sum() == 2
    assert (warp(hand, Sampling(1.0, top_p=0.9)) > 0).sum() == 3
    # top-k first, then top-p on the renormalised rest: 0.5/0.95 + 0.3/0.95 = 0.84 >= 0.82 (not 0.8 < 0.82)
    both = warp(hand, Sampling(1.0, top_k=3, top_p=0.82))
    torch.testing.assert_close(both[0], torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
