"""The compact decoder against `transformers`: parity per family (whole and cut into stages), rewind,
token trees, the static KV cache, and greedy decoding on real SmolLM2 weights."""
from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, make_tiny
from kit.draft import NoDrafter
from kit.generate import generate
from kit.graphs import StageRunner
from kit.load import load_config, load_stage
from kit.model import chain_mask



@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield

LAYERS = 4
SPLITS = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
CASES = [(f, tie) for f in FAMILIES for tie in (False, True)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(family, tie) -> checkpoint folder, written once per module."""
    made = {}

    def get(family: str, tie: bool):
        if (family, tie) not in made:
            made[family, tie] = make_tiny(tmp_path_factory.mktemp(f"{family}-{tie}"), family, tie=tie, layers=LAYERS)
        return made[family, tie]

    return get


def chain(path, n_stages: int, max_len: int = 64):
    return [load_stage(str(path), a, b, max_len=max_len, progress=False) for a, b in SPLITS[n_stages]]


def run(stages, ids, tree_parents=None) -> torch.Tensor:
    """Feed token ids through the stages in order; logits [T, V]."""
    x = torch.as_tensor(ids)
    for s in stages:
        x = s.step(x, tree_parents=tree_parents)
    return x[0]


def hf_reference(path, chunks: list[list[int]]) -> list[torch.Tensor]:
    """Logits of `transformers` for each chunk, appended one after another to its KV cache."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cache, out = DynamicCache(), []
    for c in chunks:
        out.append(model(torch.tensor([c]), cache=cache, use_cache=True).logits[0])
    assert cache.get_seq_length() == sum(map(len, chunks))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family,tie", CASES)
def test_parity_with_transformers_whole_and_staged(tiny, family, tie):
    path = tiny(family, tie)
    cfg = load_config(str(path))
    assert cfg.tie_embeddings == tie and cfg.n_layers == LAYERS
    g = torch.Generator().manual_seed(1)
    # prefill, three single-token decode steps, then a 3-token verify-style chunk
    chunks = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (12, 1, 1, 1, 3)]
    want = hf_reference(path, chunks)
    for n_stages in (1, 2, 3):
        stages = chain(path, n_stages)
        assert [s.first for s in stages] == [True] + [False] * (n_stages - 1)
        assert [s.last for s in stages] == [False] * (n_stages - 1) + [True]
        for i, (c, ref) in enumerate(zip(chunks, want)):
            got = run(stages, c)
            diff = (got - ref).abs().max().item()
            assert diff <= 1e-4, f"{n_stages} stage(s), chunk {i}: max abs diff {diff:.2e}"
        assert [s.length for s in stages] == [sum(map(len, chunks))] * n_stages


