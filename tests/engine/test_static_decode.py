"""The static-shape decode step (moe_rl/engine/decode.py) against the engine's dynamic one, and
the CUDA-graph capture/replay logic run on the CPU with a stand-in for torch.cuda.CUDAGraph."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_rl.config import ConfigError, load_config
from moe_rl.engine import decode_routed_experts, output_logprobs
from moe_rl.engine.decode import context_sizes, decode_batch_sizes, host_reads, pad_to_bucket
from moe_rl.engine.engine import Engine
from moe_rl.engine.server import EngineServer, build_engine, build_model

from .helpers import ARCH, CFG, CONFIG, OVERRIDES, K, L, generate_queued

V = ARCH.vocab_size
SAMPLING = [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.0},
            {"temperature": 1.0, "top_k": 5}, {"temperature": 0.8, "min_p": 0.1, "frequency_penalty": 0.5},
            {"temperature": 1.3, "top_p": 0.8, "top_k": 20}]


@pytest.fixture(scope="module")
def model():
    return build_model(CFG)


def generate(engine: Engine, n: int = 10) -> list[dict]:
    """``n`` requests of different prompt and output lengths (so the running batch shrinks
    step by step, and contexts cross the 64- and 128-token spans), every sampling mode,
    log-probs, top log-probs and routing asked for; queued before the engine starts."""
    return generate_queued(engine, [
        {"input_ids": [(7 * i + 3 * j + 1) % V for j in range(3 + 9 * i)], "return_logprob": True,
         "return_routed_experts": True, "top_logprobs_num": 2 if i % 3 == 0 else 0,
         "sampling_params": {**SAMPLING[i % len(SAMPLING)], "max_new_tokens": 6 + 5 * i, "sampling_seed": i}}
        for i in range(n)])


def assert_same(a: list[dict], b: list[dict], atol: float) -> None:
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        np.testing.assert_allclose(output_logprobs(y["meta_info"]), output_logprobs(x["meta_info"]), rtol=0, atol=atol)
        np.testing.assert_array_equal(decode_routed_experts(y, L, K), decode_routed_experts(x, L, K))
        if "output_top_logprobs" in x["meta_info"]:
            tx, ty = x["meta_info"]["output_top_logprobs"], y["meta_info"]["output_top_logprobs"]
            assert [[t for _, t, _ in row] for row in tx] == [[t for _, t, _ in row] for row in ty]


def test_buckets_are_sglangs():
    from tests.sglang.conftest import require_sglang

    # skipped only where the sglang wheel is absent (the GPU image)
    generate_decode_cuda_graph_batch_sizes = require_sglang(
        "sglang.srt.arg_groups.cuda_graph_hook").generate_decode_cuda_graph_batch_sizes
    args = types.SimpleNamespace(disable_cuda_graph_padding=False, speculative_algorithm=None)
    for max_bs in (1, 6, 100, 256, 300, 1000):
        assert decode_batch_sizes(max_bs) == generate_decode_cuda_graph_batch_sizes(args, max_bs)
    assert context_sizes(256) == [64, 128, 256] and context_sizes(300) == [64, 128, 256, 300]
    assert context_sizes(40) == [40]
    assert [pad_to_bucket(n, [1, 2, 4, 8]) for n in (1, 3, 4, 5, 8)] == [1, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="exceeds the largest bucket 8"):
        pad_to_bucket(9, [1, 2, 4, 8])


def test_static_decode_computes_what_the_dynamic_step_does(model):
    """With a bucket for every batch size and context length (no padding) the static step is
    the dynamic one, bit for bit."""
    want = generate(Engine(model, max_running_requests=16, max_context=256))
    engine = Engine(model, max_running_requests=16, max_context=256, static_decode=True)
    engine.static_decoder.batch_sizes = list(range(1, 17))
    engine.static_decoder.context_sizes = list(range(1, 257))
    got = generate(engine)
    assert engine.stats["decode_static_steps"] > 40 and engine.stats["steps"] > engine.stats["decode_static_steps"]
    assert_same(want, got, atol=0.0)


def test_static_decode_with_padding_matches_the_dynamic_step(model):
    """SGLang's buckets: padded batch rows and masked context change only fp32 rounding (the
    kernels see other shapes): the same tokens and routing, log-probs within 1e-6. Batches
    above cuda_graph_max_bs run the dynamic step."""
    want = generate(Engine(model, max_running_requests=16, max_context=256))
    engine = Engine(model, max_running_requests=16, max_context=256, static_decode=True)
    got = generate(engine)
    assert_same(want, got, atol=1e-6)
    capped = Engine(model, max_running_requests=16, max_context=256, static_decode=True, cuda_graph_max_bs=4)
    got = generate(capped)
    assert_same(want, got, atol=1e-6)
    assert 0 < capped.stats["decode_static_steps"] < engine.stats["decode_static_steps"]


# --- the CUDA-graph logic on a CPU ------------------------------------------------------------
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}


class _OpLog(TorchDispatchMode):
    """The aten ops a step issues, with their output shapes; a host read of a tensor (item,
    tolist, int(), nonzero) fails the test: a CUDA graph cannot capture it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise AssertionError(f"host read inside a captured decode step: {func}")
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append((str(func), tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor))))
        return out


