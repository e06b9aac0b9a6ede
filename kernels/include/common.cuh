// Shared by every cupyconv kernel template.
//
// The templates are compiled by NVRTC with no CUDA headers on the include path
// (pip's wheels do not always ship them), so fp16/bf16 are plain 16-bit
// storage types converted with PTX and bit arithmetic, and everything else is
// built-in.  The renderer inlines this file, so the compiled source, and with it
// CuPy's on-disk cache key, covers the header too.
#pragma once

struct __align__(2) half_t { unsigned short bits; };
struct __align__(2) bf16_t { unsigned short bits; };

// What a storage type sums in: fp16, bf16 and fp32 in fp32, fp64 in fp64.
template <typename T> struct Accumulator { typedef float type; };
template <> struct Accumulator<double> { typedef double type; };

// An element as stored (load_raw), and widened to what it sums in: apart where a kernel holds loads in flight
// across other work, since the widening waits for the load.
template <typename T> __device__ __forceinline__ T load_raw(const T* p) { return __ldg(p); }
__device__ __forceinline__ half_t load_raw(const half_t* p) {
    return half_t{__ldg(reinterpret_cast<const unsigned short*>(p))};
}
__device__ __forceinline__ bf16_t load_raw(const bf16_t* p) {
    return bf16_t{__ldg(reinterpret_cast<const unsigned short*>(p))};
}
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ double widen(double v) { return v; }
__device__ __forceinline__ float widen(half_t h) {
    const unsigned short bits = h.bits;
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
}
__device__ __forceinline__ float widen(bf16_t b) { return __uint_as_float(static_cast<unsigned int>(b.bits) << 16); }

template <typename T> __device__ __forceinline__ auto load(const T* p) { return widen(load_raw(p)); }

// Two neighbouring 16-bit elements held as one word, the first in the low half: one load for both where p is
// 4-byte aligned, and widened apart like load_raw's.
template <typename T16> __device__ __forceinline__ unsigned load_pair_raw(const T16* p) {
    static_assert(sizeof(T16) == 2, "16-bit storage types");
    return __ldg(reinterpret_cast<const unsigned*>(p));
}
template <typename T16> __device__ __forceinline__ void widen_pair(unsigned word, float (&v)[2]) {
    v[0] = widen(T16{static_cast<unsigned short>(word & 0xffffu)});
    v[1] = widen(T16{static_cast<unsigned short>(word >> 16)});
}

// N neighbouring elements as stored: one 16- or 8-byte load where N fills 16 or 8 bytes (p then aligned to them), a
// plain load where N is 1.
template <int BYTES> struct RunBytes { typedef uint4 type; };
template <> struct RunBytes<8> { typedef uint2 type; };
template <typename T, int N>
struct Run {
    static_assert(N == 1 || N * sizeof(T) == 16 || N * sizeof(T) == 8, "one element or a 16- or 8-byte run of them");
    union {
        typename RunBytes<N == 1 ? 16 : N * sizeof(T)>::type bytes;
        T v[N];
    };
};
template <int N, typename T> __device__ __forceinline__ Run<T, N> load_run(const T* p) {
    Run<T, N> run;
    if constexpr (N == 1) run.v[0] = load_raw(p);
    else run.bytes = __ldg(reinterpret_cast<const decltype(run.bytes)*>(p));
    return run;
}

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(double* p, double v) { *p = v; }
__device__ __forceinline__ void store(half_t* p, float v) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(v));
    reinterpret_cast<unsigned short*>(p)[0] = bits;
}
__device__ __forceinline__ void store(bf16_t* p, float v) {
    unsigned short bits;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(v));
#else
    // Round to nearest even by hand where cvt.rn.bf16.f32 is missing (before sm_80).
    // NaNs are kept quiet rather than rounded to Inf.
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        bits = static_cast<unsigned short>((u >> 16) | 0x40u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        bits = static_cast<unsigned short>(u >> 16);
    }
#endif
    reinterpret_cast<unsigned short*>(p)[0] = bits;
}

