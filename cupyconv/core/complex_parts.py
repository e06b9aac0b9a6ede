"""Complex layers on the real kernels: three real products per complex one (Gauss's trick).

The transposed convolution and both halves of its backward are bilinear, so a complex
product ``(a_re + i a_im)(b_re + i b_im)`` needs only ``a_re b_re``, ``a_im b_im`` and
``(a_re + a_im)(b_re + b_im)``, as torch computes complex convolutions.  The gradients
follow torch's convention for complex autograd: grad_input = A_conj(w)^T grad_output and
grad_weight = B(conj(x), grad_output), i.e. the conjugated operand's imaginary part negated.
Everything here works on any array type with + and - (NumPy, CuPy, torch).
"""
from __future__ import annotations

from typing import Callable, Tuple


def product_3m(multiply: Callable, a_re, a_im, b_re, b_im) -> Tuple[object, object]:
    """(real, imaginary) parts of ``multiply(a, b)`` for a bilinear ``multiply``, in three real products."""
    t1 = multiply(a_re, b_re)
    t2 = multiply(a_im, b_im)
    t3 = multiply(a_re + a_im, b_re + b_im)
    return t1 - t2, t3 - t1 - t2


def forward(conv: Callable, x_re, x_im, w_re, w_im):
    """The layer ``conv(x, w)`` (no bias) of complex x and w."""
    return product_3m(conv, x_re, x_im, w_re, w_im)


def grad_input(grad_input_of: Callable, go_re, go_im, w_re, w_im):
    """``grad_input_of(grad_output, weight)`` for complex tensors: the weight enters conjugated."""
    return product_3m(grad_input_of, go_re, go_im, w_re, -w_im)


def grad_weight(grad_weight_of: Callable, x_re, x_im, go_re, go_im):
    """``grad_weight_of(input, grad_output)`` for complex tensors: the input enters conjugated."""
    return product_3m(grad_weight_of, x_re, -x_im, go_re, go_im)
