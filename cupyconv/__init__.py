"""cupyconv: fast transposed convolution (ConvTranspose2d and ConvTranspose1d) for CuPy, NumPy and PyTorch.

Kernels are CUDA C++ templates compiled at run time with NVRTC (no build step) and
cached per layer configuration.  Nothing is compiled, and neither CuPy nor torch is
imported, when this package is imported.
"""
from .core.geometry import output_size
from .core.version import VERSION as __version__
from .explain import explain
from .functional import (backend, conv_transpose1d, conv_transpose1d_backward, conv_transpose2d,
                         conv_transpose2d_backward)
from .jit.compiler import KernelCompileError
from .tuning.explicit import tune

__all__ = [
    "KernelCompileError",
    "backend",
    "clear_cache",
    "conv_transpose1d",
    "conv_transpose1d_backward",
    "conv_transpose2d",
    "conv_transpose2d_backward",
    "explain",
    "output_size",
    "tune",
    "__version__",
]


def clear_cache() -> None:
    """Forget every kernel compiled, every launch planned and every variant chosen in this process.

    The next call compiles again (from CuPy's disk cache when it holds the kernel) and takes
    its variant from the tuning file when that holds one.
    """
    from . import engine
    from .jit import compiler
    from .plans import table
    from .tuning import decide

    compiler.clear_cache()
    table.clear_plan_cache()
    decide.clear()
    engine.clear()