class StandInGraphs:
    """CudaGraphs' interface on a CPU. A CUDA graph replays the kernels its capture issued,
    whatever the host would do now; so capture records the step's ops (refusing host reads)
    and every replay checks that the step issues exactly those ops, with the same shapes."""

    def __init__(self):
        self.captures = 0
        self.replays = 0

    def capture(self, fn):
        with _OpLog() as captured:
            fn()
        self.captures += 1

        def replay():
            with _OpLog() as now:
                fn()
            assert now.ops == captured.ops, "a replay would not issue the captured step"
            self.replays += 1
        return replay


def test_graph_capture_and_replay_logic_on_cpu(model):
    want = generate(Engine(model, max_running_requests=6, max_context=128, static_decode=True))
    graphs = StandInGraphs()
    engine = Engine(model, max_running_requests=6, max_context=128, cuda_graph=True, graphs=graphs)
    assert engine.static_decoder.batch_sizes == [1, 2, 4, 6] and engine.static_decoder.context_sizes == [64, 128]
    got = generate(engine)
    # every (batch, context) shape captured once, at start, largest first
    assert graphs.captures == 8 and engine.stats["decode_graphs"] == 8
    assert list(engine.static_decoder.replays)[0] == (6, 128)
    assert graphs.replays == engine.stats["decode_graph_steps"] > 20
    assert_same(want, got, atol=0.0)  # the same shapes as the eager static step: bit for bit


def test_an_exact_engine_captures_one_span_per_batch_size():
    """Under true_on_policy the step's attention reads each request's own keys whatever the
    span, so one graph per batch size (not one per span as well), replayed bit for bit."""
    from moe_rl.model.ops import EXACT

    model = build_model(CFG).use_ops(EXACT)
    want = generate(Engine(model, max_running_requests=6, max_context=128, static_decode=True))
    graphs = StandInGraphs()
    engine = Engine(model, max_running_requests=6, max_context=128, cuda_graph=True, graphs=graphs)
    assert engine.static_decoder.context_sizes == [128] and graphs.captures == 0
    got = generate(engine)
    assert graphs.captures == 4 and engine.stats["decode_graphs"] == 4 and graphs.replays > 20
    assert_same(want, got, atol=0.0)


def test_lora_serving_in_the_captured_step():
    """An engine serving a LoRA adapter (adapter-only sync) captures the adapter's rows too."""
    from moe_rl.engine import lora

    cfg = load_config(CONFIG, OVERRIDES + ["lora.enabled=true", "lora.sync=adapter", "lora.rank=4"])

    def make(adapter=True, **kw):
        e = Engine(build_model(cfg), max_running_requests=6, max_context=128, **kw)
        lora.attach(e, cfg)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, t in sorted(e.adapter.named_tensors().items()):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1 * adapter)
        return e

    want = generate(make(static_decode=True), n=6)
    graphs = StandInGraphs()
    got = generate(make(cuda_graph=True, graphs=graphs), n=6)
    assert graphs.replays > 0
    assert_same(want, got, atol=0.0)
    base = generate(make(adapter=False, static_decode=True), n=6)
    assert output_logprobs(base[0]["meta_info"]) != output_logprobs(want[0]["meta_info"])  # the adapter counts


