// Hopper's warpgroup MMA (wgmma, sm_90a; the library includes this file only there) and the
// synchronization of a warp-specialized CTA: mbarriers, named barriers, register
// reallocation. A warpgroup (four warps) multiplies together, the tensor cores reading B (and
// for S = Q K^T also A) straight from shared memory, once for all 64 rows of an m64 block.
// Operands live in the 128-byte-swizzled layout the tensor cores read: 64-element atoms, each
// a column of 128-byte lines (one per row) whose 16-byte chunk c sits at position
// c ^ (row % 8), also free of bank conflicts for cp.async and the scans. A descriptor names a
// tile's start inside a 1024-byte-aligned swizzle atom, `lbo` bytes between its 64-element
// atoms along N (N-major B only) and `sbo` bytes between its groups of 8 rows. The
// accumulators are mma.sync's m16n8 fragments, n-tile after n-tile: warp w of the warpgroup
// holds rows 16 w + lane / 4 and + 8 of the block.
#ifndef __CUDA_ARCH_FEAT_SM90_ALL
#error "tensor_core_sm90.cuh is for sm_90a"
#endif

// Byte offset of 16-byte chunk c of row t in a swizzled tile of `rows` rows.
__device__ __forceinline__ u32 swizzled_chunk(int rows, int t, int c) {
    return (c / 8) * rows * 128 + t * 128 + ((c % 8) ^ (t % 8)) * 16;
}
// The swizzled layout as a tile layout (`chunk_at`) for the pieces generic over layouts.
struct Swizzled {
    static __device__ __forceinline__ u32 chunk_at(int rows, int t, int c) {
        return swizzled_chunk(rows, t, c);
    }
};

__device__ __forceinline__ u64 wgmma_desc(u32 address, u32 lbo, u32 sbo) {
    return (u64)((address & 0x3ffff) >> 4) | (u64)(lbo >> 4) << 16 | (u64)(sbo >> 4) << 32 |
           1ull << 62;
}
// Before the first wgmma reading registers that other instructions wrote.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
// The wgmma issued since the last commit form one group.
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Until at most N committed groups are unfinished: the others' accumulators are readable,
// their operands free.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses to accumulators across this point
// (wgmma reads and writes them after its issue, until its wait).
template <int N>
__device__ __forceinline__ void hold(float (&r)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
        asm volatile("" : "+f"(r[n][0]), "+f"(r[n][1]), "+f"(r[n][2]), "+f"(r[n][3])::"memory");
    }
}
// Shared-memory writes (cp.async's included) that this thread has seen made visible to the
// tensor cores' reads (the async proxy).
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

// qk: S (+)= A B^T for an m64 block, A (64 rows x 16) and B (N keys x 16) K-major in shared
// memory (`add` false: S = A B^T). pv: O += P V, P (64 rows x 16 keys) in mma.sync's A
// fragments (registers), V (16 keys x N) N-major in shared memory. N = 64 or 128, chosen by
// the accumulators' size.
template <class E>
struct Wgmma;
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
        static __device__ __forceinline__ void qk(float (&d)[16][4], u64 a, u64 b, bool add) { \
            asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n\t"                          \
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {" WGMMA_D64 \
                         "}, %64, %65, p, 1, 1, 0, 0; }"                                       \
                         : WGMMA_OUT64(d)                                                      \
                         : "l"(a), "l"(b), "r"((u32)add));                                    \
        }                                                                                      \
        static __device__ __forceinline__ void pv(float (&d)[8][4], const u32 (&a)[4], u64 b) { \
            asm volatile("{ .reg .pred p; setp.ne.b32 p, %37, 0;\n\t"                          \
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {" WGMMA_D32  \
                         "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1; }"                         \
                         : WGMMA_OUT32(d)                                                      \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));      \
        }                                                                                      \
        static __device__ __forceinline__ void pv(float (&d)[16][4], const u32 (&a)[4],      \
                                                  u64 b) {                                     \
            asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0;\n\t"                          \
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {" WGMMA_D64 \
                         "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1; }"                         \
                         : WGMMA_OUT64(d)                                                      \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1u));      \
        }                                                                                      \
    };
PAGEDATTN_WGMMA(BF16, "bf16")
PAGEDATTN_WGMMA(F16, "f16")
#undef PAGEDATTN_WGMMA

// mbarriers (64-bit words in shared memory): `count` arrivals complete a phase.
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count)
                 : "memory");
}
// One arrival (release: this thread's earlier writes are seen by the phase's waiters).
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" ::"r"(
                     smem_address(bar))
                 : "memory");
}
// The phase completes only once every cp.async this thread issued so far has landed (an
// arrival of its own, which `mbar_arrive` then balances).
__device__ __forceinline__ void mbar_track_copies(u64* bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(smem_address(bar))
                 : "memory");
}
// Until the phase of parity `parity` has completed (acquire). A fresh barrier counts its phase
// before the first as completed: a producer waits for parity 1 on its first pass.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{ .reg .pred done;\n\t"
        "LAB_WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra LAB_WAIT; }" ::"r"(smem_address(bar)),
        "r"(parity)
        : "memory");
}

// Named barriers (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// A barrier that also ORs a predicate over its threads.
__device__ __forceinline__ bool bar_or(int id, int threads, bool x) {
    u32 r;
    asm volatile("{ .reg .pred in, out; setp.ne.b32 in, %1, 0;\n\t"
                 "bar.red.or.pred out, %2, %3, in;\n\t"
                 "selp.u32 %0, 1, 0, out; }"
                 : "=r"(r)
                 : "r"((u32)x), "r"(id), "r"(threads)
                 : "memory");
    return r != 0;
}

// A warpgroup's registers per thread lowered or raised to N (every warp of it executes this).
template <int N>
__device__ __forceinline__ void registers_down() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void registers_up() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
