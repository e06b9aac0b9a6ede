"""What cupyconv knows about a CUDA device, behind one cache.

A :class:`Device` holds the facts the planners, the tuner, the compiler and ``explain``
read: name, compute capability, SM count, tensor-core generation, shared-memory limit
and roofline peaks.  :func:`get` queries a device once per process; without a GPU,
:data:`ASSUMED` (an H100 SXM) stands in where a tool needs numbers.  Tests and scripts
put a made-up device in place with :func:`substitute` rather than patching anything.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, replace
from typing import Dict, Iterator, Optional, Tuple


# ------------------------------------------------------------------------------ peaks

@dataclass(frozen=True)
class Peak:
    """Roofline peaks of one device: memory bandwidth and CUDA-core (not tensor-core) FLOP rates."""

    name: str
    bandwidth: float      # bytes per second, read + written, as a device-to-device copy achieves
    flops_fp32: float     # FP32 FLOP/s on CUDA cores (fp16/bf16 kernels accumulate in fp32 there too)
    flops_fp64: float     # FP64 FLOP/s on CUDA cores
    source: str           # how the numbers were obtained; always an estimate

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``: the fp64 rate for float64, the fp32 rate otherwise."""
        return self.flops_fp64 if dtype == "float64" else self.flops_fp32


# Sustained figures for common data-centre GPUs (name substring, bandwidth B/s, fp32, fp64).
# Bandwidth is about what a device-to-device copy reaches, not the data-sheet number;
# FLOP rates are CUDA-core peaks at boost clock.  The first matching row wins, so more
# specific names come first.
PEAK_TABLE: Tuple[Tuple[str, float, float, float], ...] = (
    ("GH200", 3.6e12, 67e12, 34e12),
    ("H200", 4.3e12, 67e12, 34e12),
    ("H100 PCIe", 1.7e12, 51e12, 26e12),
    ("H100 NVL", 3.2e12, 60e12, 30e12),
    ("H100", 3.0e12, 67e12, 34e12),
    ("H800", 3.0e12, 67e12, 34e12),
    ("A100-SXM4-80GB", 1.75e12, 19.5e12, 9.7e12),
    ("A100 80GB PCIe", 1.6e12, 19.5e12, 9.7e12),
    ("A100", 1.35e12, 19.5e12, 9.7e12),
    ("L40S", 0.75e12, 91.6e12, 1.4e12),
    ("L40", 0.75e12, 90.5e12, 1.4e12),
    ("L4", 0.25e12, 30.3e12, 0.47e12),
    ("A10", 0.5e12, 31.2e12, 0.98e12),
    ("V100", 0.8e12, 15.7e12, 7.8e12),
    ("RTX 4090", 0.9e12, 82.6e12, 1.3e12),
    ("T4", 0.25e12, 8.1e12, 0.25e12),
)

DEFAULT_PEAK = Peak("NVIDIA H100 SXM (assumed)", 3.0e12, 67e12, 34e12,
                    "no GPU here: H100 SXM defaults (3.0 TB/s copy bandwidth, 67 TFLOP/s fp32 CUDA cores); "
                    "an estimate")

# FP32 lanes per SM, by compute capability (major, minor); FP64 rate as a fraction of FP32.
_FP32_LANES = {(6, 0): 64, (7, 0): 64, (7, 5): 64, (8, 0): 64, (9, 0): 128}
_FP64_FULL = {(6, 0), (7, 0), (8, 0), (9, 0)}   # half-rate FP64 parts; the rest are 1/64


def table_peak(name: str) -> Optional[Peak]:
    """The :data:`PEAK_TABLE` row for a device name, or None."""
    for key, bw, f32, f64 in PEAK_TABLE:
        if key.lower() in name.lower():
            return Peak(name, bw, f32, f64, f"table entry {key!r} for this device; an estimate")
    return None


