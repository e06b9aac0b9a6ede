"""Layer geometry: argument parsing, the output-size rule and ``output_size=`` handling, against torch."""
from __future__ import annotations

import itertools
import random
import re

import numpy as np
import pytest

from cupyconv.core.geometry import (ConvParams, Geometry, as_int, as_pair, geometry, output_length, output_padding_for,
                                    output_size, phase_taps)

torch = pytest.importorskip("torch")
F = torch.nn.functional


# ------------------------------------------------------------------ random valid layers

def _random_case(rng: random.Random):
    """A valid layer (output size >= 1 on both axes), asymmetric on purpose."""
    while True:
        k = (rng.randint(1, 5), rng.randint(1, 5))
        s = (rng.randint(1, 4), rng.randint(1, 4))
        d = (rng.randint(1, 3), rng.randint(1, 3))
        p = (rng.randint(0, 4), rng.randint(0, 4))
        op = tuple(rng.randint(0, max(s[a], d[a]) - 1) for a in range(2))
        groups = rng.choice([1, 1, 2, 3])
        cin = groups * rng.randint(1, 2)
        cout_g = rng.randint(1, 2)
        size = (rng.randint(1, 6), rng.randint(1, 6))
        batch = rng.choice([None, 1, 2])
        try:
            for a in range(2):
                output_size(size[a], k[a], s[a], p[a], op[a], d[a])
        except ValueError:  # the output would be empty: not a layer
            continue
        return dict(k=k, s=s, d=d, p=p, op=op, groups=groups, cin=cin, cout_g=cout_g, size=size,
                        batch=batch)


CASES = [_random_case(random.Random(1000 + i)) for i in range(80)]


def _ids(case):
    return (f"k{case['k']}s{case['s']}p{case['p']}op{case['op']}d{case['d']}g{case['groups']}"
            f"n{case['batch']}hw{case['size']}").replace(" ", "")


def _torch_out_shape(case):
    shape = (case["cin"],) + case["size"]
    if case["batch"] is not None:
        shape = (case["batch"],) + shape
    x = torch.zeros(shape, dtype=torch.float64)
    w = torch.zeros((case["cin"], case["cout_g"]) + case["k"], dtype=torch.float64)
    y = F.conv_transpose2d(x, w, stride=case["s"], padding=case["p"], output_padding=case["op"],
                           groups=case["groups"], dilation=case["d"])
    return tuple(y.shape)


def test_sweep_is_varied():
    """The seeded sweep really covers asymmetric layers, groups, unbatched input and output_padding."""
    assert len(CASES) >= 60
    assert any(c["k"][0] != c["k"][1] for c in CASES)
    assert any(c["s"][0] != c["s"][1] for c in CASES)
    assert any(c["p"][0] != c["p"][1] for c in CASES)
    assert any(c["d"][0] != c["d"][1] for c in CASES)
    assert any(c["op"][0] != c["op"][1] for c in CASES)
    assert any(c["groups"] > 1 for c in CASES)
    assert any(c["batch"] is None for c in CASES)
    # output_padding that is only legal because of the dilation (>= stride).
    assert any(c["op"][a] >= c["s"][a] for c in CASES for a in range(2))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_output_size_matches_torch(case):
    expected = _torch_out_shape(case)
    spatial = tuple(output_size(case["size"][a], case["k"][a], case["s"][a], case["p"][a], case["op"][a],
                                case["d"][a]) for a in range(2))
    assert spatial == expected[-2:]

    in_shape = (case["cin"],) + case["size"]
    if case["batch"] is not None:
        in_shape = (case["batch"],) + in_shape
    params = ConvParams.from_args(case["s"], case["p"], case["op"], case["groups"], case["d"])
    g = geometry(in_shape, (case["cin"], case["cout_g"]) + case["k"], None, params)
    assert g.out_size == expected[-2:]
    assert g.batched == (case["batch"] is not None)
    assert g.user_shape(g.output_shape) == expected
    assert g.user_shape(g.input_shape) == in_shape
    assert g.out_channels == case["cout_g"] * case["groups"]
    assert g.weight_shape == (case["cin"], case["cout_g"]) + case["k"]


def test_output_size_is_exported_at_top_level():
    import cupyconv

    assert cupyconv.output_size is output_size
    # H_out = (H-1)*stride - 2*padding + dilation*(k-1) + output_padding + 1
    assert output_size(5, 3, 2, 1, 1, 1) == 10
    assert output_size(1, 1, 1, 0, 0, 1) == 1
    assert output_size(4, 3, 1, 0, 1, 2) == 9
    assert output_size(np.int64(5), 3, 2, 1, 1, 1) == 10


