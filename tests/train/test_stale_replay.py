"""Routing replay at staleness > 0 (train/loop.py's replay_rows): a stale sequence is routed by
the trainer itself, a fresh one replays the engine's routing; checked against per-sequence
forwards of a plain model (each sequence alone, replayed or not)."""
import torch

from moe_rl.model.arch import MoEArch
from moe_rl.model.transformer import MoEForCausalLM
from moe_rl.train.loop import replay_rows, stale_rows


def _model():
    arch = MoEArch(vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    return MoEForCausalLM(arch).init_weights(seed=0, std=0.5).eval()


def test_replay_rows_splices_per_sequence():
    cu = torch.tensor([0, 3, 5, 9])
    engine = [torch.full((9, 2), 1), torch.full((9, 2), 2)]
    own = [torch.full((9, 2), 7), torch.full((9, 2), 8)]
    got = replay_rows(engine, own, [True, False, True], stale_rows([True, False, True], cu))
    for layer, (e, o) in enumerate(zip(engine, own)):
        want = torch.cat([e[0:3], o[3:5], e[5:9]])  # plain: sequence by sequence
        assert torch.equal(got[layer], want)
    assert replay_rows(engine, None, [True, True, True], stale_rows([True, True, True], cu)) is engine
    assert replay_rows(engine, None, [False, False, False], stale_rows([False, False, False], cu)) is None


@torch.no_grad()
def test_spliced_forward_matches_each_sequence_alone():
    model = _model()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 32, (n,), generator=g) for n in (5, 7, 4)]
    fresh = [False, True, False]
    cu = torch.tensor([0, 5, 12, 16])
    ids = torch.cat(seqs)[None]
    # the "engine's" routing: some other policy's choices (a differently seeded model)
    other = MoEForCausalLM(model.arch).init_weights(seed=9, std=0.5).eval()
    engine = []
    other.hidden_states(ids, cu_seqlens=cu, record=engine)
    own = []
    model.hidden_states(ids, cu_seqlens=cu, record=own)
    assert not all(torch.equal(a, b) for a, b in zip(engine, own))  # the two routings differ
    logits = model(ids, cu_seqlens=cu, replay=replay_rows(engine, own, fresh, stale_rows(fresh, cu)))[0]
    for i, (s, f) in enumerate(zip(seqs, fresh)):
        a, b = int(cu[i]), int(cu[i + 1])
        rep = [e[a:b] for e in engine] if f else None
        alone = model(s[None], replay=rep)[0]
        torch.testing.assert_close(logits[a:b], alone, rtol=1e-5, atol=1e-5)
