// Element types of the attention kernels, shared by attention/ and attention_merge.cu (the
// library prepends this file to theirs before NVRTC sees them).
//
// No CUDA header is included: conversions are bit operations and PTX, so NVRTC needs no
// include path. Every conversion is exact or rounds once to nearest even, as the host does.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// IEEE specials without <math.h>.
__device__ __forceinline__ float f32_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float f32_nan() { return __int_as_float(0x7fc00000); }

// Activation element types: how an element is stored, read as f32 (exact) and written from
// f32 (rounded to nearest even; overflow to infinity, NaN stays NaN).
struct F32 {
    typedef float Bits;
    static __device__ __forceinline__ float to_f32(float x) { return x; }
    static __device__ __forceinline__ float from_f32(float x) { return x; }
};

struct F16 {
    typedef u16 Bits;
    static __device__ __forceinline__ float to_f32(u16 bits) {
        float x;
        asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(bits));
        return x;
    }
    static __device__ __forceinline__ u16 from_f32(float x) {
        u16 bits;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(x));
        return bits;
    }
    // Tensor-core support (attention/tensor_core_sm80.cuh): two f32 rounded into one register (lo in
    // the low half), the exponent field that marks an element non-finite, and
    // D += A * B on m16n8k16 fragments with f32 accumulators.
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static constexpr u32 EXPONENT = 0x7c00;
    // An f16 pair as a pair of this type (exact where the values are this type's).
    static __device__ __forceinline__ u32 from_f16x2(u32 pair) { return pair; }
    static __device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

struct BF16 {
    typedef u16 Bits;
    static __device__ __forceinline__ float to_f32(u16 bits) {
        return __uint_as_float((u32)bits << 16);
    }
    static __device__ __forceinline__ u16 from_f32(float x) {
        u16 bits;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(x));
        return bits;
    }
    // Tensor-core support, as F16's.
    static __device__ __forceinline__ u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static constexpr u32 EXPONENT = 0x7f80;
    // An f16 pair as a bf16 pair, through f32 (exact where the values are bf16's, as every
    // fp8 code's is; NaN stays NaN).
    static __device__ __forceinline__ u32 from_f16x2(u32 pair) {
        return pack2(F16::to_f32((u16)pair), F16::to_f32((u16)(pair >> 16)));
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// How a key or value element is stored: as the activation's element (`Plain<E>`), or as an
// fp8 code (`E4M3`, `E5M2`), read as the code's exact value (the scales are applied after
// the dot product and the weighted sum, as on the host). Decoding is Fp8Format::decode of
// crates/pagedattn/src/fp8.rs, bit for bit.
template <class E>
struct Plain {
    typedef typename E::Bits Type;
    static __device__ __forceinline__ float read(Type x) { return E::to_f32(x); }
};

#if __CUDA_ARCH__ >= 890
// Four fp8 codes, e4m3 or e5m2, as two f16 pairs of their values, exact (every value of both
// formats is an f16, NaN and infinities included): bytes 0 and 1 into `lo`, 2 and 3 into
// `hi`, one instruction a pair on sm_89 and later. The register's halves go to the
// conversions as they are (`mov.b32 {l, h}`), which ptxas reads with a half selector: from
// `(u16)(codes >> 16)` it shifted the high half down first, one more instruction a pair.
// The formats' `quad_to_f16x2`.
template <bool E4M3_CODES>
__device__ __forceinline__ void fp8x4_to_f16x2(u32 codes, u32& lo, u32& hi) {
    if constexpr (E4M3_CODES) {
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2;"
            " cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
            : "=r"(lo), "=r"(hi)
            : "r"(codes));
    } else {
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2;"
            " cvt.rn.f16x2.e5m2x2 %0, l; cvt.rn.f16x2.e5m2x2 %1, h; }"
            : "=r"(lo), "=r"(hi)
            : "r"(codes));
    }
}
#endif

// e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN, no infinities.
struct E4M3 {
    typedef u8 Type;
    static __device__ __forceinline__ float read(u8 code) {
        const u32 e = (code >> 3) & 0xF;
        const u32 m = code & 0x7;
        float magnitude;
        if (e == 0xF && m == 0x7) {
            magnitude = f32_nan();
        } else if (e == 0) {
            // Subnormal: m * 2^-9, exact.
            magnitude = (float)m * 0.001953125f;
        } else {
            // (1 + m/8) * 2^(e - 7): the f32 with biased exponent e - 7 + 127 and the three
            // mantissa bits on top.
            magnitude = __uint_as_float(((e + 120) << 23) | (m << 20));
        }
        return (code & 0x80) ? -magnitude : magnitude;
    }
    // Four codes as the f16 pairs of their values, exact: bytes 0, 1 into `lo` (byte 0 in
    // its low half), bytes 2, 3 into `hi`.
    static __device__ __forceinline__ void quad_to_f16x2(u32 codes, u32& lo, u32& hi) {
#if __CUDA_ARCH__ >= 890
        fp8x4_to_f16x2<true>(codes, lo, hi);
#else
        lo = F16::pack2(read((u8)codes), read((u8)(codes >> 8)));
        hi = F16::pack2(read((u8)(codes >> 16)), read((u8)(codes >> 24)));
#endif
    }
};

// e5m2 is the upper byte of an IEEE half (same exponent field and bias): exact through f16,
// infinities and NaN included.
struct E5M2 {
    typedef u8 Type;
    static __device__ __forceinline__ float read(u8 code) {
        return F16::to_f32((u16)((u32)code << 8));
    }
    // Four codes as the f16 pairs of their values, exact: bytes 0, 1 into `lo` (byte 0 in
    // its low half), bytes 2, 3 into `hi`.
    static __device__ __forceinline__ void quad_to_f16x2(u32 codes, u32& lo, u32& hi) {
#if __CUDA_ARCH__ >= 890
        fp8x4_to_f16x2<false>(codes, lo, hi);
#else
        // Each code is the high byte of its f16.
        lo = ((codes & 0xff) << 8) | ((codes & 0xff00) << 16);
        hi = ((codes >> 8) & 0xff00) | (codes & 0xff000000);
#endif
    }
};