@pytest.mark.parametrize("full_width_mask", [False, True], ids=["step", "graph-style-mask"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rewind_then_append_equals_fresh_run(tiny, family, full_width_mask):
    """Prefill, append 5, rewind 3, append others: same logits as a fresh run of the final sequence.
    With `full_width_mask` the other tokens go through `Stage.forward` one at a time with a mask over
    all max_len slots (as the CUDA-graph path does), so the 3 stale slots are attended unless masked."""
    path = tiny(family, False)
    g = torch.Generator().manual_seed(2)
    prefix, appended, other = (torch.randint(3, 256, (n,), generator=g).tolist() for n in (10, 5, 4))
    stages = chain(path, 2)
    run(stages, prefix)
    run(stages, appended)
    n = len(prefix) + 2
    for s in stages:
        s.rewind(n)
    if full_width_mask:
        got = []
        for i, tok in enumerate(other):
            x, at = torch.tensor([tok]), torch.tensor([n + i])
            mask = chain_mask(n + i, 1, stages[0].max_len)
            for s in stages:
                x = s(x, at, at, mask)
            got.append(x[0, 0])
        got = torch.stack(got)
    else:
        got = run(stages, other)
    final = prefix + appended[:2] + other
    fresh = run(chain(path, 2), final)[-len(other):]
    diff = (got - fresh).abs().max().item()
    assert diff <= 1e-5, f"max abs diff {diff:.2e}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_token_tree_matches_each_root_to_node_chain(tiny, family):
    #        prefix
    #        /    \
    #       0      6
    #      / \
    #     1   2
    #    / \   \
    #   3   4   5
    parents = [-1, 0, 0, 1, 1, 2, -1]
    path = tiny(family, True)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 256, (9,), generator=g).tolist()
    nodes = torch.randint(3, 256, (len(parents),), generator=g).tolist()
    stages = chain(path, 2)
    run(stages, prefix)
    tree = run(stages, nodes, tree_parents=parents)
    assert [s.length for s in stages] == [len(prefix) + len(nodes)] * 2
    for i in range(len(nodes)):
        route, j = [], i
        while j >= 0:
            route.insert(0, nodes[j])
            j = parents[j]
        for s in stages:
            s.setup_cache(s.max_len)  # a fresh cache
        run(stages, prefix)
        want = run(stages, route)[-1]
        diff = (tree[i] - want).abs().max().item()
        assert diff <= 1e-5, f"node {i} (path {route}): max abs diff {diff:.2e}"


def test_static_cache_is_never_reallocated(tiny):
    stages = chain(tiny("qwen2", False), 2, max_len=32)
    s0, s1 = stages

    def ptrs():
        return [(t.data_ptr(), tuple(t.shape)) for s in stages for t in (*s.k_caches, *s.v_caches)]

    before = ptrs()
    assert len(before) == 2 * LAYERS and all(shape[2] == 32 for _, shape in before)
    run(stages, list(range(3, 13)))
    assert [s.length for s in stages] == [10, 10]
    run(stages, [20])
    run(stages, [21, 22, 23], tree_parents=[-1, 0, 0])
    assert s0.length == s1.length == 14
    s0.rewind(11), s1.rewind(11)
    assert s0.length == 11
    x = torch.tensor([30, 31])  # forward alone writes slots but leaves the length to the caller
    for s in stages:
        at = torch.arange(11, 13)
        x = s(x, at, at, chain_mask(11, 2, 13))
    assert s0.length == s1.length == 11
    runners = [StageRunner(s) for s in stages]
    h = runners[0](torch.tensor([40, 41, 42]), 5)
    runners[1](h, 5)
    assert s0.length == s1.length == 8
    assert ptrs() == before

    for bad in (33, -1):
        with pytest.raises(ValueError, match=f"cannot rewind to {bad}: cache holds 32 slots"):
            s0.rewind(bad)
    assert s0.length == 8  # a refused rewind leaves the cache as it was
    s0.rewind(30)
    with pytest.raises(ValueError, match=r"KV cache full: 30 \+ 3 tokens > 32 slots"):
        s0.step(torch.tensor([1, 2, 3]))
    assert s0.length == 30
    s0.rewind(32)  # rewinding to exactly max_len is legal: a full cache
    assert ptrs() == before


@pytest.mark.timeout(300)
def test_smollm2_greedy_matches_transformers_generate(smol_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a robot."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    hf = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=32, pad_token_id=tok.eos_token_id)
    want = out[0, len(prompt):].tolist()
    del hf, out
    assert len(want) == 32, "the reference stopped early; pick a prompt with a longer answer"

    cfg = load_config(str(smol_dir))
    # two stages, through the same loop (and stage runner) the distributed runtime drives
    stages = [load_stage(str(smol_dir), a, b, max_len=128, progress=False) for a, b in [(0, 15), (15, cfg.n_layers)]]
    got = generate([StageRunner(s) for s in stages], NoDrafter(), prompt, max_new_tokens=32,
                   eos_ids=set(cfg.eos_token_ids))
    assert got.token_ids == want, f"2 stages: {tok.decode(got.token_ids)!r} != {tok.decode(want)!r}"
    assert got.finish_reason == "length" and len(got.rounds) == 32
    del stages
    # one stage, in one pass: greedy decoding yields `want` exactly when every position's argmax,
    # given the prompt and the tokens before it, is the next token of `want`
    whole = load_stage(str(smol_dir), 0, cfg.n_layers, max_len=128, progress=False)
    logits = whole.step(torch.tensor(prompt + want[:-1]))[0, len(prompt) - 1:]
    assert logits.argmax(-1).tolist() == want
