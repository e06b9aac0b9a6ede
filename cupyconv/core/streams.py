"""What cupyconv asks of a CUDA stream before it times candidates or launches a graph on it."""
from __future__ import annotations

_runtime = None


def capturing(stream_ptr: int) -> bool:
    """Whether the stream is being captured into a CUDA graph (True when that cannot be told: e.g. the legacy
    stream while another stream captures, which must not be synchronised)."""
    global _runtime
    try:
        if _runtime is None:
            from cupy.cuda import runtime as _runtime
        return bool(_runtime.streamIsCapturing(stream_ptr))
    except Exception:
        return True
