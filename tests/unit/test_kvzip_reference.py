"""experiments/kvzip.py: KVzip's selections in the transformers reference keep what they say they keep."""
import pytest

torch = pytest.importorskip("torch", reason="optional: torch (the experiments extra) runs the KVzip reference")

from experiments.kvzip import MaskedAttention, select  # noqa: E402


def _scores(L=3, H=2, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(H, n, generator=g) for _ in range(L)]


def test_global_keeps_the_top_share_over_every_layer_and_head():
    scores = _scores()
    keep = select(scores, 0.25, "global", sinks=2)
    s = torch.stack(scores)
    kept = torch.stack(keep)
    assert int(kept.sum()) == 10 * 3 * 2
    assert kept[:, :, :2].all()  # sinks
    rest = s[:, :, 2:]
    # every kept non-sink triple scores at least as high as every dropped one
    assert rest[kept[:, :, 2:]].min() >= rest[~kept[:, :, 2:]].max()
    # and the heads keep different counts (the point of the global rule)
    assert len(set(kept.sum(dim=2).flatten().tolist())) > 1


def test_head_keeps_the_same_count_per_head_by_its_own_scores():
    scores = _scores()
    keep = select(scores, 0.25, "head", sinks=2)
    for layer, k in zip(scores, keep):
        assert k.sum(dim=1).tolist() == [10, 10]
        for h in range(2):
            own = layer[h, 2:]
            assert own[k[h, 2:]].min() >= own[~k[h, 2:]].max()


@pytest.mark.parametrize("how, reduce", [("token-max", "amax"), ("token-sum", "sum")])
def test_token_selections_keep_whole_entries(how, reduce):
    scores = _scores()
    keep = torch.stack(select(scores, 0.25, how, sinks=0))
    assert (keep == keep[0, 0]).all()  # one set for every layer and head
    tok = getattr(torch.stack(scores), reduce)(dim=(0, 1))
    assert set(torch.nonzero(keep[0, 0]).flatten().tolist()) == set(tok.topk(10).indices.tolist())


def test_masked_attention_records_the_largest_probability_and_masks_per_head():
    class Module:
        layer_idx, num_key_value_groups = 0, 2

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g),
               torch.randn(1, 2, 6, 8, generator=g))
    attn = MaskedAttention(1)
    attn.n_ctx, attn.record = 5, True
    attn.attend(Module(), q, k, v, None, 0.5)
    kk = k.repeat_interleave(2, dim=1)
    p = torch.softmax(q @ kk.transpose(2, 3) * 0.5, dim=-1)[0]  # [4 heads, 3 queries, 6 keys]
    want = p.view(2, 2, 3, 6).amax(dim=(1, 2))[:, :5]
    assert torch.allclose(attn.scores[0], want, atol=1e-6)

    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 3] = False  # KV head 1 drops entry 3; head 0 keeps it
    attn.record, attn.keep = False, [keep]
    out, _ = attn.attend(Module(), q, k, v, None, 0.5)
    w = q @ kk.transpose(2, 3) * 0.5
    w[:, 2:, :, 3] = float("-inf")  # query heads 2-3 read KV head 1
    ref = (torch.softmax(w, dim=-1) @ v.repeat_interleave(2, dim=1)).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-5)