def test_graphs_are_recaptured_when_the_weights_move(model):
    local = build_model(CFG)
    graphs = StandInGraphs()
    engine = Engine(local, max_running_requests=4, max_context=64, cuda_graph=True, graphs=graphs)
    engine.start()
    engine.stop()
    captured = graphs.captures
    engine.commit_weights(lambda: None, "1")  # in place: nothing to do
    assert engine.static_decoder.replays
    w = local.model.layers[0].self_attn.q_proj.weight
    engine.commit_weights(lambda: setattr(w, "data", w.data.clone()), "2")  # a zero-copy commit moves it
    assert not engine.static_decoder.replays
    with torch.inference_mode():
        engine.static_decoder.run([1, 2], [5, 9], [0, 1])
    assert graphs.captures == 2 * captured
    # so the server's weight receiver copies in place when the engine has graphs
    assert EngineServer(engine)._weight_receiver().rebind is None
    assert EngineServer(Engine(local, max_running_requests=2, max_context=64))._weight_receiver().rebind is not None


def test_cuda_graph_config_on_a_cpu():
    with pytest.raises(ConfigError, match=r"engine.cuda_graph=true needs the embedded engine on a GPU"):
        load_config(CONFIG, ["engine.cuda_graph=true"])
    with pytest.raises(ConfigError, match="engine.static_decode=false"):
        load_config(CONFIG, ["engine.cuda_graph=true", "engine.static_decode=false", "train.device=cuda"])
    cfg = load_config(CONFIG, ["engine.max_running_requests=4"])
    engine = build_engine(cfg)  # unset: off on the CPU
    assert not engine.cuda_graph and not engine.static_decode and engine.static_decoder is None
    assert build_engine(cfg, static_decode=True).static_decoder is not None
    with pytest.raises(ValueError, match="engine.cuda_graph=true needs the engine on a CUDA device; it is on cpu"):
        build_engine(cfg, cuda_graph=True)


def test_a_step_that_reads_the_host_is_not_captured(caplog):
    """The check made before capture, on the model's real decode step: on the meta device
    (tensors without values, like a GPU's to the host) float64 experts take padded_grouped_mm,
    which reads the largest group's size (float32/bf16/fp16 experts read nothing: the
    grouped-GEMM op). Unset, engine.cuda_graph turns off (logged) and the static step with it;
    set, start fails."""
    fp32 = Engine(build_model(CFG).to("meta"), max_running_requests=4, max_context=64, static_decode=True)
    assert fp32.static_decoder.host_reads() == []  # the float32 step reads nothing
    meta = build_model(CFG).to("meta", torch.float64)
    graphs = StandInGraphs()
    engine = Engine(meta, max_running_requests=4, max_context=64, cuda_graph=None, graphs=graphs)
    assert engine.cuda_graph and engine.static_decode
    engine.start()
    engine.stop()
    assert not engine.cuda_graph and not engine.static_decode and engine.static_decoder is None
    assert graphs.captures == 0 and "engine.cuda_graph: off (unset" in caplog.text and "aten.item" in caplog.text
    engine = Engine(meta, max_running_requests=4, max_context=64, cuda_graph=True, static_decode=True, graphs=graphs)
    with pytest.raises(ValueError, match=r"engine.cuda_graph=true: the decode step reads device values on the host "
                                         r"\(aten.item.default\)"):
        engine.start()
    assert graphs.captures == 0 and engine._thread is None
    # host_reads sees each kind of read (meta tensors stand for a GPU's)
    x = torch.ones(3, device="meta")
    n, mask = torch.ones(3, dtype=torch.long, device="meta"), torch.ones(3, dtype=torch.bool, device="meta")
    for read in (lambda: x.sum().item(), lambda: bool(x[0]), lambda: x.tolist(), lambda: x.cpu(), lambda: x.nonzero(),
                 lambda: torch.empty(3).copy_(x), lambda: x[mask], lambda: x.masked_select(mask),
                 lambda: x.unique(), lambda: n.bincount(), lambda: x.repeat_interleave(n),
                 lambda: x.index_put_((mask,), torch.zeros((), device="meta"))):
        assert host_reads(read), read
    assert host_reads(lambda: (x * 2).to(torch.float16)) == [] and host_reads(lambda: torch.ones(2).sum().item()) == []
    assert host_reads(lambda: x.repeat_interleave(n, output_size=3)) == [] and host_reads(lambda: x[n]) == []


