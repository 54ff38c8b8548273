"""eval/overlapped_append.py: the drafter's context appended beside the verify pass's last layers.

The hook that starts it (decode/target.py LayerCapture ``on_features``) and the decoder's wiring
run on the CPU with a stand-in for the side stream; the stream itself, in a captured cycle, on a
GPU (the tokens of the append after the forward, bit for bit)."""

import numpy as np
import pytest
import torch
from torch import nn

from dflash_ipc.decode.requests import Request, RequestList
from dflash_ipc.decode.target import BatchedTarget, LayerCapture
from dflash_ipc.errors import ConfigError
from dflash_ipc.eval import overlapped_append
from dflash_ipc.eval.decoding import SpeculativeDecoder
from dflash_ipc.eval.drafter_context import DrafterContext
from eval_helpers import LAYER_IDS, random_drafter


def test_features_are_handed_on_once_the_last_captured_layer_has_run_and_taken_as_the_same_tensor():
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
    capture = LayerCapture(layers, [2, 0])  # the features' order is the ids' order, the trigger the last layer run
    seen = []

    outputs = []

    def forward(x):
        for i, layer in enumerate(layers):
            x = layer(x)
            seen.append(("layer", i))
            outputs.append(x)
        return x
    capture.on_features = lambda feats: seen.append(("features", feats))
    x = torch.randn(3, 4)
    forward(x)
    assert [s[0] for s in seen] == ["layer", "layer", "features", "layer", "layer"]  # from layer 2's own hook
    handed = seen[2][1]
    want = torch.cat([outputs[2], outputs[0]], dim=-1)
    torch.testing.assert_close(handed, want)
    assert capture.take() is handed
    capture.on_features = None  # without it the features are concatenated at take, as before
    forward(x)
    again = capture.take()
    assert again is not handed and torch.equal(again, handed)
    assert capture.take(keep=False) is None


def test_features_of_a_forward_that_raised_before_take_are_not_taken_by_the_next():
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    capture = LayerCapture(layers, [0])
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="after the features"):
        with capture.handing_on(lambda feats: None):
            layers[0](x)
            raise RuntimeError("the forward failed after the features were handed on")
    assert capture.on_features is None
    fresh = layers[0](x + 1)  # the next forward (a prefill, say) without a hand-on
    torch.testing.assert_close(capture.take(), fresh)


def test_the_side_stream_is_for_cuda_cycles_whose_hooks_run_eagerly(monkeypatch):
    monkeypatch.delenv(overlapped_append.APPEND_STREAM_ENV, raising=False)
    cuda = torch.device("cuda:0")
    assert overlapped_append.enabled(cuda, "layer") and overlapped_append.enabled(cuda, None)
    assert not overlapped_append.enabled(cuda, "forward")  # the whole forward compiled traces the hooks
    assert not overlapped_append.enabled(torch.device("cpu"), None)
    monkeypatch.setenv(overlapped_append.APPEND_STREAM_ENV, "off")
    assert not overlapped_append.enabled(cuda, "layer")
    monkeypatch.setenv(overlapped_append.APPEND_STREAM_ENV, "sometimes")
    with pytest.raises(ConfigError, match="DFLASH_DECODE_APPEND_STREAM.*allowed"):
        overlapped_append.enabled(cuda, "layer")


class InlineOverlap:
    """OverlappedAppend's protocol on the CPU: forked work runs at once; every fork and join counted."""

    def __init__(self):
        self.pending, self.forks, self.joins, self.log = False, 0, 0, []

    def fork(self, work):
        self.log.append("fork")
        work()
        self.pending = True
        self.forks += 1

    def join(self):
        self.log.append("join")
        self.pending = False
        self.joins += 1


def requests_of(seed, count=5):
    rng = np.random.default_rng(seed)
    return [Request(key=(i, 0), prompt_ids=rng.integers(10, 1000, size=int(n)), max_new_tokens=int(b))
            for i, (n, b) in enumerate(zip(rng.integers(3, 30, size=count), rng.integers(5, 30, size=count)))]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_cycle_that_appends_from_the_hook_gives_the_tokens_of_one_that_appends_after_the_forward(
        target_dir, batch_size):
    target = BatchedTarget(target_dir, layer_ids=LAYER_IDS, device="cpu", dtype="float32")
    model = random_drafter(target_dir, seed=2, num_layers=2)
    requests = requests_of(5)
    after = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=batch_size)
    assert after.overlap is None  # CPU
    want = {g.request.key: g for g in after.run(RequestList(requests)).generations}
    beside = SpeculativeDecoder(target, DrafterContext(model, target.head), batch_size=batch_size)
    beside.overlap = overlap = InlineOverlap()
    got = {g.request.key: g for g in beside.run(RequestList(requests)).generations}
    for key, gen in want.items():
        assert got[key].tokens == gen.tokens and got[key].stats == gen.stats, key
    longest = max(g.stats.num_cycles for g in got.values())  # cycles of one row; a batch's cycles serve several
    assert overlap.forks == overlap.joins >= longest > 0  # every cycle forked from the hook and joined
    assert overlap.log[:2] == ["fork", "join"] and not overlap.pending
    assert target.capture.on_features is None  # not left set for a later forward (a prefill, a plain step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_cycles_appending_on_the_side_stream_give_the_tokens_of_the_append_after_the_forward(
        target_dir, monkeypatch, dtype):
    """The cycle a CUDA graph of two streams: the same kernels on the same inputs, so the same
    tokens and acceptance counters bit for bit, batch 1 and batched (bf16: the few-row kernel's
    split buffers of each stream in use at once)."""
    cuda = BatchedTarget(target_dir, layer_ids=LAYER_IDS, device="cuda:0", dtype=dtype)
    model = random_drafter(target_dir, seed=1, num_layers=2).to("cuda:0", getattr(torch, dtype))
    requests = requests_of(9, count=6)
    for batch_size in (1, 3):
        runs = {}
        for setting in ("off", "auto"):
            monkeypatch.setenv(overlapped_append.APPEND_STREAM_ENV, setting)
            decoder = SpeculativeDecoder(cuda, DrafterContext(model, cuda.head), batch_size=batch_size, graphs="on")
            runs[setting] = {g.request.key: g for g in decoder.run(RequestList(requests)).generations}
            assert decoder.graphs.enabled and decoder.graphs.num_captures >= 1
            assert (decoder.overlap is not None) == (setting == "auto")
            if decoder.overlap is not None:
                assert decoder.overlap.forks > 0 and not decoder.overlap.pending
        for key, gen in runs["off"].items():
            assert runs["auto"][key].tokens == gen.tokens and runs["auto"][key].stats == gen.stats, (batch_size, key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_stream_of_its_own_has_split_buffers_of_its_own_and_every_other_stream_shares_one_set():
    from dflash_ipc.decode.matvec import SplitBuffers

    buffers, dev = SplitBuffers(), torch.device("cuda:0")
    main = buffers.get(dev, 64, 8)
    side, capture_like = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    buffers.own(dev, side)
    with torch.cuda.stream(capture_like):  # a graph's capture stream, a warm-up's: never at once with the current
        assert buffers.get(dev, 64, 8)[1] is main[1]
    with torch.cuda.stream(side):
        other = buffers.get(dev, 64, 8)
        assert buffers.get(dev, 64, 8)[1] is other[1]
    assert other[0].data_ptr() != main[0].data_ptr() and other[1].data_ptr() != main[1].data_ptr()
    assert int(other[1].abs().sum()) == 0  # made outside a capture: zeroed
    assert buffers.get(dev, 64, 8)[0] is main[0]
