"""Speculative greedy decoding is lossless: for every drafter kind, K and stage split the output equals
target-only greedy token for token, EOS / max_new_tokens / stop cut exactly where target-only decoding
would, a model drafter's cache always holds exactly the tokens it was fed, and a drafter with another
tokenizer is refused before its weights load."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from conftest import make_tiny
from kit.draft import ModelDrafter, NoDrafter, check_same_tokenizer, make_drafter
from kit.generate import AdaptiveK, finish, generate
from kit.graphs import StageRunner
from kit.load import CheckpointError, load_stage

torch.set_grad_enabled(False)

VOCAB, LAYERS, MAX_LEN, NEW = 256, 4, 160, 40
SPLITS = {1: [(0, 4)], 2: [(0, 2), (2, 4)]}
PROMPTS = [[5, 17, 33, 9, 100, 7], [40, 41, 42, 43, 40, 41, 42, 43, 40, 41]]  # varied; repetitive (n-gram hits)


pytestmark = pytest.mark.usefixtures("one_thread")


def save_word_tokenizer(folder, size: int, swap: tuple[int, int] | None = None) -> None:
    """A word-level tokenizer `t<i>` -> i (ids 0-2 special); `swap` exchanges two tokens' ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, size)}}
    if swap:
        a, b = (next(t for t, i in vocab.items() if i == x) for x in swap)
        vocab[a], vocab[b] = vocab[b], vocab[a]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny target (Qwen3 family: q/k norm), a separate random drafter of the same vocabulary, and a
    drafter whose vocabulary is twice as large and whose extra ids always win its argmax."""
    root = tmp_path_factory.mktemp("spec")
    target = make_tiny(root / "target", "qwen3", layers=LAYERS, seed=3)
    other = make_tiny(root / "other", "qwen3", layers=2, seed=4)
    big = make_tiny(root / "big", "qwen3", layers=2, seed=5, vocab=2 * VOCAB)
    w = load_file(big / "model.safetensors")
    head = w["lm_head.weight"]
    head[VOCAB:] = 2 * head[:VOCAB]  # logit of id V+i = 2 * logit of id i: the top id is >= V whenever max > 0
    save_file(w, big / "model.safetensors", metadata={"format": "pt"})
    for folder in (target, other, big):
        save_word_tokenizer(folder, VOCAB)
    return {"target": target, "other": other, "big": big}


def chain(folder, n_stages: int) -> list[StageRunner]:
    return [StageRunner(load_stage(str(folder), a, b, max_len=MAX_LEN, progress=False)) for a, b in SPLITS[n_stages]]


def from_scratch_greedy(folder, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decoding that never reuses a cache: the whole context is recomputed per token."""
    stage = load_stage(str(folder), 0, LAYERS, max_len=MAX_LEN, progress=False)
    ids = list(prompt)
    for _ in range(n):
        stage.rewind(0)
        ids.append(int(stage.step(torch.tensor(ids))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def refs(ckpt):
    return [from_scratch_greedy(ckpt["target"], p, NEW) for p in PROMPTS]


class CacheWatch:
    """Passes proposals through from a ModelDrafter and, after every round, checks its cache discipline:
    the cache length equals len(fed), fed is the context plus all drafts but the last, the cached K/V equal
    a fresh run over fed (no hole, nothing stale), and the drafts are the drafter's own greedy continuation
    within the target's vocabulary."""

    def __init__(self, drafter: ModelDrafter, limit: int = VOCAB, fresh: bool = True):
        self.d, self.limit, self.fresh, self.log = drafter, limit, fresh, []

    def propose(self, context: list[int], k: int) -> list[int]:
        drafts = self.d.propose(context, k)
        st = self.d.stage
        self.log.append((len(context), drafts))
        assert st.length == len(self.d.fed)
        assert all(0 <= t < self.limit for t in drafts), drafts
        if drafts:
            assert self.d.fed == context + drafts[:-1]
            if self.fresh:
                assert drafts == self._fresh(context, len(drafts))
        return drafts

    def _fresh(self, context: list[int], k: int) -> list[int]:
        st, n = self.d.stage, self.d.stage.length
        saved = [(kc[:, :, :n].clone(), vc[:, :, :n].clone()) for kc, vc in zip(st.k_caches, st.v_caches)]
        st.rewind(0)
        logits = st.step(torch.tensor(context))[0, -1]
        out = []
        for _ in range(k):
            out.append(int(logits[: self.d.vocab_limit].argmax()))
            if len(out) < k:
                logits = st.step(torch.tensor(out[-1:]))[0, -1]
        assert st.length == n
        for (k0, v0), kc, vc in zip(saved, st.k_caches, st.v_caches):
            torch.testing.assert_close(k0, kc[:, :, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v0, vc[:, :, :n], atol=1e-4, rtol=1e-4)
            kc[:, :, :n], vc[:, :, :n] = k0, v0  # leave the drafter exactly as it was
        return out


def build(kind: str, ckpt, runners: list[StageRunner]):
    target = str(ckpt["target"])
    if kind == "none":
        return NoDrafter()
    spec = {"other": str(ckpt["other"]), "target": target, "big": str(ckpt["big"])}.get(kind, kind)
    d = make_drafter(spec, target, runners[0].stage, max_len=MAX_LEN, progress=False)
    return CacheWatch(d) if isinstance(d, ModelDrafter) else d


def test_reference_paths_agree(ckpt, refs):
    """Target-only decoding through generate (cache, rewinds, 1 or 2 stages) equals the no-cache reference."""
    for n_stages in (1, 2):
        runners = chain(ckpt["target"], n_stages)
        for prompt, ref in zip(PROMPTS, refs):
            g = generate(runners, NoDrafter(), prompt, max_new_tokens=NEW, k=4)
            assert g.token_ids == ref
            assert g.finish_reason == "length" and len(g.rounds) == NEW


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n_stages", [1, 2])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("kind", ["other", "target", "self:2", "ngram"])
def test_speculative_greedy_equals_target_only(ckpt, refs, kind, k, n_stages):
    runners = chain(ckpt["target"], n_stages)
    drafter = build(kind, ckpt, runners)
    rounds = []
    for prompt, ref in zip(PROMPTS, refs):
        g = generate(runners, drafter, prompt, max_new_tokens=NEW, k=k)
        assert g.token_ids == ref, f"{kind} K={k} stages={n_stages}"
        assert g.finish_reason == "length"
        assert sum(r.committed for r in g.rounds) == NEW
        assert all(r.committed == r.accepted + 1 and r.accepted <= r.k <= k for r in g.rounds)
        rounds += g.rounds
    if kind == "target":  # every draft accepted: every round commits K drafts + the bonus token
        assert all(r.accepted == r.k for r in rounds)
        assert sum(r.k == k for r in rounds) >= len(rounds) - 2 * len(PROMPTS)
    if kind == "other":  # a random stranger: drafts are proposed and (nearly) all rejected
        assert all(r.k == k for r in rounds[:5]) and sum(r.accepted for r in rounds) < len(rounds)
    if kind in ("self:2", "ngram"):  # partly right: some drafts accepted, some rejected
        assert any(r.accepted >= min(k, 2 if kind == "ngram" else 1) for r in rounds)
        assert any(0 < r.k and r.accepted < r.k for r in rounds)


def test_full_rounds_feed_the_last_draft(ckpt, refs):
    """After a fully accepted round the drafter's next call feeds the K-th draft (no hole in its cache):
    the watch checks the cached K/V against a fresh run every round, here across many full rounds."""
    runners = chain(ckpt["target"], 1)
    watch = build("target", ckpt, runners)
    g = generate(runners, watch, PROMPTS[0], max_new_tokens=NEW, k=4)
    assert g.token_ids == refs[0]
    full = [r for r in g.rounds if r.accepted == r.k == 4]
    assert len(full) >= 6
    starts = [n for n, _ in watch.log]
    assert all(b - a == r.committed for a, b, r in zip(starts, starts[1:], g.rounds))


@pytest.mark.parametrize("n_stages", [1, 2])
@pytest.mark.parametrize("k", [4, 8])
def test_eos_inside_an_accepted_run(ckpt, refs, k, n_stages):
    """EOS = a token greedy produces mid-way, target itself drafting: the EOS is an accepted draft with
    more accepted drafts after it; generation ends right after it, exactly as target-only decoding."""
    ref = refs[0]
    runners = chain(ckpt["target"], n_stages)
    for j in (1, 2, k - 1):
        assert ref[j] not in ref[:j]  # first occurrence, so target-only also stops at j
        eos = {ref[j]}
        plain = generate(runners, NoDrafter(), PROMPTS[0], max_new_tokens=NEW, eos_ids=eos)
        spec = generate(runners, build("target", ckpt, runners), PROMPTS[0], max_new_tokens=NEW, k=k, eos_ids=eos)
        assert plain.token_ids == spec.token_ids == ref[: j + 1]
        assert plain.finish_reason == spec.finish_reason == "eos"
        last = spec.rounds[-1]
        assert len(spec.rounds) == 1 and last.accepted == k > j  # the verdict ran past the EOS and was cut
        assert last.committed == j + 1


def test_eos_as_bonus_token(ckpt, refs):
    k = 4
    ref = refs[0]
    runners = chain(ckpt["target"], 1)
    assert ref[k] not in ref[:k]
    spec = generate(runners, build("target", ckpt, runners), PROMPTS[0], max_new_tokens=NEW, k=k, eos_ids={ref[k]})
    assert spec.token_ids == ref[: k + 1] and spec.finish_reason == "eos"


@pytest.mark.parametrize("k", [4, 8])
def test_max_new_tokens_is_exact(ckpt, refs, k):
    runners = chain(ckpt["target"], 1)
    for n in (1, 2, 3, k, k + 1, k + 2, 2 * k + 3):
        g = generate(runners, build("target", ckpt, runners), PROMPTS[0], max_new_tokens=n, k=k)
        assert g.token_ids == refs[0][:n] and g.finish_reason == "length", n
        assert all(r.k <= k for r in g.rounds)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_a_full_cache_ends_both_at_the_same_token(ckpt, refs, k):
    """When the KV cache runs out before max_new_tokens, speculative decoding stops where target-only does."""
    size = len(PROMPTS[0]) + 23
    runners = [StageRunner(load_stage(str(ckpt["target"]), 0, LAYERS, max_len=size, progress=False))]
    plain = generate(runners, NoDrafter(), PROMPTS[0], max_new_tokens=NEW)
    spec = generate(runners, build("target", ckpt, runners), PROMPTS[0], max_new_tokens=NEW, k=k)
    assert 0 < len(plain.token_ids) < NEW and plain.finish_reason == "length"
    assert spec.token_ids == plain.token_ids == refs[0][: len(plain.token_ids)]
    assert spec.finish_reason == "length"


def test_finish_never_returns_more_than_asked():
    """A verdict may commit more tokens than there is room for; an EOS past the limit does not count."""
    assert finish([7, 8, 9, 2], 3, 5, {2}) == ([7, 8], "length")
    assert finish([7, 2, 9], 3, 5, {2}) == ([7, 2], "eos")
    assert finish([7, 8, 2], 3, 6, {2}) == ([7, 8, 2], "eos")
    assert finish([7, 8], 3, 10, {2}) == ([7, 8], None)
    assert finish([7, 8, 9], 0, 3, set()) == ([7, 8, 9], "length")


def stop_after(seq: list[int], keep: bool = True):
    """A stop callback: cut at the first occurrence of `seq` (keeping it or not). It only looks at the end
    of the output, like a streaming stop-string check, so it relies on being asked after every token."""
    def stop(tokens: list[int]) -> int | None:
        if tokens[-len(seq):] == seq:
            return len(tokens) if keep else len(tokens) - len(seq)
        return None
    return stop


@pytest.mark.parametrize("keep", [True, False])
def test_stop_callback_cuts_exactly(ckpt, refs, keep):
    ref, k = refs[0], 8
    runners = chain(ckpt["target"], 1)
    j = 3
    seq = ref[j : j + 2]
    expected = ref[: j + 2] if keep else ref[:j]
    cases = [dict(), dict(eos_ids={ref[j + 4]}), dict(max_new_tokens=j + 4)]  # alone; EOS or length later in the run
    for extra in cases:
        kw = dict(max_new_tokens=NEW, stop=stop_after(seq, keep)) | extra
        plain = generate(runners, NoDrafter(), PROMPTS[0], **kw)
        spec = generate(runners, build("target", ckpt, runners), PROMPTS[0], k=k, **kw)
        assert plain.token_ids == spec.token_ids == expected, extra
        assert plain.finish_reason == spec.finish_reason == "stop", extra
        assert spec.rounds[-1].accepted > j + 1  # the stop sequence sat inside an accepted run


def test_vocab_mismatch_drafts_only_shared_ids(ckpt, refs):
    """A drafter with twice the vocabulary, whose own argmax is always an id the target does not have."""
    runners = chain(ckpt["target"], 1)
    watch = build("big", ckpt, runners)
    assert watch.d.vocab_limit == VOCAB
    raw = watch.d.stage.step(torch.tensor(PROMPTS[0]))[0].argmax(-1)
    assert (raw >= VOCAB).all()  # unrestricted, it would propose only foreign ids
    for prompt, ref in zip(PROMPTS, refs):
        g = generate(runners, watch, prompt, max_new_tokens=NEW, k=4)
        assert g.token_ids == ref
    assert sum(len(d) for _, d in watch.log) > 0 and all(t < VOCAB for _, d in watch.log for t in d)


def test_smaller_drafter_vocab_survives_foreign_context_ids(ckpt, refs, tmp_path):
    """A drafter whose embedding is smaller than the ids the target emits must not crash the round."""
    small = make_tiny(tmp_path / "small", "qwen3", layers=2, seed=6, vocab=VOCAB // 2)
    assert max(refs[0]) >= VOCAB // 2
    runners = chain(ckpt["target"], 1)
    stage = load_stage(str(small), 0, 2, max_len=MAX_LEN, progress=False)
    d = ModelDrafter(stage, vocab_limit=VOCAB // 2)
    g = generate(runners, d, PROMPTS[0], max_new_tokens=NEW, k=4)
    assert g.token_ids == refs[0]


@settings(max_examples=60, deadline=None)
@given(lo=st.integers(1, 6), span=st.integers(0, 10),
       verdicts=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 16)), max_size=40))
def test_adaptive_k_stays_within_bounds(lo, span, verdicts):
    a = AdaptiveK(k_min=lo, k_max=lo + span)
    for proposed, accepted in verdicts:
        assert lo <= a.choose() <= lo + span
        a.update(proposed, min(accepted, proposed))
    assert lo <= a.choose() <= lo + span


def test_adaptive_k_grows_on_full_and_shrinks_on_zero_acceptance():
    grow, shrink = AdaptiveK(k_min=1, k_max=8), AdaptiveK(k_min=1, k_max=8)
    k0 = grow.choose()
    assert 1 < k0 < 8
    for _ in range(30):
        grow.update(grow.choose(), grow.choose())
        shrink.update(shrink.choose(), 0)
    assert grow.choose() == 8 and shrink.choose() == 1


@pytest.mark.parametrize("kind, alpha, starts, settles", [("target", 0.1, 2, 6), ("other", 0.95, 6, 2)])
def test_adaptive_k_in_generation(ckpt, refs, kind, alpha, starts, settles):
    """K follows acceptance during a real generation (up with the target drafting, down with a stranger),
    within bounds, and the output is unchanged."""
    runners = chain(ckpt["target"], 1)
    adaptive = AdaptiveK(k_min=2, k_max=6, alpha=alpha)
    g = generate(runners, build(kind, ckpt, runners), PROMPTS[0], max_new_tokens=NEW, adaptive=adaptive)
    assert g.token_ids == refs[0]
    assert all(r.k <= 6 for r in g.rounds) and all(r.k >= 2 for r in g.rounds[:-2])
    assert g.rounds[0].k == starts and g.rounds[-3].k == settles


def test_tokenizer_mismatch_is_refused_before_weights_load(ckpt, tmp_path):
    """Same vocabulary size, two ids swapped: refused with a clear message although the drafter's weight
    file is garbage (so nothing was read). The same tokenizer is accepted."""
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(ckpt["other"] / "config.json", bad / "config.json")
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    save_word_tokenizer(bad, VOCAB, swap=(10, 11))
    with pytest.raises(CheckpointError, match="different tokenizer.*2 tokens map to other ids"):
        make_drafter(str(bad), str(ckpt["target"]), progress=False)
    save_word_tokenizer(bad, VOCAB)
    check_same_tokenizer(str(ckpt["target"]), str(bad))  # same tokenizer: accepted
    with pytest.raises(Exception, match="safetensors|header|deserializ"):  # and only then are weights read
        make_drafter(str(bad), str(ckpt["target"]), progress=False)


def test_tokenizer_mismatch_on_a_real_tokenizer(smol_dir, tmp_path):
    """SmolLM2's tokenizer against a copy with a few ids permuted, and against an unrelated tokenizer."""
    same, permuted, foreign = tmp_path / "same", tmp_path / "permuted", tmp_path / "foreign"
    for d in (same, permuted):
        d.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smol_dir / name, d / name)
    check_same_tokenizer(str(smol_dir), str(same))
    spec = json.loads((permuted / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    names = sorted(vocab, key=vocab.get)[1000:1003]  # rotate three ordinary tokens' ids
    ids = [vocab[n] for n in names]
    for n, i in zip(names, ids[1:] + ids[:1]):
        vocab[n] = i
    (permuted / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(CheckpointError, match=r"different tokenizer than target .*3 tokens map to other ids"):
        check_same_tokenizer(str(smol_dir), str(permuted))
    foreign.mkdir()
    save_word_tokenizer(foreign, 300)
    with pytest.raises(CheckpointError, match="pick a drafter of the same family"):
        check_same_tokenizer(str(smol_dir), str(foreign))
    with pytest.raises(CheckpointError, match="only one of target .* has a tokenizer"):
        check_same_tokenizer(str(smol_dir), str(tmp_path))


SMOL_PROMPTS = ["Write a Python function that returns the n-th Fibonacci number, with a docstring.",
                "Explain in three sentences why the sky is blue."]


@pytest.mark.timeout(900)
def test_smollm2_speculative_equals_target_only(smol_dir):
    """Real weights: self:L and n-gram drafting reproduce target-only greedy over 48 tokens of chat, and a
    short answer ends on <|im_end|> exactly where target-only decoding ends."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False)) for q in SMOL_PROMPTS]
    runners = [StageRunner(load_stage(str(smol_dir), 0, 30, max_len=256, progress=False))]
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}

    def run(spec, ids, k, n):
        d = make_drafter(spec, str(smol_dir), runners[0].stage, max_len=256, progress=False)
        d = CacheWatch(d, limit=len(tok), fresh=False) if isinstance(d, ModelDrafter) else d
        return generate(runners, d, ids, max_new_tokens=n, k=k, eos_ids=eos)

    for ids, plans in zip(chat, [[("self:6", 4), ("ngram", 8)], [("self:4", 8), ("ngram", 4)]]):
        ref = run("none", ids, 1, 48)
        assert len(ref.token_ids) == 48
        for spec, k in plans:
            g = run(spec, ids, k, 48)
            assert g.token_ids == ref.token_ids, (spec, k, tok.decode(g.token_ids), tok.decode(ref.token_ids))
            assert g.finish_reason == ref.finish_reason
    short = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}],
        add_generation_prompt=True, tokenize=False))
    ref = run("none", short, 1, 40)
    assert ref.finish_reason == "eos" and ref.token_ids[-1] in eos
    for spec, k in [("ngram", 8), ("self:4", 4)]:
        g = run(spec, short, k, 40)
        assert g.token_ids == ref.token_ids and g.finish_reason == "eos"
