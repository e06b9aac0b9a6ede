"""TMA descriptors: what the planner may ask the copy engine for, and their encoding at launch (a stand-in for the
driver's encoder, so this runs without a GPU)."""
import ctypes

import pytest

from cupyconv.plans import launch, tensor_map
from cupyconv.plans.tensor_map import Encoded, TensorMap

# a channels_last bf16 tensor of 16 images of 16 x 16 pixels and 512 channels, read in halos at stride 2
HALO = TensorMap(1, "bfloat16", (512, 16, 16, 16), (1024, 16384, 262144), (64, 18, 18, 1), (1, 2, 2, 1))


def test_a_strided_box_lands_ceil_side_over_stride_elements_a_side():
    assert HALO.box_bytes == 64 * 9 * 9 * 2
    assert TensorMap(0, "float16", (64, 7), (128,), (64, 7), (1, 2)).box_bytes == 64 * 4 * 2


@pytest.mark.parametrize("change,words", [
    (dict(dtype="int8"), "hold"),
    (dict(strides=(1024, 16384)), "needs 3 strides"),
    (dict(box=(64, 18, 18)), "needs 3 strides"),
    (dict(strides=(1000, 16384, 262144)), "16-byte multiples"),
    (dict(dims=(512, 16, 0, 16)), "below 2\\*\\*32"),
    (dict(box=(64, 300, 18, 1)), "1 to 256"),
    (dict(box=(4, 18, 18, 1)), "16-byte runs"),
    (dict(element_strides=(1, 9, 2, 1)), "1 to 8"),
    (dict(box=(128, 18, 18, 1)), "128-byte swizzle"),
])
def test_descriptors_the_copy_engine_cannot_take_are_refused_when_planned(change, words):
    fields = dict(pointer=1, dtype="bfloat16", dims=HALO.dims, strides=HALO.strides, box=HALO.box,
                  element_strides=HALO.element_strides)
    with pytest.raises(ValueError, match=words):
        TensorMap(**{**fields, **change})


def test_a_channels_last_activation_runs_channels_then_columns_rows_and_images():
    m = tensor_map.channels_last(1, "bfloat16", (16, 512, 16, 16), (64, 18, 18, 1), (1, 2, 2, 1))
    assert m == HALO
    x = tensor_map.channels_last(0, "float32", (2, 96, 5, 7), (32, 9, 7, 1))
    assert (x.dims, x.strides, x.element_strides) == ((96, 7, 5, 2), (384, 7 * 384, 35 * 384), (1, 1, 1, 1))


def test_fits_bounds_box_sides_and_traversal_strides():
    assert tensor_map.fits((64, 256, 1), (1, 8, 1))
    assert not tensor_map.fits((64, 257, 1), (1, 1, 1))
    assert not tensor_map.fits((64, 18, 18), (1, 9, 2))


def _fake_encoder(calls):
    """A stand-in for the driver's encoder: it takes the ctypes objects the driver would, notes them, and fills the
    descriptor with the address's low byte."""
    def encode(out, data_type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, fill):
        scalars = (out, data_type, rank, address, interleave, swizzle, l2, fill)
        expected = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p] + [ctypes.c_int] * 4
        assert [type(a) for a in scalars] == expected, "the C types cuTensorMapEncodeTiled takes"
        rank, address = rank.value, address.value
        calls.append((data_type.value, rank, address, list(dims)[:rank], list(strides)[:rank - 1],
                      list(box)[:rank], list(element_strides)[:rank], interleave.value, swizzle.value, fill.value))
        ctypes.memset(out.value, address & 0xFF, tensor_map.MAP_BYTES)
        return 0
    return encode


def test_a_descriptor_is_encoded_again_only_when_its_address_changes(monkeypatch):
    calls = []
    monkeypatch.setattr(tensor_map, "_encode", _fake_encoder(calls))
    encoded = Encoded(HALO)
    assert encoded.address % tensor_map.MAP_ALIGN == 0
    for pointer in (0x10000, 0x10000, 0x20010, 0x10000):
        encoded.encode(pointer)
    assert [c[2] for c in calls] == [0x10000, 0x20010, 0x10000]
    # bfloat16 (9), rank 4, the sizes innermost first, a 128-byte swizzle (3), out-of-bounds elements as zeros
    assert calls[0][:2] == (9, 4) and calls[0][3:] == ([512, 16, 16, 16], [1024, 16384, 262144], [64, 18, 18, 1],
                                                       [1, 2, 2, 1], 0, 3, 0)
    assert ctypes.string_at(encoded.address, tensor_map.MAP_BYTES) == bytes([0x00]) * tensor_map.MAP_BYTES


def test_a_misaligned_address_or_a_failed_encoding_raises(monkeypatch):
    monkeypatch.setattr(tensor_map, "_encode", lambda *args: 1)
    with pytest.raises(ValueError, match="16-byte aligned"):
        Encoded(HALO).encode(0x10008)
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled failed"):
        Encoded(HALO).encode(0x10000)


def test_a_launch_passes_its_descriptors_after_the_scalars(monkeypatch):
    """Each descriptor's 128 bytes, encoded for the launch's own pointer, follow the pointers and scalars."""
    monkeypatch.setattr(tensor_map, "_encode", _fake_encoder([]))
    seen = []

    def launch_kernel(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        maps = [ctypes.string_at(slots[5 + i], tensor_map.MAP_BYTES) for i in range(2)]
        seen.append(([ctypes.cast(slots[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(3)],
                     [ctypes.cast(slots[3 + i], ctypes.POINTER(ctypes.c_int32))[0] for i in range(2)],
                     [m[0] for m in maps], {slots[5] % 64, slots[6] % 64}))

    monkeypatch.setattr(launch, "_launch_kernel", launch_kernel)
    x_map = TensorMap(0, "bfloat16", (512, 16, 16, 16), (1024, 16384, 262144), (64, 8, 8, 1), (1, 1, 1, 1))
    block = launch._ParamBlock(3, (7, 9), "int", (x_map, HALO))
    args = (11, 1, 2, 3, 256, 1, 1, 4096)
    block.launch(args, (0x1230, 0x4560, 0x7890), 99)
    block.launch(args, (0x1240, 0x4560, 0x7890), 99)
    assert seen == [([0x1230, 0x4560, 0x7890], [7, 9], [0x30, 0x60], {0}),
                    ([0x1240, 0x4560, 0x7890], [7, 9], [0x40, 0x60], {0})]
