"""Run a planned kernel on the CPU: its rendered CUDA source compiled as C++.

A small shim stands in for CUDA: each CUDA thread of a block (of up to three dimensions, x
fastest, numbered into warps as on the GPU) is a ``std::thread``,
``__syncthreads`` is a block-wide ``std::barrier``, and warp shuffles and
``__syncwarp`` go through a per-warp barrier and exchange slots.  Blocks run one after
another, so ``__shared__`` arrays are plain statics.  The two inline-PTX conversions of
``common.cuh`` (fp32 <-> fp16) become ``_Float16`` casts, which round the same way; any
other inline PTX is compiled out, so kernels that need it (the tensor-core ones) cannot
run here.

This checks the kernels' index arithmetic, tiling, staging and reductions without a
GPU; it says nothing about timing, and the GPU tests remain the real check.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List, Sequence

import numpy as np

from cupyconv.jit import templates

COMPILER = shutil.which("g++")

_SHIM = r"""
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3_t { unsigned x, y, z; };
thread_local dim3_t threadIdx;
dim3_t blockIdx, gridDim, blockDim;

static std::barrier<>* block_barrier = nullptr;
static std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
static long long warp_slots[1024 / 32][32];
thread_local int emu_lane, emu_warp;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define asm(...)

inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { warp_barriers[emu_warp]->arrive_and_wait(); }
template <class T> T __ldg(const T* p) { return *p; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct double2 { double x, y; };

template <class T> T emu_exchange(T v, int src) {
    static_assert(sizeof(T) <= sizeof(long long), "shuffled values fit a slot");
    std::memcpy(&warp_slots[emu_warp][emu_lane], &v, sizeof(T));
    __syncwarp();
    T got;
    std::memcpy(&got, &warp_slots[emu_warp][src], sizeof(T));
    __syncwarp();
    return got;
}
template <class T> T __shfl_sync(unsigned, T v, int src) { return emu_exchange(v, src & 31); }
template <class T> T __shfl_down_sync(unsigned, T v, unsigned delta) {
    const int src = emu_lane + static_cast<int>(delta);
    T got = emu_exchange(v, src < 32 ? src : emu_lane);
    return src < 32 ? got : v;
}
"""

_MAIN = r"""
int main(int argc, char** argv) {
    const int buffers = argc - 1;
    std::vector<char*> data(buffers);
    std::vector<long> sizes(buffers);
    for (int i = 0; i < buffers; ++i) {
        FILE* f = std::fopen(argv[1 + i], "rb");
        std::fseek(f, 0, SEEK_END);
        sizes[i] = std::ftell(f);
        std::fseek(f, 0, SEEK_SET);
        data[i] = static_cast<char*>(std::aligned_alloc(64, (sizes[i] + 64) / 64 * 64));
        if (std::fread(data[i], 1, sizes[i], f) != static_cast<size_t>(sizes[i])) return 2;
        std::fclose(f);
    }
    gridDim = {GRID_X, GRID_Y, GRID_Z};
    blockDim = {BLOCK_X, BLOCK_Y, BLOCK_Z};
    const int threads = BLOCK_X * BLOCK_Y * BLOCK_Z;
    const long long blocks = static_cast<long long>(gridDim.x) * gridDim.y * gridDim.z;
    // One OS thread per CUDA thread, kept for every block: thread 0 sets each block up
    // between two pool-wide barriers, and blocks run one after another.
    std::barrier<> pool_barrier(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
            // x fastest, as CUDA numbers a block's threads into warps
            threadIdx = {static_cast<unsigned>(t) % blockDim.x, static_cast<unsigned>(t) / blockDim.x % blockDim.y,
                         static_cast<unsigned>(t) / (blockDim.x * blockDim.y)};
            emu_lane = t % 32;
            emu_warp = t / 32;
            for (long long b = 0; b < blocks; ++b) {
                if (t == 0) {
                    blockIdx = {static_cast<unsigned>(b % gridDim.x), static_cast<unsigned>(b / gridDim.x % gridDim.y),
                                static_cast<unsigned>(b / gridDim.x / gridDim.y)};
                    delete block_barrier;
                    block_barrier = new std::barrier<>(threads);
                    warp_barriers.clear();
                    for (int w = 0; w * 32 < threads; ++w)
                        warp_barriers.emplace_back(new std::barrier<>(threads - w * 32 < 32 ? threads - w * 32 : 32));
                }
                pool_barrier.arrive_and_wait();
                KERNEL_CALL;
                // A thread that has returned no longer holds back the barriers, as on the GPU.
                warp_barriers[emu_warp]->arrive_and_drop();
                block_barrier->arrive_and_drop();
                pool_barrier.arrive_and_wait();
            }
        });
    for (auto& th : pool) th.join();
    for (int i = 0; i < buffers; ++i) {
        FILE* f = std::fopen(argv[1 + i], "wb");
        std::fwrite(data[i], 1, sizes[i], f);
        std::fclose(f);
    }
    return 0;
}
"""


def available() -> bool:
    return COMPILER is not None


def _cache_dir() -> Path:
    path = Path(tempfile.gettempdir()) / "cupyconv-cuda-emulator"
    path.mkdir(exist_ok=True)
    return path


# PTX conversions and the C++ that does the same (round to nearest even, as cvt.rn).
_PTX_EQUIVALENTS = {
    'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));': "f = static_cast<float>(__builtin_bit_cast(_Float16, bits));",
    'asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(v));':
        "bits = __builtin_bit_cast(unsigned short, static_cast<_Float16>(v));",
}


def _source(plan, pointer_types: Sequence[str]) -> str:
    spec = plan.spec
    kernel = templates.render(spec.template, dict(spec.constants)).replace('extern "C" ', "")
    for ptx, cpp in _PTX_EQUIVALENTS.items():
        kernel = kernel.replace(ptx, cpp)
    arguments = [f"reinterpret_cast<{t}*>(data[{i}])" for i, t in enumerate(pointer_types)]
    arguments += [f"static_cast<index_t>({s}LL)" for s in plan.scalars]
    main = (_MAIN.replace("GRID_X", f"{plan.grid[0]}u").replace("GRID_Y", f"{plan.grid[1]}u")
            .replace("GRID_Z", f"{plan.grid[2]}u").replace("BLOCK_X", f"{plan.block[0]}u")
            .replace("BLOCK_Y", f"{plan.block[1]}u").replace("BLOCK_Z", f"{plan.block[2]}u")
            .replace("KERNEL_CALL", f"{spec.function}({', '.join(arguments)})"))
    return kernel + main


_FLAGS = ("-std=c++20", "-O1", "-pthread", "-w")


def _shim_header() -> Path:
    """The shim as a header, precompiled once per cache folder: most of a program's compile time is the
    standard headers the shim includes, which every program shares (2.0 s a program becomes 0.9)."""
    digest = hashlib.sha256((_SHIM + " ".join(_FLAGS)).encode()).hexdigest()[:20]
    header = _cache_dir() / f"shim-{digest}.h"
    precompiled = header.with_name(header.name + ".gch")
    if not precompiled.exists():
        if not header.exists():
            tmp = header.with_name(header.name + f".{os.getpid()}")
            tmp.write_text("#pragma once\n" + _SHIM)
            os.replace(tmp, header)
        tmp = precompiled.with_name(precompiled.name + f".{os.getpid()}")
        # g++ falls back to the header itself wherever the precompiled one cannot serve
        subprocess.run([COMPILER, *_FLAGS, "-x", "c++-header", str(header), "-o", str(tmp)], check=True,
                       capture_output=True)
        os.replace(tmp, precompiled)
    return header


def build(plan, pointer_types: Sequence[str]) -> Path:
    """Compile the plan's kernel and launcher once; returns the executable."""
    header = _shim_header()
    source = _source(plan, pointer_types)
    exe = _cache_dir() / hashlib.sha256((header.name + source).encode()).hexdigest()[:20]
    if not exe.exists():
        src = exe.with_suffix(".cpp")
        src.write_text(source)
        tmp = exe.with_name(exe.name + f".{os.getpid()}")
        subprocess.run([COMPILER, *_FLAGS, "-include", str(header), str(src), "-o", str(tmp)], check=True,
                       capture_output=True)
        os.replace(tmp, exe)
    return exe


def respecialized(plan, **constants):
    """``plan`` with some of its kernel's constants changed (a deliberately wrong kernel, say)."""
    from cupyconv.plans import launch

    spec = launch.KernelSpec.make(plan.spec.template, plan.spec.function, {**dict(plan.spec.constants), **constants})
    return launch.Plan(spec, plan.grid, plan.block, plan.scalars, plan.index_t)


def run(plan, buffers: Sequence[np.ndarray], pointer_types: Sequence[str]) -> List[np.ndarray]:
    """Launch ``plan`` on copies of ``buffers`` (one per pointer argument); returns them after the launch."""
    exe = build(plan, pointer_types)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, array in enumerate(buffers):
            path = Path(tmp) / f"buffer{i}.bin"
            np.ascontiguousarray(array).tofile(path)
            paths.append(str(path))
        subprocess.run([str(exe)] + paths, check=True, capture_output=True, timeout=300)
        return [np.fromfile(p, dtype=a.dtype).reshape(a.shape) for p, a in zip(paths, buffers)]
