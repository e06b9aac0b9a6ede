"""Host-side launch plumbing, without a GPU: scratch carving, the shared channels_last copies and
the tilings the direct planners choose."""
from __future__ import annotations

import ctypes

import pytest

from cupyconv.core import device, dtypes
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import direct, gemm, launch, reduction


class Recorder:
    """Stands in for the allocator and for Plan.run: hands out fake pointers and logs launches."""

    def __init__(self):
        self.allocs, self.launches, self.next = [], [], 1 << 20

    def alloc(self, nbytes):
        self.allocs.append(nbytes)
        ptr, self.next = self.next, self.next + nbytes + 4096
        return object(), ptr

    def run(self, plan, device_id, stream_ptr, pointers):
        self.launches.append((plan.spec.function, tuple(pointers)))


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(launch.Plan, "run", lambda plan, d, s, p: rec.run(plan, d, s, p))
    with device.substitute(device.fake(0)):
        rec.launcher = launch.Launcher(0, 0, rec.alloc)
    return rec


def test_carve_gives_aligned_disjoint_pieces(recorder):
    keep, pieces = launch.carve(recorder.alloc, [1, 300, 0, 256])
    assert len(recorder.allocs) == 1 and recorder.allocs[0] == 256 + 512 + 0 + 256
    assert all((p - pieces[0]) % 256 == 0 for p in pieces)
    assert pieces == sorted(pieces) and pieces[1] - pieces[0] >= 1 and pieces[2] - pieces[1] >= 300


def _layer():
    # fp16, 16 channels a side: NCHW sources go through channels_last copies for every GEMM
    return geometry((2, 16, 9, 7), (16, 16, 3, 3), None, ConvParams.from_args(stride=2, padding=1))


def test_backward_passes_share_one_copy_of_grad_output(recorder):
    g = _layer()
    gi = gemm.plan_grad_input_gemm(g, "float16", "nchw")
    gw = gemm.FAMILY.plan("grad_weight", gemm.FAMILY.variants("grad_weight", g, "float16", "nchw", "strict")[0], g,
                          "float16", "nchw", "strict", False, True, 132)
    assert gi.to_channels_last is not None and gw.sources is not None
    x, go, w, out_gi, out_gw = 0x1000, 0x2000, 0x3000, 0x4000, 0x5000

    launcher = recorder.launcher
    launcher.copies = launch.SourceCopies()
    gi.run(launcher, (go, w, out_gi))
    gw.run(launcher, (x, go, out_gw))
    copied = [ptrs[0] for name, ptrs in recorder.launches if name == "to_channels_last"]
    assert sorted(copied) == [x, go], "grad_output is copied once, x once"
    go_copy = next(ptrs[1] for name, ptrs in recorder.launches if name == "to_channels_last" and ptrs[0] == go)
    gemm_sources = [ptrs[0] for name, ptrs in recorder.launches if name == "conv_transpose2d_igemm"]
    gw_sources = [ptrs[1] for name, ptrs in recorder.launches if name == "conv_transpose2d_grad_weight_igemm"]
    assert gemm_sources == [go_copy] and gw_sources == [go_copy]

    # without sharing, each pass makes its own copy, from one scratch allocation per pass
    recorder.launches.clear()
    recorder.allocs.clear()
    launcher.copies = None
    gi.run(launcher, (go, w, out_gi))
    gw.run(launcher, (x, go, out_gw))
    copied = [ptrs[0] for name, ptrs in recorder.launches if name == "to_channels_last"]
    assert sorted(copied) == [x, go, go] and len(recorder.allocs) == 2


def test_copies_are_keyed_by_source(recorder):
    plan = gemm.plan_to_channels_last(2, 16, 63, "float16")
    copies = launch.SourceCopies()
    a = copies.get(plan, 0x1000, recorder.launcher)
    assert copies.get(plan, 0x1000, recorder.launcher) == a
    assert copies.get(plan, 0x2000, recorder.launcher) != a
    assert len(recorder.launches) == 2 and recorder.allocs == [plan.scratch_bytes] * 2


def test_plans_fetch_their_kernels_again_after_the_compiler_cache_is_cleared(monkeypatch):
    from types import SimpleNamespace

    from cupyconv.jit import compiler

    built = []

    def fake_get_function(spec, device_id):
        kernel = SimpleNamespace(kernel=SimpleNamespace(ptr=0x1000 + len(built)), max_dynamic_shared_size_bytes=0)
        built.append(kernel)
        return kernel

    monkeypatch.setattr(launch, "get_function", fake_get_function)
    cached = reduction.plan_reduce("float32", 1000, 4, "int")
    # a plan of its own: the cached one is shared and may hold real handles
    plan = launch.Plan(cached.spec, cached.grid, cached.block, cached.scalars, cached.index_t)
    first = plan.function(0)
    assert plan.function(0) == first and len(built) == 1
    held = plan._functions[0][2]
    compiler.clear_cache()
    second = plan.function(0)
    assert second != first and len(built) == 2, "a cleared compiler cache must not leave plans on old handles"
    assert held is built[0], "the old kernel stayed referenced until the plan let it go"


