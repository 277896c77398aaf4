// The tensor-core steps of the FlashAttention-2 prefill (prefill_mma.cuh) with Hopper's
// warpgroup MMA (wgmma, sm_90a; the library includes this file only there): the four warps of
// the CTA multiply together, the tensor cores reading B (and for S = Q K^T also A) straight
// from shared memory, once for all 64 rows of an m64 block: a fraction of the shared-memory
// traffic of mma.sync's fragments, which is what bounds the mma.sync prefill. Operands live
// in the 128-byte-swizzled layout the tensor cores read: 64-element atoms, each a column of
// 128-byte lines (one per row) whose 16-byte chunk c sits at position c ^ (row % 8), also
// free of bank conflicts for cp.async and the scans. A descriptor names a tile's start inside
// a 1024-byte-aligned swizzle atom, `lbo` bytes between its 64-element atoms along N (N-major
// B only) and 1024 bytes between its groups of 8 rows. Row block mt of warp w is rows
// 64 mt + 16 w of the CTA (the warp's part of m64 block mt).
#ifndef __CUDA_ARCH_FEAT_SM90_ALL
#error "tensor_core_sm90.cuh is for sm_90a"
#endif
template <class E>
struct Wgmma;
__device__ __forceinline__ u64 wgmma_desc(u32 address, u32 lbo) {
    return (u64)((address & 0x3ffff) >> 4) | (u64)(lbo >> 4) << 16 | (u64)(1024 >> 4) << 32 |
           1ull << 62;
}
// Before the first wgmma reading registers that other instructions wrote.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
// Every wgmma issued so far finished: their accumulators readable, their operands free.
__device__ __forceinline__ void wgmma_finish() {
    asm volatile("wgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 0;" ::
                     : "memory");
}
// This thread's shared-memory writes (cp.async's included) made visible to the tensor cores'
// reads (the async proxy); a barrier after it extends that to the CTA's.
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Operand lists of the 32 and 64 f32 accumulators of an m64n64 and an m64n128 block.
#define WGMMA_D32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_OUT32(d) \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
    "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
    "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
    "+f"(d[7][2]), "+f"(d[7][3])
#define WGMMA_D64 \
    WGMMA_D32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_OUT64(d) WGMMA_OUT32(d), WGMMA_OUT32((d + 8))
// qk: S (+)= A B^T for an m64 block, A (64 rows x 16) and B (64 keys x 16) K-major in shared
// memory. pv: O += P V, P (64 rows x 16 keys) in mma.sync's A fragments, V (16 keys x 128)
// N-major in shared memory. The accumulators are mma.sync's m16n8 fragments, n-tile after
// n-tile, warp w holding rows 16 w + lane / 4 and + 8 of the block.
#define PAGEDATTN_WGMMA(E_, T)                                                                 \
    template <>                                                                                \
    struct Wgmma<E_> {                                                                         \
        static __device__ __forceinline__ void qk(float (&d)[8][4], u64 a, u64 b, bool add) {  \
            asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n\t"                          \
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {" WGMMA_D32  \
                         "}, %32, %33, p, 1, 1, 0, 0; }"                                       \
                         : WGMMA_OUT32(d)                                                      \
                         : "l"(a), "l"(b), "r"((u32)add));                                    \
        }                                                                                      \
        static __device__ __forceinline__ void pv(float (&d)[16][4], const u32 (&a)[4],      \
                                                  u64 b) {                                     \
            asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0;\n\t"                          \
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {" WGMMA_D64 \
                         "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1; }"                         \
                         : WGMMA_OUT64(d)                                                      \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));     \
        }                                                                                      \
    };
PAGEDATTN_WGMMA(BF16, "bf16")
PAGEDATTN_WGMMA(F16, "f16")
#undef PAGEDATTN_WGMMA

template <class E, class S>
struct WgmmaSync {
    static constexpr int MT = S::MT, DP = S::DP, KT = S::KT, NT = KT / 8, DT = DP / 8;
    static_assert(DP == 128 && S::ALIGN == 1024, "wgmma tiles of 128 columns, 1 KiB aligned");

    // Byte offset of 16-byte chunk c of row t in a tile of `rows` rows (swizzled).
    static __device__ __forceinline__ u32 chunk_at(int rows, int t, int c) {
        return (c / 8) * rows * 128 + t * 128 + ((c % 8) ^ (t % 8)) * 16;
    }
    // The first row (in the CTA) of row block mt of warp w.
    static __device__ __forceinline__ int row_block(int w, int mt) { return 64 * mt + 16 * w; }

    u32 q_base;

    __device__ __forceinline__ WgmmaSync(u32 q_tile, int, int) : q_base(q_tile) {}
    // The tensor cores read the query tile itself at every tile.
    __device__ __forceinline__ void load_queries() {}
    // This thread's copies made visible to the tensor cores' reads (before the barrier that
    // publishes them).
    static __device__ __forceinline__ void copies_landed() { fence_async_shared(); }

    // s = Q K^T for the key tile at k_tile: per k-step one m64 block after the other.
    __device__ __forceinline__ void qk(float (&s)[MT][NT][4], u32 k_tile) const {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                Wgmma<E>::qk(s[mt],
                             wgmma_desc(q_base + (kk / 4) * (S::CTA_ROWS * 128) +
                                            mt * 64 * 128 + (kk % 4) * 32,
                                        16),
                             wgmma_desc(k_tile + (kk / 4) * (KT * 128) + (kk % 4) * 32, 16),
                             kk > 0);
            }
        }
        wgmma_finish();
    }

    // o += P V for the value tile at v_tile, P the weights in s: P's A fragments all made
    // first, since they must not change until the wgmma finish.
    __device__ __forceinline__ void pv(float (&o)[MT][DT][4], const float (&s)[MT][NT][4],
                                       u32 v_tile) const {
        u32 a[KT / 16][MT][4];
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                p_fragment<E>(a[kk][mt], s, mt, kk);
            }
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                Wgmma<E>::pv(o[mt], a[kk][mt], wgmma_desc(v_tile + kk * 16 * 128, KT * 128));
            }
        }
        wgmma_finish();
    }
};
