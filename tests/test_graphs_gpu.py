"""Replays launched as CUDA graphs on a GPU: the same results as launches one by one, on the caller's stream,
and out of the way of a caller's own capture."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv.torch as ct  # noqa: E402
from cupyconv import engine  # noqa: E402
from cupyconv.plans import graphs  # noqa: E402
from cupyconv.tuning import decide  # noqa: E402

# (name, dtype, channels_last, TF32): split-K gradients with scratch, copies into channels_last, bias reduces
CASES = [
    ("tf32_nchw", torch.float32, False, True),
    ("bf16_channels_last", torch.bfloat16, True, False),
    ("fp16_nchw", torch.float16, False, False),
    ("fp32_channels_last", torch.float32, True, False),
]


@pytest.fixture
def graph_launches(monkeypatch):
    """Counts the calls that launched a graph."""
    launched = []
    real = graphs.GraphReplays.launch

    def counting(self, *args):
        done = real(self, *args)
        launched.append(done)
        return done
    monkeypatch.setattr(graphs.GraphReplays, "launch", counting)
    engine.clear()
    yield launched
    engine.clear()


def _model(dtype, channels_last):
    torch.manual_seed(3)
    model = nn.Sequential(ct.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(),
                          ct.ConvTranspose2d(32, 8, 3, 1, 1, groups=2)).to("cuda", dtype)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def _train(model, x, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        y = model(x)
        loss = (y.float() ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("name,dtype,channels_last,tf32", CASES, ids=[c[0] for c in CASES])
def test_training_steps_replayed_as_graphs_match_launches_one_by_one_bit_for_bit(graph_launches, name, dtype,
                                                                                 channels_last, tf32):
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        base = _model(dtype, channels_last)
        x = torch.randn(4, 64, 16, 16, device="cuda", dtype=dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        results = {}
        for on in (False, True):
            previous = graphs.set_enabled(on)
            try:
                engine.clear()
                graph_launches.clear()
                model = copy.deepcopy(base)
                losses = _train(model, x, 8)
                torch.cuda.synchronize()
                results[on] = (losses, [p.detach().clone() for p in model.parameters()])
                # the tuner's choices final, so the side with graphs tapes its calls from its first steps
                assert decide.settle(timeout=300)
                if on:
                    assert sum(graph_launches) >= 4, "the later steps launched graphs"
                else:
                    assert not any(graph_launches)
            finally:
                graphs.set_enabled(previous)
        assert torch.equal(results[True][0], results[False][0])
        for got, want in zip(results[True][1], results[False][1]):
            assert torch.equal(got, want)
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def test_a_graph_runs_in_order_on_the_callers_stream(graph_launches):
    x = torch.randn(8, 64, 16, 16, device="cuda", requires_grad=True)
    w = torch.randn(64, 32, 4, 4, device="cuda") * 0.05
    w.requires_grad_()
    go = torch.randn(8, 32, 32, 32, device="cuda")
    want = torch.nn.functional.conv_transpose2d(x.double(), w.double(), stride=2, padding=1)
    want.backward(go.double())
    want_gx, want_gw = x.grad.double(), w.grad.double()   # float32 leaves: the float64 graph's gradients land cast
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # A first call builds the tuner's candidates in the background; once they are built and timed, the
        # choices are final and the calls are taped (a call before that is not).
        ct.conv_transpose2d(x, w, stride=2, padding=1).backward(go)
    assert decide.settle(timeout=300)
    with torch.cuda.stream(side):
        for _ in range(10):   # the output alternates between two blocks: each pointer set recurs every other call
            x.grad = w.grad = None
            # the inputs are rewritten on this stream before each call: a graph on another stream would race them
            x.data.mul_(1.0)
            y = ct.conv_transpose2d(x, w, stride=2, padding=1)
            y.backward(go)
            gx, gw = x.grad, w.grad
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert any(graph_launches)
    torch.testing.assert_close(y.double(), want.detach(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gx.double(), want_gx, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gw.double(), want_gw, rtol=1e-2, atol=5e-2)


def test_a_callers_capture_after_graph_replays_captures_the_launches(graph_launches):
    """Once our replays launch graphs, a torch.cuda.graph capture of the same model still records kernels that
    replay correctly with new data."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False   # strict float32 on both sides
    try:
        _capture_after_graph_replays(graph_launches)
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def _capture_after_graph_replays(graph_launches):
    torch.manual_seed(13)
    model = nn.Sequential(ct.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(),
                          ct.ConvTranspose2d(32, 8, 3, 1, 1, groups=2)).cuda()
    static_x = torch.randn(4, 64, 8, 8, device="cuda")
    static_go = torch.randn(4, 8, 16, 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            model(static_x).backward(static_go)
    torch.cuda.current_stream().wait_stream(side)
    assert any(graph_launches), "the warm-up launched graphs"
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
        static_y.backward(static_go)
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        static_x.copy_(torch.randn(static_x.shape, device="cuda", generator=gen))
        static_go.copy_(torch.randn(static_go.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        ref = copy.deepcopy(model).double()
        for m in ref.modules():
            if isinstance(m, nn.ConvTranspose2d):
                m.__class__ = nn.ConvTranspose2d
        ref.zero_grad(set_to_none=True)
        y = ref(static_x.double())
        y.backward(static_go.double())
        torch.testing.assert_close(static_y.double(), y, rtol=1e-3, atol=1e-3)
        for got, want in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-3, atol=1e-3)
