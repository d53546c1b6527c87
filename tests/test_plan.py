"""Stage planning and the memory estimator, from configs alone (no weights)."""
import pytest

from kit.model import ModelConfig, Stage
from kit.plan import (GiB, T4_BYTES, PlanError, estimate_kv, estimate_weights, format_plan, layer_devices,
                      nf4_bytes, plan_stages)


def qwen2(hidden, inter, layers, heads, kv, vocab, tied=False):
    return ModelConfig.from_hf(dict(model_type="qwen2", hidden_size=hidden, intermediate_size=inter,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                    vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=32768))


Q7 = qwen2(3584, 18944, 28, 28, 4, 152064)
Q14 = qwen2(5120, 13824, 48, 40, 8, 152064)
Q05 = qwen2(896, 4864, 24, 14, 2, 151936, tied=True)


def test_qwen25_7b_parameter_count():
    # Qwen2.5-7B has 7.62e9 parameters (model card); embedding and head are separate (untied).
    assert estimate_weights(Q7, 0, 28, True, True, dtype_bytes=1) == 7_615_616_512


def test_7b_two_stages_within_8_gib_each():
    plans = plan_stages(Q7, 2, kv_len=4096)
    assert [(p.start, p.end) for p in plans] == [(0, 14), (14, 28)]
    for p in plans:
        # The budget is for the target part: weights + 4096-token KV, no overhead, no drafter.
        assert p.weights + p.kv <= 8 * GiB
        assert p.kv == estimate_kv(Q7, 14, 4096) == 2 * 14 * 4 * 128 * 4096 * 2
        # With the per-GPU overhead it still fits one T4 with room to spare.
        assert p.total <= T4_BYTES
    assert abs(plans[0].weights - plans[1].weights) < 0.01 * GiB  # embedding vs norm + head


def test_14b_fp16_refused_on_two_t4():
    with pytest.raises(PlanError) as e:
        plan_stages(Q14, 2, kv_len=4096, gpus_per_node=1)
    msg = str(e.value)
    assert "does not fit" in msg and "GiB short" in msg and "holds 14.74 GiB" in msg
    for fix in ("more stages", "cuda:0,cuda:1", "--load-in-4bit", "shorter KV cache"):
        assert fix in msg


def test_14b_fits_on_four_t4_or_in_nf4():
    four = plan_stages(Q14, 2, kv_len=4096, gpus_per_node=2)
    assert [len(p.devices) for p in four] == [2, 2]
    nf4 = plan_stages(Q14, 2, kv_len=4096, gpus_per_node=1, load_in_4bit=True)
    for plans in (four, nf4):
        assert all(m.total <= T4_BYTES for p in plans for m in p.memory.values())
    # NF4 with the drafter on node 0 also fits one T4 per node.
    plan_stages(Q14, 2, load_in_4bit=True, draft_cfg=Q05)
    # Already quantised and still too big: the message stops suggesting NF4.
    with pytest.raises(PlanError) as e:
        plan_stages(Q14, 2, load_in_4bit=True, gpu_bytes=4 * GiB)
    assert "--load-in-4bit" not in str(e.value)


def test_node0_with_drafter_fits_two_t4_and_says_where():
    plans = plan_stages(Q7, 2, kv_len=4096, gpus_per_node=2, draft_cfg=Q05, draft_kv_len=4096)
    p0 = plans[0]
    assert p0.devices == ["cuda:0", "cuda:1"]
    assert p0.draft_device in p0.devices
    assert p0.memory[p0.draft_device].draft > 1 * GiB  # 0.5B in fp16, its own copy of the tied head
    assert all(m.total <= T4_BYTES for m in p0.memory.values())
    devs = layer_devices(p0)
    assert len(devs) == 14 and set(devs) == {"cuda:0", "cuda:1"} and devs == sorted(devs)
    table = format_plan(plans)
    assert "cuda:1" in table and "drafter" in table
    # One T4 per node also holds it.
    one = plan_stages(Q7, 2, kv_len=4096, gpus_per_node=1, draft_cfg=Q05)
    assert one[0].draft_device == "cuda:0" and one[0].total <= T4_BYTES