def test_reference_output_size_is_the_checked_one():
    from cupyconv import reference

    assert reference.output_size is output_size


# (in_size, kernel, stride, padding, output_padding, dilation), the exception and what its message must say
BAD_OUTPUT_SIZES = {
    "non_positive_result": ((1, 1, 1, 5, 0, 1), ValueError, r"output size .* = -9 is not positive"),
    "zero_result": ((1, 1, 1, 1, 1, 2), ValueError, r"= 0 is not positive"),
    "in_size_zero": ((0, 3, 1, 0, 0, 1), ValueError, r"in_size must be >= 1, got 0"),
    "kernel_zero": ((5, 0, 1, 0, 0, 1), ValueError, r"kernel must be >= 1, got 0"),
    "stride_zero": ((5, 3, 0, 0, 0, 1), ValueError, r"stride must be >= 1"),
    "padding_negative": ((5, 3, 1, -1, 0, 1), ValueError, r"padding must be >= 0"),
    "output_padding_negative": ((5, 3, 2, 0, -1, 1), ValueError, r"output_padding must be >= 0"),
    "output_padding_too_large": ((5, 3, 2, 0, 2, 1), ValueError, r"output_padding must be smaller"),
    "dilation_zero": ((5, 3, 1, 0, 0, 0), ValueError, r"dilation must be >= 1"),
    "stride_huge": ((5, 3, 2 ** 40, 0, 0, 1), ValueError, r"stride must be at most 2\*\*31 - 1"),
    "in_size_bool": ((True, 3, 1, 0, 0, 1), TypeError, r"in_size must be an int, got bool"),
    "kernel_float": ((5, 3.0, 1, 0, 0, 1), TypeError, r"kernel must be an int, got float"),
    "stride_float": ((5, 3, 2.0, 0, 0, 1), TypeError, r"stride must be an int, got float"),
    "padding_bool": ((5, 3, 1, False, 0, 1), TypeError, r"padding must be an int, got bool"),
    "output_padding_none": ((5, 3, 2, 0, None, 1), TypeError, r"output_padding must be an int"),
    "dilation_pair": ((5, 3, 1, 0, 0, (1, 1)), TypeError, r"dilation must be an int, got tuple"),
    "in_size_numpy_float": ((np.float64(5), 3, 1, 0, 0, 1), TypeError, r"in_size must be an int"),
}


@pytest.mark.parametrize("name", BAD_OUTPUT_SIZES)
def test_output_size_checks_its_arguments_as_a_layer_does(name):
    args, exc, message = BAD_OUTPUT_SIZES[name]
    with pytest.raises(exc, match=message):
        output_size(*args)


def test_output_size_agrees_with_torch_on_what_is_a_layer():
    """Every (in, k, s, p, op, d) in a small box: output_size raises exactly where torch refuses the layer."""
    for in_size, k, s, p, op, d in itertools.product((1, 3), (1, 3), (1, 2), (0, 1, 3), (0, 1), (1, 2)):
        if op >= max(s, d):
            continue
        x, w = torch.zeros(1, 1, in_size, 1, dtype=torch.float64), torch.zeros(1, 1, k, 1, dtype=torch.float64)
        try:
            expected = F.conv_transpose2d(x, w, stride=(s, 1), padding=(p, 0), output_padding=(op, 0),
                                          dilation=(d, 1)).shape[2]
        except RuntimeError:
            with pytest.raises(ValueError, match="not positive"):
                output_size(in_size, k, s, p, op, d)
        else:
            assert output_size(in_size, k, s, p, op, d) == expected


# ------------------------------------------------------------------------- as_pair / as_int

@pytest.mark.parametrize("value, expected", [
    (3, (3, 3)),
    (0, (0, 0)),
    ((2,), (2, 2)),
    ([4], (4, 4)),
    ((1, 2), (1, 2)),
    ([3, 5], (3, 5)),
    (np.int64(2), (2, 2)),
    (np.int32(7), (7, 7)),
    ((np.int16(1), np.uint8(3)), (1, 3)),
    ([np.int64(4), 6], (4, 6)),
])
def test_as_pair_accepts(value, expected):
    result = as_pair(value, "stride")
    assert result == expected
    assert all(type(v) is int for v in result)