# --- engine.compile: the static step under torch.compile ---------------------------------------
class _CallGraphs:
    """A capture backend that replays by calling the step again (StandInGraphs watches the ops
    through a dispatch mode, under which torch.compile does not run)."""

    def __init__(self):
        self.captures = self.replays = 0

    def capture(self, fn):
        fn()
        self.captures += 1

        def replay():
            fn()
            self.replays += 1
        return replay


def _compiled_frames() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_a_compiled_decode_step_traces_whole_and_compiles_at_start_only():
    """engine.compile traces the step in one graph (fullgraph: a break is an error) with the
    batch size and span dynamic: the warm-up at start makes the 2 graphs dynamo needs (batch
    size 1 is specialised; no span is all of the cache, which has one position more for it),
    and every (batch, span) bucket then runs one of them, captured and replayed. The CPU runs it
    on aot_eager (the same aten ops as eager: bit for bit); Inductor's fusion is the GPU's
    (test_engine_gpu.py)."""
    from torch._dynamo.backends.debugging import aot_eager

    calls = [0]

    def counting(gm, example_inputs):  # aot_eager, counting the compiled step's runs
        run = aot_eager(gm, example_inputs)

        def counted(*args):
            calls[0] += 1
            return run(*args)
        return counted

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build_model(load_config(CONFIG, OVERRIDES + ["model.num_hidden_layers=1", "model.mlp_only_layers=[]"]))
    want = generate(Engine(model, max_running_requests=6, max_context=128, static_decode=True))
    graphs = _CallGraphs()
    engine = Engine(model, max_running_requests=6, max_context=128, cuda_graph=True, graphs=graphs,
                    compile={"backend": counting})
    with torch.inference_mode():  # as Engine.start and the engine thread run it
        engine.static_decoder.warm_up()
    assert _compiled_frames() == 2 and engine.static_decoder.compile_s > 0
    warm = calls[0]
    got = generate(engine)  # starts the engine: captures the 8 shapes, then replays them
    assert graphs.captures == 8 and graphs.replays > 20
    assert _compiled_frames() == 2  # no shape compiled again
    assert calls[0] - warm == graphs.captures + graphs.replays  # the graphs run the compiled step
    for a, b in zip(want, got):  # bit for bit (one layer: its own routing layout)
        assert a["output_ids"] == b["output_ids"] and a["meta_info"]["output_token_logprobs"] == b["meta_info"][
            "output_token_logprobs"]
        np.testing.assert_array_equal(decode_routed_experts(b, 1, K), decode_routed_experts(a, 1, K))


def test_engine_compile_refusals(model):
    from moe_rl.model.ops import EXACT

    with pytest.raises(ValueError, match="compiles the static decode step, which is off"):
        Engine(model, max_running_requests=4, max_context=64, compile=True)
    with pytest.raises(ValueError, match="exact kernels"):
        Engine(build_model(CFG).use_ops(EXACT), max_running_requests=4, max_context=64, static_decode=True, compile=True)
    with pytest.raises(ConfigError, match="engine.compile=true compiles the static decode step"):
        load_config(CONFIG, OVERRIDES + ["engine.compile=true"])  # CPU: static_decode follows cuda_graph, off
    with pytest.raises(ConfigError, match="true_on_policy=true with engine.compile=true"):
        load_config(CONFIG, OVERRIDES + ["engine.compile=true", "engine.static_decode=true", "true_on_policy=true"])
    assert load_config(CONFIG, OVERRIDES + ["engine.compile=true", "engine.static_decode=true"]).engine.compile