def test_gpus_balanced_within_a_node():
    p = plan_stages(Q14, 2, gpus_per_node=2)[0]
    totals = [m.total for m in p.memory.values()]
    layer = estimate_weights(Q14, 0, 1, False, False) + estimate_kv(Q14, 1, 4096)
    assert max(totals) - min(totals) <= layer  # no layer could move to even it further
    (d0, a0, b0), (d1, a1, b1) = p.device_layers
    assert (a0, b1) == (0, 24) and b0 == a1 and b0 - a0 < b1 - a1  # cuda:0 also holds the embedding


def assert_partition(plans, n):
    assert plans[0].start == 0 and plans[-1].end == n
    for a, b in zip(plans, plans[1:]):
        assert a.end == b.start
    assert sorted(i for p in plans for _, s, e in p.device_layers for i in range(s, e)) == list(range(n))
    assert [p.first for p in plans] == [True] + [False] * (len(plans) - 1)
    assert [p.last for p in plans] == [False] * (len(plans) - 1) + [True]


def test_budgets_split_in_proportion():
    plans = plan_stages(Q7, 3, budgets=[2 * T4_BYTES, T4_BYTES, 8 * GiB], gpus_per_node=2)
    assert_partition(plans, 28)
    sizes = [p.end - p.start for p in plans]
    assert sizes[0] > sizes[1] > sizes[2]
    for p in plans:
        assert all(m.total <= p.gpu_bytes for m in p.memory.values())
    # Equal budgets: node 0 also carries the drafter, so it takes fewer layers than the last node.
    eq = plan_stages(Q7, 2, budgets=[T4_BYTES] * 2, draft_cfg=Q05)
    assert_partition(eq, 28)
    assert eq[0].end - eq[0].start < eq[1].end - eq[1].start
    with pytest.raises(PlanError, match="short"):
        plan_stages(Q7, 2, budgets=[4 * GiB, 4 * GiB])


@pytest.mark.parametrize("n_stages", [1, 2, 3, 5, 28])
def test_even_split_covers_every_layer(n_stages):
    plans = plan_stages(Q7, n_stages, gpu_bytes=100 * GiB, gpus_per_node=2)
    assert_partition(plans, 28)
    sizes = [p.end - p.start for p in plans]
    assert max(sizes) - min(sizes) <= 1


def test_bad_requests():
    with pytest.raises(PlanError, match="cannot split 28 layers into 29"):
        plan_stages(Q7, 29)
    with pytest.raises(PlanError, match="one per node"):
        plan_stages(Q7, 2, budgets=[T4_BYTES])


TINY = {
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=24),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", num_key_value_heads=4),
}


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("start,end,first,last", [(0, 2, True, False), (2, 4, False, False), (4, 6, False, True),
                                                  (0, 6, True, True)])
def test_estimate_matches_real_stage(family, start, end, first, last):
    cfg = ModelConfig.from_hf({"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 6,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, **TINY[family]})
    stage = Stage(cfg, start, end, first=first, last=last)
    assert estimate_weights(cfg, start, end, first, last, dtype_bytes=4) == sum(
        p.numel() * p.element_size() for p in stage.parameters())
    stage.half()
    assert estimate_weights(cfg, start, end, first, last, dtype_bytes=2) == sum(
        p.numel() * p.element_size() for p in stage.parameters())


def test_nf4_bytes():
    # 4-bit codes + uint8 absmax per 64 + fp32 absmax per 64*256: 4.127 bits per weight.
    n = 5120 * 13824
    assert nf4_bytes(n) == n // 2 + n // 64 + 4 * (n // 64 // 256)
    assert abs(nf4_bytes(n) * 8 / n - (4 + 8 / 64 + 32 / 16384)) < 1e-9
    # Only the decoder's linear weights shrink: embedding, norms, biases and head stay 16-bit.
    embed_head = estimate_weights(Q14, 0, 0, True, True)
    assert estimate_weights(Q14, 0, 48, True, True, load_in_4bit=True) - embed_head == \
        estimate_weights(Q14, 0, 48, False, False, load_in_4bit=True)
    assert embed_head == (2 * 152064 * 5120 + 5120) * 2
    ratio = estimate_weights(Q14, 0, 1, False, False) / estimate_weights(Q14, 0, 1, False, False, load_in_4bit=True)
    assert 3.8 < ratio < 3.9