@pytest.mark.parametrize("value, exc", [
    (True, TypeError),
    (False, TypeError),
    (np.bool_(True), TypeError),
    (1.0, TypeError),
    (2.5, TypeError),
    (np.float64(2.0), TypeError),
    ("2", TypeError),
    ("ab", TypeError),
    (None, TypeError),
    ((1, 2, 3), ValueError),
    ([1, 2, 3], ValueError),
    ((), ValueError),
    ((1, True), TypeError),
    ((True,), TypeError),
    ((1.0, 2), TypeError),
    ((1, None), TypeError),
    (("1", "2"), TypeError),
    (np.array([1, 2]), TypeError),
])
@pytest.mark.parametrize("name", ["stride", "padding", "output_padding", "dilation"])
def test_as_pair_rejects_and_names_the_argument(value, exc, name):
    with pytest.raises(exc, match=re.escape(name)):
        as_pair(value, name)


@pytest.mark.parametrize("value", [True, 1.0, "1", None, (1,), np.float32(1)])
def test_as_int_rejects(value):
    with pytest.raises(TypeError, match="groups"):
        as_int(value, "groups")


def test_as_int_accepts_numpy_integers():
    assert as_int(np.int64(3), "groups") == 3
    assert type(as_int(np.int8(2), "groups")) is int


def test_conv_params_normalises():
    p = ConvParams.from_args(stride=(2, 3), padding=[1], output_padding=(1, 0), groups=np.int64(2),
                             dilation=2)
    assert p == ConvParams((2, 3), (1, 1), (1, 0), 2, (2, 2))
    assert ConvParams.from_args() == ConvParams()
    # output_padding below the dilation is legal with stride 1, as in torch.
    assert ConvParams.from_args(stride=1, output_padding=(1, 2), dilation=(2, 3)).output_padding == (1, 2)


# ---------------------------------------------------------------------- output_padding_for

def _module(case):
    m = torch.nn.ConvTranspose2d(case["cin"], case["cout_g"] * case["groups"], case["k"], stride=case["s"],
                                 padding=case["p"], groups=case["groups"], dilation=case["d"], bias=False)
    return m.double()


def _input(case, rng):
    shape = (case["cin"],) + case["size"]
    if case["batch"] is not None:
        shape = (case["batch"],) + shape
    return torch.from_numpy(np.asarray(rng.standard_normal(shape)))


OP_CASES = [c for c in CASES
            if min(output_length(c["size"][a], c["k"][a], c["s"][a], c["p"][a], 0, c["d"][a])
                   for a in range(2)) >= 1][:24]


@pytest.mark.parametrize("case", OP_CASES, ids=_ids)
def test_output_padding_for_matches_torch(case):
    """Every requested size, in range or not, is accepted or rejected exactly as torch's module does."""
    m = _module(case)
    rng = np.random.default_rng(0)
    x = _input(case, rng)
    in_shape = tuple(x.shape)
    smallest = [output_size(case["size"][a], case["k"][a], case["s"][a], case["p"][a], 0, case["d"][a])
                for a in range(2)]
    candidates = [range(max(1, smallest[a] - 2), smallest[a] + case["s"][a] + 2) for a in range(2)]
    accepted = 0
    with torch.no_grad():
        for oh, ow in itertools.product(*candidates):
            for requested in ([oh, ow], tuple(in_shape[:-2]) + (oh, ow)):
                try:
                    y = m(x, output_size=list(requested))
                except ValueError:
                    with pytest.raises(ValueError, match="output_size"):
                        output_padding_for(requested, in_shape, case["k"], case["s"], case["p"], case["d"])
                    continue
                op = output_padding_for(requested, in_shape, case["k"], case["s"], case["p"], case["d"])
                assert tuple(y.shape[-2:]) == (oh, ow)
                assert op == (oh - smallest[0], ow - smallest[1])
                # The output_padding found gives torch's very output through the functional form.
                y2 = F.conv_transpose2d(x, m.weight, stride=case["s"], padding=case["p"], output_padding=op,
                                        groups=case["groups"], dilation=case["d"])
                assert torch.equal(y, y2)
                accepted += 1
    assert accepted == 2 * case["s"][0] * case["s"][1]