def attribute_peak(name: str, attrs: Dict[str, int], cc: Tuple[int, int]) -> Peak:
    """A conservative estimate from device attributes, for devices not in the table."""
    mem_khz = attrs.get("MemoryClockRate") or 0
    bus_bits = attrs.get("GlobalMemoryBusWidth") or 0
    sms = attrs.get("MultiProcessorCount") or 0
    clock_khz = attrs.get("ClockRate") or 0
    if mem_khz and bus_bits:
        # Double data rate; a copy reaches roughly 80% of the interface's rate.
        bandwidth = 0.8 * 2 * mem_khz * 1e3 * bus_bits / 8
    else:
        bandwidth = 0.5e12
    lanes = _FP32_LANES.get(cc, 128 if cc[0] >= 8 or cc == (6, 1) else 64)
    flops32 = 2.0 * sms * lanes * clock_khz * 1e3 if sms and clock_khz else 10e12
    flops64 = flops32 / 2 if cc in _FP64_FULL else flops32 / 64
    return Peak(name, bandwidth, flops32, flops64,
                f"estimated from device attributes (memory clock x bus width x 0.8, SMs x {lanes} fp32 lanes x "
                f"clock); an estimate")


# ----------------------------------------------------------------------------- devices

# Tensor-core generations: what the kernels can issue on a device.
NO_TENSOR_CORES = 0
MMA_SYNC = 8      # sm_80 and newer: mma.sync, ldmatrix, cp.async
WGMMA = 9         # sm_90: warpgroup MMA (wgmma) and TMA as well


@dataclass(frozen=True, eq=False)
class Device:
    """The facts of one CUDA device that cupyconv plans and reports with.

    Devices compare by identity: each is the one record :func:`get` keeps for its ordinal
    (or a stand-in from :func:`fake`), and caches keyed by it stay cheap to look up.
    """

    index: Optional[int]       # the CUDA ordinal; None for the assumed device of a machine without a GPU
    name: str
    arch: str                  # compute capability as CuPy spells it: "90", "86"
    sm_count: int
    tensor_cores: int          # NO_TENSOR_CORES, MMA_SYNC or WGMMA
    shared_memory_per_block: int   # bytes a block may opt in to
    peak: Peak

    @property
    def capability(self) -> Tuple[int, int]:
        return int(self.arch[:-1] or 0), int(self.arch[-1])


def tensor_core_generation(arch: str) -> int:
    major = int(arch[:-1] or 0)
    return WGMMA if major >= 9 else MMA_SYNC if major >= 8 else NO_TENSOR_CORES


ASSUMED = Device(None, DEFAULT_PEAK.name, "90", 132, WGMMA, 227 * 1024, DEFAULT_PEAK)

_devices: Dict[int, Device] = {}
_lock = threading.Lock()


def _query(index: int) -> Device:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props.get("name", b"")
    name = name.decode() if isinstance(name, bytes) else str(name)
    handle = cupy.cuda.Device(index)
    arch = handle.compute_capability
    try:
        attrs = dict(handle.attributes)
    except Exception:  # attribute query unavailable: the table or defaults must do
        attrs = {}
    peak = table_peak(name) or attribute_peak(name, attrs, (int(arch[:-1] or 0), int(arch[-1])))
    smem = int(attrs.get("MaxSharedMemoryPerBlockOptin") or props.get("sharedMemPerBlockOptin") or 48 * 1024)
    sms = int(attrs.get("MultiProcessorCount") or props.get("multiProcessorCount") or 1)
    return Device(index, name, arch, sms, tensor_core_generation(arch), smem, peak)


def get(index: int) -> Device:
    """The facts of CUDA device ``index``, queried once per process (or as :func:`substitute` set them)."""
    found = _devices.get(index)
    if found is None:
        with _lock:
            found = _devices.get(index)
            if found is None:
                found = _devices[index] = _query(index)
    return found


def fake(index: Optional[int] = 0, **facts) -> Device:
    """A made-up device: :data:`ASSUMED` with ``index`` and any of its fields replaced (``arch`` sets
    ``tensor_cores`` too unless that is given)."""
    if "arch" in facts and "tensor_cores" not in facts:
        facts["tensor_cores"] = tensor_core_generation(facts["arch"])
    return replace(ASSUMED, index=index, **facts)


@contextlib.contextmanager
def substitute(device: Device) -> Iterator[Device]:
    """Make :func:`get` answer ``device`` for its index while the block runs (tests, host-only planning)."""
    if device.index is None:
        raise ValueError("substitute needs a device with an index")
    with _lock:
        previous = _devices.get(device.index)
        _devices[device.index] = device
    try:
        yield device
    finally:
        with _lock:
            if previous is None:
                _devices.pop(device.index, None)
            else:
                _devices[device.index] = previous


@functools.lru_cache(maxsize=None)
def gpu_present() -> bool:
    """Whether CuPy can see a CUDA GPU (CuPy installed, a driver and at least one device)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device
        return False