// v0 and v1 rounded to a 16-bit type and packed in one word, v0 in the low half: one conversion for both on
// sm_80 and later.
template <typename T16> __device__ __forceinline__ unsigned pack_pair(float v0, float v1) {
    static_assert(sizeof(T16) == 2, "16-bit storage types");
    T16 pair[2];
    store(&pair[0], v0);
    store(&pair[1], v1);
    return static_cast<unsigned>(pair[0].bits) | static_cast<unsigned>(pair[1].bits) << 16;
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <> __device__ __forceinline__ unsigned pack_pair<half_t>(float v0, float v1) {
    unsigned u;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(v1), "f"(v0));
    return u;
}
template <> __device__ __forceinline__ unsigned pack_pair<bf16_t>(float v0, float v1) {
    unsigned u;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(v1), "f"(v0));
    return u;
}
#endif

// Two neighbouring values in one store; `p` is aligned to the pair (4 bytes for 16-bit types, 8 for fp32).
struct __align__(8) float_pair { float x, y; };
__device__ __forceinline__ void store_pair(float* p, float v0, float v1) {
    *reinterpret_cast<float_pair*>(p) = float_pair{v0, v1};
}
template <typename T16>
__device__ __forceinline__ void store_pair(T16* p, float v0, float v1) {
    *reinterpret_cast<unsigned*>(p) = pack_pair<T16>(v0, v1);
}

// N neighbouring values stored as one 16- or 8-byte run (p aligned to it; 16-bit values rounded two at a time), or
// one plain store where N is 1.
template <int N, typename T, typename A>
__device__ __forceinline__ void store_run(T* p, const A (&v)[N]) {
    static_assert(N == 1 || N * sizeof(T) == 16 || N * sizeof(T) == 8, "one element or a 16- or 8-byte run of them");
    if constexpr (N == 1) {
        store(p, v[0]);
    } else if constexpr (sizeof(T) == 2) {
        unsigned words[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; ++i) words[i] = pack_pair<T>(v[2 * i], v[2 * i + 1]);
        if constexpr (N == 8) *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
        else *reinterpret_cast<uint2*>(p) = make_uint2(words[0], words[1]);
    } else {
        Run<T, N> run;
#pragma unroll
        for (int i = 0; i < N; ++i) run.v[i] = v[i];
        *reinterpret_cast<decltype(run.bytes)*>(p) = run.bytes;
    }
}

// What a split-K partial pass writes: acc_t partials that reduce_partials.cu adds up,
// or, when the pass has one chunk (SINGLE_CHUNK), the result itself in the storage
// type, which saves the reduce launch and the scratch.
template <bool SINGLE, typename Storage, typename Acc> struct PartialOut { typedef Acc type; };
template <typename Storage, typename Acc> struct PartialOut<true, Storage, Acc> { typedef Storage type; };

// Fixed-order warp reduction: the result is bitwise reproducible, which is what
// the deterministic grad_weight / grad_bias paths are built on.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    return v;
}

// The direct kernels keep a block's weights in shared memory, one row per
// (channel, kernel row), padded to whole 16-byte vectors: all threads read the
// same address, so one vector load broadcasts four fp32 (two fp64) weights and
// the inner loops issue about one instruction per multiply-add.
template <typename T>
struct SmemVector {
    static constexpr int WIDTH = 16 / sizeof(T);
};

__device__ __forceinline__ void load_smem_vector(float* dst, const float* src) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
}
__device__ __forceinline__ void load_smem_vector(double* dst, const double* src) {
    const double2 v = *reinterpret_cast<const double2*>(src);
    dst[0] = v.x; dst[1] = v.y;
}

// dst[0..N) = src[0..N) for a 16-byte aligned shared-memory row, N a multiple of the vector width.
template <int N, typename T>
__device__ __forceinline__ void load_smem_row(T (&dst)[N], const T* src) {
    constexpr int V = SmemVector<T>::WIDTH;
    static_assert(N % V == 0, "shared-memory rows are padded to whole vectors");
#pragma unroll
    for (int i = 0; i < N; i += V) load_smem_vector(dst + i, src + i);
}

// dst[0..N) = src[0..N) from shared memory, as whole vectors where N allows:
// src must then be aligned to the vector (N times the element size, at most 16 bytes).
template <int N, typename T>
__device__ __forceinline__ void load_smem_small(T (&dst)[N], const T* src) {
    if constexpr (N % SmemVector<T>::WIDTH == 0) {
        load_smem_row(dst, src);
    } else if constexpr (N == 2 && sizeof(T) == 4) {
        const float2 v = *reinterpret_cast<const float2*>(src);
        dst[0] = v.x; dst[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) dst[i] = src[i];
    }
}
