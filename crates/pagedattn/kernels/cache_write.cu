// Paged KV-cache write (vLLM's reshape_and_cache) into the head-major cache layout
// [num_blocks, num_kv_heads, block_size, head_size]: token t of key/value ([T, Hkv, D],
// row-major) goes to slot slot_mapping[t] (slot = block * block_size + offset); slot -1 is
// skipped. fp8 caches store encode(x / scale), byte for byte what the host's
// Fp8Format::encode stores (crates/pagedattn/src/fp8.rs).
//
// No CUDA header is included: conversions are bit operations and PTX, so NVRTC needs no
// include path. Compiled without fast math (IEEE division, denormals kept).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// Activation element types: the bits they are stored as, and their exact value as f32.
struct F32 {
    typedef u32 Bits;
    static __device__ float to_f32(u32 bits) { return __uint_as_float(bits); }
};

struct F16 {
    typedef u16 Bits;
    static __device__ float to_f32(u16 bits) {
        float x;
        asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(bits));
        return x;
    }
};

struct BF16 {
    typedef u16 Bits;
    static __device__ float to_f32(u16 bits) { return __uint_as_float((u32)bits << 16); }
};

// The two fp8 formats: mantissa bits, exponent bias, largest finite value.
struct E4M3 {
    enum { MBITS = 3, BIAS = 7 };
    static __device__ float max_finite() { return 448.0f; }
};

struct E5M2 {
    enum { MBITS = 2, BIAS = 15 };
    static __device__ float max_finite() { return 57344.0f; }
};

// 2^e for the small exponents used here.
__device__ float pow2(int e) { return __uint_as_float((u32)(e + 127) << 23); }

// Fp8Format::encode, step for step: round to nearest even, saturate to the largest finite
// value (infinities too), NaN -> 0x7F.
template <class F>
__device__ u8 fp8_encode(float x) {
    if (x != x) {
        return 0x7F;
    }
    const u32 bits = __float_as_uint(x);
    const u8 sign = (bits >> 31) ? 0x80 : 0;
    float a = __uint_as_float(bits & 0x7FFFFFFFu);
    if (a > F::max_finite()) {
        a = F::max_finite();
    }
    const int min_normal_exp = 1 - F::BIAS;
    int exp = min_normal_exp;
    if (a != 0.0f) {
        const int e = (int)((__float_as_uint(a) >> 23) & 0xFF) - 127;
        exp = e > min_normal_exp ? e : min_normal_exp;
    }
    // Exact: a power-of-two scaling. A carry of the rounding into the next binade is absorbed
    // by the code layout, as on the host.
    const int q = __float2int_rn(__fmul_rn(a, pow2(F::MBITS - exp)));
    const int code = ((exp + F::BIAS) << F::MBITS) + q - (1 << F::MBITS);
    return sign | (u8)code;
}

// How a cache stores an element: as the activation's bits, or as an fp8 code.
struct Auto {
    static constexpr bool COPIES = true;  // the bits unchanged: rows may move in 16-byte pieces
    template <class E> struct Cache { typedef typename E::Bits Type; };
    template <class E>
    static __device__ typename E::Bits store(typename E::Bits bits, float) { return bits; }
};

template <class F>
struct Fp8 {
    static constexpr bool COPIES = false;
    template <class E> struct Cache { typedef u8 Type; };
    template <class E>
    static __device__ u8 store(typename E::Bits bits, float scale) {
        // As on the host: the division in f32, rounded once.
        return fp8_encode<F>(__fdiv_rn(E::to_f32(bits), scale));
    }
};

// 16 bytes, for vector loads and stores.
struct alignas(16) U128 {
    u32 x, y, z, w;
};

// One thread block per token; its threads stride over the token's Hkv * D elements, 16 bytes
// at a time where the format copies bits and every row and buffer is 16-byte aligned (a
// fifth of the instructions per byte: the write of a long prompt's keys and values then
// runs at the copy bandwidth), else element by element.
template <class E, class S>
__device__ void write_kv(const typename E::Bits* key, const typename E::Bits* value,
                         typename S::template Cache<E>::Type* key_cache,
                         typename S::template Cache<E>::Type* value_cache,
                         const i64* slot_mapping, int num_kv_heads, int head_size,
                         i64 block_size, float k_scale, float v_scale) {
    const i64 t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0) {
        return;
    }
    const i64 block = slot / block_size;
    const i64 offset = slot % block_size;
    const int row = num_kv_heads * head_size;
    if constexpr (S::COPIES) {
        constexpr int V = 16 / sizeof(typename E::Bits);  // elements per piece
        const bool aligned =
            head_size % V == 0 &&
            (((unsigned long long)key | (unsigned long long)value |
              (unsigned long long)key_cache | (unsigned long long)value_cache) &
             15) == 0;
        if (aligned) {
            const int pieces = head_size / V;
            for (int i = threadIdx.x; i < row / V; i += blockDim.x) {
                const int h = i / pieces;
                const int d = (i % pieces) * V;
                const i64 src = t * row + (i64)i * V;
                const i64 dst = ((block * num_kv_heads + h) * block_size + offset) * head_size + d;
                *(U128*)(key_cache + dst) = *(const U128*)(key + src);
                *(U128*)(value_cache + dst) = *(const U128*)(value + src);
            }
            return;
        }
    }
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        const int h = i / head_size;
        const int d = i % head_size;
        const i64 src = t * row + i;
        const i64 dst = ((block * num_kv_heads + h) * block_size + offset) * head_size + d;
        key_cache[dst] = S::template store<E>(key[src], k_scale);
        value_cache[dst] = S::template store<E>(value[src], v_scale);
    }
}

// One kernel per (activation dtype, cache format): write_kv_<dtype>_<format>. Its argument,
// WriteKvParams, is generated before this file from src/cuda/kernels.rs (the addresses of
// keys, values and the two caches untyped, given their types here).
#define WRITE_KV(NAME, E, S)                                                                   \
    extern "C" __global__ void NAME(const WriteKvParams args) {                                \
        write_kv<E, S>((const E::Bits*)args.key, (const E::Bits*)args.value,                   \
                       (S::Cache<E>::Type*)args.key_cache,                                     \
                       (S::Cache<E>::Type*)args.value_cache, args.slot_mapping,                \
                       args.num_kv_heads, args.head_size, args.block_size, args.k_scale,       \
                       args.v_scale);                                                          \
    }

WRITE_KV(write_kv_f32_auto, F32, Auto)
WRITE_KV(write_kv_f32_e4m3, F32, Fp8<E4M3>)
WRITE_KV(write_kv_f32_e5m2, F32, Fp8<E5M2>)
WRITE_KV(write_kv_f16_auto, F16, Auto)
WRITE_KV(write_kv_f16_e4m3, F16, Fp8<E4M3>)
WRITE_KV(write_kv_f16_e5m2, F16, Fp8<E5M2>)
WRITE_KV(write_kv_bf16_auto, BF16, Auto)
WRITE_KV(write_kv_bf16_e4m3, BF16, Fp8<E4M3>)
WRITE_KV(write_kv_bf16_e5m2, BF16, Fp8<E5M2>)
