"""SGLang interop: routed_experts decoding, dense-layer skipping, partial rollouts."""
import base64

import numpy as np
import pytest

from moe_rl.replay import (RoutingSpec, decode_routed_experts, merge_partial, moe_layer_indices,
                           record_from_responses)


def test_moe_layer_rule():
    assert moe_layer_indices(4) == [0, 1, 2, 3]
    assert moe_layer_indices(6, mlp_only_layers=[0, 3]) == [1, 2, 4, 5]
    assert moe_layer_indices(6, decoder_sparse_step=2) == [1, 3, 5]
    assert moe_layer_indices(6, [1], decoder_sparse_step=2) == [3, 5]
    assert moe_layer_indices(6, num_experts=0) == []
    assert moe_layer_indices(6, first_k_dense_replace=2) == [2, 3, 4, 5]  # GLM / DeepSeek-V3
    glm = RoutingSpec.from_hf_config({"num_hidden_layers": 46, "n_routed_experts": 128, "num_experts_per_tok": 8,
                                      "first_k_dense_replace": 1})
    assert glm.moe_layers == tuple(range(1, 46)) and glm.num_experts == 128
    spec = RoutingSpec.from_hf_config({"num_hidden_layers": 48, "num_experts": 128,
                                       "num_experts_per_tok": 8, "mlp_only_layers": [],
                                       "decoder_sparse_step": 1})
    assert spec.num_moe_layers == 48 and spec.top_k == 8
    mixtral = RoutingSpec.from_hf_config({"num_hidden_layers": 4, "num_local_experts": 8,
                                          "num_experts_per_tok": 2})
    assert mixtral.moe_layers == (0, 1, 2, 3)


SPEC = RoutingSpec(num_hidden_layers=5, top_k=2, num_experts=8, mlp_only_layers=(0, 3))


def wire(seqlen, seed=0, dense_fill=-1):
    """What SGLang sends: int32 [seqlen-1, all layers, top_k], dense layers garbage."""
    rng = np.random.default_rng(seed)
    full = np.argsort(rng.random((seqlen - 1, 5, 8)), axis=-1)[..., :2].astype(np.int32)
    full[:, [0, 3]] = dense_fill
    return full, base64.b64encode(full.tobytes()).decode()


def test_decode_skips_dense_layers():
    for fill in (-1, 0, 12345):
        full, b64 = wire(10, dense_fill=fill)
        got = decode_routed_experts(b64, SPEC, num_tokens=10)
        assert got.dtype == np.int32 and got.shape == (9, 3, 2)
        assert np.array_equal(got, full[:, [1, 2, 4]])
    assert np.array_equal(decode_routed_experts(full, SPEC), full[:, [1, 2, 4]])


def test_decode_rejects_bad_rows():
    full, _ = wire(10)
    bad = full.copy()
    bad[4, 2, 1] = -1
    with pytest.raises(ValueError, match=r"token row 4, layer 2, slot 1 has expert id -1"):
        decode_routed_experts(base64.b64encode(bad.tobytes()), SPEC)
    bad = full.copy()
    bad[6, 4, 0] = 8
    with pytest.raises(ValueError, match=r"token row 6, layer 4, slot 0 has expert id 8"):
        decode_routed_experts(bad, SPEC)
    bad = full.copy()
    bad[2, 1] = 0  # all-zero row: capture did not happen
    with pytest.raises(ValueError, match=r"token row 2, layer 1 repeats"):
        decode_routed_experts(bad, SPEC)
    with pytest.raises(ValueError, match="9 rows, expected 10"):
        decode_routed_experts(full, SPEC, num_tokens=11)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_routed_experts(full.reshape(-1)[:-2], SPEC)
    with pytest.raises(ValueError, match="base64"):
        decode_routed_experts("not base64!!", SPEC)


def test_merge_partial_keeps_earliest_rows():
    # prompt 5, first segment generates 3 (aborted), second gets prompt 8 and generates 4.
    a = np.full((5 + 3 - 1, 3, 2), 1)  # rows for positions 0..6
    b = np.full((8 + 4 - 1, 3, 2), 2)  # rows for positions 0..10, 0..6 re-forwarded
    m = merge_partial([a, b], num_tokens=12)
    assert m.shape == (11, 3, 2)
    assert (m[:7] == 1).all() and (m[7:] == 2).all()
    # SGLang's routed_experts_start_len: the second response covers [7, 11) only
    m2 = merge_partial([a, b[7:]], starts=[0, 7], num_tokens=12)
    assert np.array_equal(m, m2)
    # a resumed segment that produced nothing adds nothing
    assert np.array_equal(merge_partial([a, np.full((7, 3, 2), 3)]), a)
    with pytest.raises(ValueError, match="tokens \\[7, 9\\) are not covered"):
        merge_partial([a, b[9:]], starts=[0, 9])
    with pytest.raises(ValueError, match="expected 12"):
        merge_partial([a, b], num_tokens=13)
    with pytest.raises(ValueError, match="before"):
        merge_partial([b, a])


def test_record_from_responses_partial_rollout():
    f1, b1 = wire(8, seed=1)   # prompt 5 + 3 generated
    f2, b2 = wire(12, seed=2)  # prompt 8 (5 + 3) + 4 generated
    metas = [{"routed_experts": b1, "prompt_tokens": 5, "completion_tokens": 3},
             {"routed_experts": b2, "prompt_tokens": 8, "completion_tokens": 4}]
    got = record_from_responses(metas, SPEC, num_tokens=12)
    want = np.concatenate([f1[:, [1, 2, 4]], f2[7:, [1, 2, 4]]])
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="response 1 routed_experts: 11 rows, expected 10"):
        record_from_responses([metas[0], {**metas[1], "completion_tokens": 3}], SPEC)
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        record_from_responses([{"prompt_tokens": 3}], SPEC)