def test_output_padding_for_examples():
    # input 5x5, kernel 3, stride 2, padding 1: sizes 9 or 10 possible.
    assert output_padding_for((9, 9), (1, 1, 5, 5), (3, 3), (2, 2), (1, 1), (1, 1)) == (0, 0)
    assert output_padding_for([10, 9], (1, 1, 5, 5), (3, 3), (2, 2), (1, 1), (1, 1)) == (1, 0)
    assert output_padding_for((1, 1, 10, 10), (1, 1, 5, 5), (3, 3), (2, 2), (1, 1), (1, 1)) == (1, 1)
    assert output_padding_for(torch.Size([4, 7, 9, 10]), (1, 1, 5, 5), (3, 3), (2, 2), (1, 1),
                              (1, 1)) == (0, 1)
    # unbatched input: 2 or 3 elements.
    assert output_padding_for((1, 10, 9), (1, 5, 5), (3, 3), (2, 2), (1, 1), (1, 1)) == (1, 0)
    assert output_padding_for(np.array([10, 10]), (1, 1, 5, 5), (3, 3), (2, 2), (1, 1), (1, 1)) == (1, 1)


@pytest.mark.parametrize("requested", [(8, 9), (9, 11), (11, 11), (0, 9), (-1, -1)])
def test_output_padding_for_out_of_range(requested):
    with pytest.raises(ValueError, match="output_size"):
        output_padding_for(requested, (1, 1, 5, 5), (3, 3), (2, 2), (1, 1), (1, 1))
    m = torch.nn.ConvTranspose2d(1, 1, 3, stride=2, padding=1)
    with pytest.raises(ValueError):
        m(torch.zeros(1, 1, 5, 5), output_size=list(requested))


@pytest.mark.parametrize("requested, in_shape", [
    ((9,), (1, 1, 5, 5)),
    ((1, 9, 9), (1, 1, 5, 5)),
    ((1, 1, 1, 9, 9), (1, 1, 5, 5)),
    ((), (1, 1, 5, 5)),
    ((1, 1, 9, 9), (1, 5, 5)),
])
def test_output_padding_for_wrong_length(requested, in_shape):
    with pytest.raises(ValueError, match="output_size"):
        output_padding_for(requested, in_shape, (3, 3), (2, 2), (1, 1), (1, 1))
    m = torch.nn.ConvTranspose2d(1, 1, 3, stride=2, padding=1)
    with pytest.raises(ValueError):
        m(torch.zeros(in_shape), output_size=list(requested))


@pytest.mark.parametrize("requested", [9, True, None, 9.0, (9.0, 9), (True, 9), ("9", "9")])
def test_output_padding_for_rejects_non_int_sequences(requested):
    with pytest.raises(TypeError, match="output_size"):
        output_padding_for(requested, (1, 1, 5, 5), (3, 3), (2, 2), (1, 1), (1, 1))


# --------------------------------------------------------------------------- unbatched input

def test_geometry_unbatched():
    params = ConvParams.from_args(stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2,
                                  dilation=(1, 2))
    g = geometry((4, 5, 6), (4, 3, 3, 2), (6,), params)
    assert isinstance(g, Geometry)
    assert not g.batched
    assert g.batch == 1
    assert g.input_shape == (1, 4, 5, 6)
    assert g.output_shape == (1, 6, 10, 8)
    assert g.user_shape(g.output_shape) == (6, 10, 8)
    assert g.user_shape(g.input_shape) == (4, 5, 6)
    assert g.user_shape([1, 2, 3, 4]) == (2, 3, 4)
    y = F.conv_transpose2d(torch.zeros(4, 5, 6, dtype=torch.float64), torch.zeros(4, 3, 3, 2, dtype=torch.float64),
                           stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2, dilation=(1, 2))
    assert tuple(y.shape) == (6, 10, 8)


def test_geometry_batched_keeps_batch_axis():
    g = geometry((3, 4, 5, 6), (4, 3, 3, 2), None, ConvParams.from_args(groups=2))
    assert g.batched
    assert g.batch == 3
    assert g.user_shape(g.output_shape) == g.output_shape == (3, 6, 7, 7)
    assert g.in_per_group == 2 and g.out_per_group == 3
    assert g.flops() == 2 * 3 * 4 * 3 * 5 * 6 * 3 * 2


def test_geometry_allows_empty_batch():
    g = geometry((0, 2, 3, 3), (2, 1, 2, 2), None, ConvParams())
    assert g.output_shape == (0, 1, 4, 4)


def test_phase_taps_is_the_most_taps_any_stride_phase_holds():
    for kernel in range(1, 12):
        for stride in range(1, 7):
            for dilation in range(1, 5):
                for padding in range(0, dilation * (kernel - 1) + 1, 3):
                    counts = [sum((r + padding - k * dilation) % stride == 0 for k in range(kernel))
                              for r in range(stride)]
                    assert phase_taps(kernel, stride, dilation) == max(counts), (kernel, stride, dilation, padding)