def test_any_dynamic_shared_memory_opts_the_function_in(monkeypatch):
    """Static and dynamic shared memory together may pass 48 KB only once a function has opted in: a plan with
    any dynamic amount sets it (48 960 bytes plus a kernel's static tables failed to launch), one without none."""
    from types import SimpleNamespace

    def fake_get_function(spec, device_id):
        return SimpleNamespace(kernel=SimpleNamespace(ptr=0x1000), max_dynamic_shared_size_bytes=0)

    monkeypatch.setattr(launch, "get_function", fake_get_function)
    cached = reduction.plan_reduce("float32", 1000, 4, "int")
    for smem in (48960, 0):
        plan = launch.Plan(cached.spec, cached.grid, cached.block, cached.scalars, cached.index_t, smem_bytes=smem)
        plan.function(0)
        assert plan._functions[0][2].max_dynamic_shared_size_bytes == smem


def _direct_geometry(kernel, groups=4):
    return geometry((1, 8, 5, 5), (8, 12 // groups) + kernel, None, ConvParams.from_args(groups=groups))


@pytest.mark.parametrize("dtype,kernel", [("float32", (87, 87)), ("float16", (60, 128)), ("float64", (61, 62))])
def test_direct_kernels_take_kernels_up_to_the_shared_memory_limit(dtype, kernel):
    g = _direct_geometry(kernel)
    for plan in (direct.plan_forward(g, dtype, True), direct.plan_grad_input(g, dtype)):
        constants = dict(plan.spec.constants)
        block = constants.get("OC_BLOCK", constants.get("IC_BLOCK"))
        chunk = constants.get("IC_CHUNK", constants.get("OC_CHUNK"))
        acc = dtypes.get(dtype).accumulator_bytes
        row = -(-kernel[1] * block // (16 // acc)) * (16 // acc)
        assert chunk * kernel[0] * row * acc <= 30 * 1024


@pytest.mark.parametrize("dtype,kernel", [("float32", (87, 87)), ("float16", (60, 128)), ("float64", (61, 62))])
def test_channels_last_direct_kernels_fit_static_shared_memory(dtype, kernel):
    g = _direct_geometry(kernel)
    acc = dtypes.get(dtype).accumulator_bytes
    for plan, tile, chunk in ((direct.plan_forward(g, dtype, True, "nhwc"), "OC_TILE", "IC_CHUNK"),
                              (direct.plan_grad_input(g, dtype, "nhwc"), "IC_TILE", "OC_CHUNK")):
        c = dict(plan.spec.constants)
        assert c[chunk] * kernel[0] * kernel[1] * c[tile] * acc <= 48 * 1024


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype,kernel", [("float32", (88, 88)), ("bfloat16", (2, 4000)), ("float64", (62, 64))])
def test_direct_kernels_reject_larger_kernels_by_name(dtype, kernel, layout):
    g = _direct_geometry(kernel)
    for plan in (lambda: direct.plan_forward(g, dtype, False, layout),
                 lambda: direct.plan_grad_input(g, dtype, layout)):
        with pytest.raises(ValueError, match=r"kernel_size \(%d, %d\) is too large" % kernel):
            plan()


@pytest.mark.parametrize("in_per_group,out_per_group,groups", [(8, 16, 4), (1, 1, 128), (6, 6, 3), (3, 5, 2),
                                                               (40, 12, 1), (2, 100, 1)])
def test_channels_last_threads_own_channels_of_one_group(in_per_group, out_per_group, groups):
    """A thread's channels share their group's loads, so they never straddle a group or a tile."""
    g = geometry((2, in_per_group * groups, 9, 9), (in_per_group * groups, out_per_group, 3, 3), None,
                 ConvParams.from_args(stride=2, groups=groups))
    fwd = dict(direct.plan_forward(g, "float32", True, "nhwc").spec.constants)
    gi = dict(direct.plan_grad_input(g, "float32", "nhwc").spec.constants)
    assert out_per_group % fwd["OCB"] == 0 and fwd["OC_TILE"] % fwd["OCB"] == 0
    assert in_per_group % gi["ICB"] == 0 and gi["IC_TILE"] % gi["ICB"] == 0
    # as many channels per thread as the group allows, up to four
    assert fwd["OCB"] == max(b for b in (1, 2, 4) if out_per_group % b == 0 and fwd["OC_TILE"] % b == 0)


def test_channels_last_blocks_walk_several_images_only_when_the_weights_stay_staged():
    # the seed layer: a group's weights fit, so each block serves up to 8 of the 16 images
    g = geometry((16, 32, 128, 256), (32, 16, 3, 5), None,
                 ConvParams.from_args(stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=4))
    plan = direct.plan_forward(g, "float16", False, "nhwc")
    c = dict(plan.spec.constants)
    assert c["IC_CHUNK"] == g.in_per_group and plan.grid[2] == 2
    assert plan.grid[0] * plan.grid[1] * plan.grid[2] >= direct._BLOCKS_TO_FILL
    # float64 weights of 40 input channels are staged in chunks: one image per block
    g = geometry((16, 40, 64, 64), (40, 12, 5, 9), None, ConvParams.from_args(stride=(1, 2), padding=(2, 4)))
    plan = direct.plan_forward(g, "float64", False, "nhwc")
    assert dict(plan.spec.constants)["IC_CHUNK"] < g.in_per_group and plan.grid[2] == g.batch
    # a small layer keeps one image per block, so the GPU still gets its blocks
    g = geometry((4, 8, 5, 7), (8, 4, 3, 3), None, ConvParams.from_args(stride=2, groups=2))
    assert direct.plan_forward(g, "float32", False, "nhwc").grid[2] == 4


@pytest.mark.parametrize("channels", [3, 32, 256, 300])
def test_channels_last_grad_bias_tiles_channels_and_fills_the_rest_with_pixel_lanes(channels):
    g = geometry((4, 2, 45, 61), (2, channels, 2, 2), (channels,), ConvParams.from_args(stride=2))
    partial, reduce = reduction.plan_grad_bias(g, "float16", 132, "nhwc")
    c = dict(partial.spec.constants)
    tile = min(channels, 256)
    assert c["CHANNEL_TILE"] == tile and partial.grid[1] == -(-channels // tile)
    assert partial.block[0] == 256 and reduce.scalars == (channels, partial.grid[0])


def test_an_arena_hands_out_aligned_pieces_in_turn_and_overflows_to_the_caller():
    taken = []

    def alloc(nbytes):
        taken.append(nbytes)
        return f"buffer{len(taken)}", 4096 * len(taken) ** 3

    arena = launch.Arena(alloc, 1024)
    assert taken == [1024]
    keep, first = arena.alloc(100)
    _, second = arena.alloc(256)
    _, third = arena.alloc(1)
    assert keep == "buffer1" and (first, second, third) == (4096, 4096 + 256, 4096 + 512)
    _, fourth = arena.alloc(512)          # 256 bytes left: past the end goes to the caller's allocator
    assert taken == [1024, 512] and fourth == 4096 * 8
    _, last = arena.alloc(200)            # what is left still serves smaller pieces
    assert last == 4096 + 768


def _plan(name):
    from cupyconv.jit.compiler import KernelSpec

    return launch.Plan(KernelSpec.make("t.cu", name, {}), (1, 1, 1), (32, 1, 1), (), "int")


class _Sink(launch.Recorder):
    def __init__(self, dev):
        super().__init__(dev)
        self.calls = []

    def launch(self, stage, plan, pointers):
        self.calls.append((stage, plan, list(pointers)))


def test_a_tape_replays_each_pointer_from_where_it_came():
    dev = device.fake(0)
    x, w, out = 0x7F0000001000, 0x7F0000200010, 0x7F0000400000
    tape = launch.Tape(dev, (x, w, 0, out))
    sx, sw, sb, so = tape.stand_ins
    assert sb == 0 and sx % 256 == x % 256 and sw % 256 == w % 256, "alignment is what the caller's is"
    assert launch.pointer_signature((x, w, 0, out)) == (0, 16, -1, 0)
    keep, (a, b) = tape.scratch([100, 300])
    tape.launch("main", _plan("k1"), (sx, sw + 64, sb, a))
    tape.launch("reduce", _plan("k2"), (b, so))
    assert tape.final
    replay = tape.replay("gen")
    assert replay.scratch_bytes == 256 + 512
    sink = _Sink(dev)
    x2, w2, out2 = 0x7E0000000000, 0x7E0000100010, 0x7E0000300000
    replay.run(sink, (x2, w2, 0, out2))
    base = 1 << 40  # the recorder's first made-up scratch address
    assert [(s, p.spec.function, ptrs) for s, p, ptrs in sink.calls] == [
        ("main", "k1", [x2, w2 + 64, 0, base]), ("reduce", "k2", [base + 256, out2])]


def test_a_pointer_the_call_did_not_give_is_not_taped():
    tape = launch.Tape(device.fake(0), (0x7F0000001000,))
    tape.launch("main", _plan("k"), (0x123456,))
    assert not tape.final


def test_any_taped_call_replays_its_pointers_from_their_sources():
    """Random calls: pointers (some null), scratch pieces, and launches reading any of them at small offsets.
    The replay with other pointers of the same low bytes moves each launch pointer with its source."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=200, deadline=None, derandomize=True)
    @hypothesis.given(st.data())
    def check(data):
        count = data.draw(st.integers(1, 6))
        low = data.draw(st.lists(st.integers(0, 255), min_size=count, max_size=count))
        given = data.draw(st.lists(st.booleans(), min_size=count, max_size=count))
        first = [((0x7F00 + i) << 32) + lo if g else 0 for i, (lo, g) in enumerate(zip(low, given))]
        second = [((0x7E00 + 3 * i) << 32) + lo if g else 0 for i, (lo, g) in enumerate(zip(low, given))]
        tape = launch.Tape(device.fake(0), first)
        sizes = data.draw(st.lists(st.integers(1, 5000), max_size=3))
        _, pieces = tape.scratch(sizes)
        sources = [("call", i) for i, g in enumerate(given) if g] + [("scratch", j) for j in range(len(pieces))]
        launches = []
        for _ in range(data.draw(st.integers(1, 4))):
            picks = data.draw(st.lists(st.tuples(st.sampled_from(sources + [("null", 0)]), st.integers(0, 4096)),
                                       min_size=1, max_size=5))
            # a scratch pointer stays inside its piece; a call's may point anywhere in its buffer
            launches.append([(kind, i, 0 if kind == "null" else offset % sizes[i] if kind == "scratch" else offset)
                             for (kind, i), offset in picks])
        stand_ins = tape.stand_ins
        for n, picks in enumerate(launches):
            tape.launch("main", _plan(f"k{n}"), [0 if kind == "null" else (stand_ins[i] if kind == "call" else
                                                                              pieces[i]) + offset
                                                 for kind, i, offset in picks])
        assert tape.final
        sink = _Sink(device.fake(0))
        tape.replay(None).run(sink, second)
        base = 1 << 40  # where the sink's one scratch allocation starts
        scratch_at = [p - (launch._SCRATCH_SOURCE << launch._SOURCE_SHIFT) for p in pieces]
        want = [[0 if kind == "null" else (second[i] if kind == "call" else base + scratch_at[i]) + offset
                 for kind, i, offset in picks] for picks in launches]
        assert [ptrs for _, _, ptrs in sink.calls] == want
    check()


def test_a_pointer_before_its_source_is_not_taped():
    tape = launch.Tape(device.fake(0), (0x7F0000001000, 0x7F0000002000))
    first, second = tape.stand_ins
    tape.launch("main", _plan("k"), (second - 64,))   # would decode as far past the first pointer
    assert not tape.final


@pytest.mark.parametrize("index_t,scalar_type", [("int", ctypes.c_int32), ("long long", ctypes.c_int64)])
def test_a_launch_hands_the_driver_each_pointer_then_each_scalar(monkeypatch, index_t, scalar_type):
    """The parameter block cuLaunchKernel reads: one address a parameter, pointing at this launch's pointers (None
    as a null one) and the plan's scalars in the kernel's index type, rewritten launch after launch."""
    seen = []

    def launch_kernel(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        pointers = [ctypes.cast(slots[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(3)]
        scalars = [ctypes.cast(slots[3 + i], ctypes.POINTER(scalar_type))[0] for i in range(2)]
        seen.append((function, (gx, gy, gz, bx, by, bz, smem), stream, pointers, scalars, extra))

    monkeypatch.setattr(launch, "_launch_kernel", launch_kernel)
    block = launch._ParamBlock(3, (7, -(2 ** 31) if index_t == "int" else 2 ** 40), index_t)
    args = (11, 1, 2, 3, 128, 1, 1, 4096)
    block.launch(args, (2 ** 48 + 16, 0, 2 ** 33), 99)
    block.launch(args, [5, None, 6], 98)
    big = -(2 ** 31) if index_t == "int" else 2 ** 40
    assert seen == [(11, (1, 2, 3, 128, 1, 1, 4096), 99, [2 ** 48 + 16, 0, 2 ** 33], [7, big], 0),
                    (11, (1, 2, 3, 128, 1, 1, 4096), 98, [5, 0, 6], [7, big], 0)]
