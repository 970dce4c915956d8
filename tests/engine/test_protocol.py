"""Protocol helpers and the SGLang launch command (no server)."""
import numpy as np
import pytest

from moe_rl.config import load_config
from moe_rl.engine.protocol import (
    GenerateRequest, RequestError, SamplingParams, decode_routed_experts, encode_routed_experts,
    token_weight_versions, version_spans,
)
from moe_rl.engine.sglang import sglang_command

from .helpers import CONFIG


def test_routed_experts_roundtrip_and_versions():
    rows = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2)
    assert (decode_routed_experts(encode_routed_experts(rows), 3, 2) == rows).all()
    assert (decode_routed_experts({"meta_info": {"routed_experts": encode_routed_experts(rows)}}, 3, 2) == rows).all()
    spans = version_spans(["0", "0", "1"])
    assert spans == [{"version": "0", "start": 0, "end": 2}, {"version": "1", "start": 2, "end": 3}]
    assert token_weight_versions({"weight_versions": spans}) == ["0", "0", "1"]
    assert token_weight_versions({"weight_versions": [["a", 0, 1], ["b", 1, 3]]}) == ["a", "b", "b"]


def test_sampling_params_follow_sglang():
    sp = SamplingParams.parse({"temperature": 0, "max_new_tokens": 4, "stop_token_ids": [3], "min_p": 0.0})
    assert sp.greedy and sp.logprob_temperature == 1.0 and sp.stop_token_ids == {3}
    assert SamplingParams.parse(None).max_new_tokens == 128
    with pytest.raises(RequestError, match="sampling_params.top_k"):
        SamplingParams.parse({"top_k": 0})
    with pytest.raises(RequestError, match="sampling_params.n"):  # n > 1 is not implemented
        SamplingParams.parse({"n": 2})
    with pytest.raises(RequestError, match="routed_experts_start_len"):
        GenerateRequest.parse({"input_ids": [1, 2], "routed_experts_start_len": 3}, vocab_size=8, max_context=16)


def test_sglang_command_has_ep_and_routed_experts():
    cfg = load_config(CONFIG, ["engine.kind=sglang", "engine.sglang_model_path=/ckpt/Qwen3-30B-A3B",
                               "engine.sglang_ep_size=8", "engine.sglang_tp_size=8", "engine.port=30000",
                               "engine.api_key=k"])
    cmd = sglang_command(cfg)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag, value in [("--model-path", "/ckpt/Qwen3-30B-A3B"), ("--ep-size", "8"), ("--tp-size", "8"),
                        ("--port", "30000"), ("--api-key", "k")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enable-return-routed-experts" in cmd and "--skip-tokenizer-init" in cmd
    assert cmd[cmd.index("--max-queued-requests") + 1] == "4096"  # engine.max_waiting_requests
    cfg.engine.max_waiting_requests = None  # no bound: SGLang's default, no flag
    assert "--max-queued-requests" not in sglang_command(cfg)


def test_frozen_list_encodes_once_and_stays_a_list():
    import json
    import pickle

    import pytest

    from moe_rl.engine.protocol import FrozenList, dumps_body

    names = FrozenList(["model.a.weight", "model.b.weight"])
    shapes = FrozenList([[2, 3], [4]])
    body = {"names": names, "shapes": shapes, "group_name": "g", "weight_version": "7", "flush_cache": False}
    assert dumps_body(body) == json.dumps(body)  # the same text json.dumps gives
    assert json.loads(dumps_body(body))["shapes"] == [[2, 3], [4]]
    assert names.json() is names.json()  # made once
    for change in (lambda: names.append("x"), lambda: names.__setitem__(0, "x"), lambda: names.extend(["x"])):
        with pytest.raises(TypeError, match="read-only"):
            change()
    back = pickle.loads(pickle.dumps(names))  # the local engine transport pickles requests
    assert type(back) is FrozenList and back == ["model.a.weight", "model.b.weight"]


def test_serve_dry_run_prints_the_command_of_a_cluster_config_without_its_model(capsys):
    """``moe-rl serve CONFIG --dry-run`` prints the SGLang line for the machine that holds the
    model (docs/multinode.md): the model directory need not exist where it is printed."""
    from pathlib import Path

    from moe_rl.cli import main

    root = Path(__file__).resolve().parents[2]
    assert not Path("/models/Qwen3-30B-A3B").exists()
    assert main(["serve", str(root / "configs" / "qwen3_30b_a3b_2x8.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out.split()
    assert out[out.index("--model-path") + 1] == "/models/Qwen3-30B-A3B" and "--ep-size" in out
