// Device helpers of every attention kernel: compile-time flags and shapes, shared-memory
// addresses, asynchronous copies, read-only loads.

constexpr u32 FULL = 0xffffffffu;  // every lane of a warp

// A compile-time flag passed to a generic lambda, which instantiates its body once per value.
template <bool B>
struct Flag {
    static constexpr bool value = B;
};

// 16 bytes, for vector loads and stores.
struct alignas(16) U128 {
    u32 x, y, z, w;
};

// Dynamic shared memory of the fast kernels: the tensor-core prefill's tiles, the decode's
// staging rings.
extern __shared__ U128 dynamic_smem[];

// The kernel's dynamic shared memory, which must hold `bytes` (src/cuda/variant.rs computes
// what each kernel takes and the launch gives it; a launch giving less traps rather than
// overrunning it).
__device__ __forceinline__ u8* dynamic_shared(u32 bytes) {
    u32 given;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(given));
    if (given < bytes) {
        __trap();
    }
    return (u8*)dynamic_smem;
}

// The shared-memory address (state space .shared) of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_address(const void* ptr) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(ptr));
    return a;
}

// N bytes (16, 8 or 4) from global to shared memory, asynchronously (16 bytes bypass L1);
// with `zeros` the N bytes are zeros and nothing is read (the ignore-src predicate: cheaper
// than a source size, which costs address arithmetic per copy).
template <int N>
__device__ __forceinline__ void cp_async(u32 dst, const void* src, bool zeros) {
    static_assert(N == 16 || N == 8 || N == 4, "cp.async copies 4, 8 or 16 bytes");
    if constexpr (N == 16) {
        asm volatile("{ .reg .pred z; setp.ne.b32 z, %2, 0;"
                     " cp.async.cg.shared.global [%0], [%1], 16, z; }" ::"r"(dst),
                     "l"(src), "r"((u32)zeros)
                     : "memory");
    } else {
        asm volatile("{ .reg .pred z; setp.ne.b32 z, %2, 0;"
                     " cp.async.ca.shared.global [%0], [%1], %3, z; }" ::"r"(dst),
                     "l"(src), "r"((u32)zeros), "n"(N)
                     : "memory");
    }
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// W words (8 stored elements: W = 2, 4 or 8) from global memory that no kernel writes while
// the attention runs (read-only path, no L1 allocation: each is read once).
template <int W>
__device__ __forceinline__ void load_words(u32 (&w)[W], const void* ptr) {
    if (W == 2) {
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
                     : "=r"(w[0]), "=r"(w[1 % W])
                     : "l"(ptr));
    } else {
#pragma unroll
        for (int h = 0; h < W / 4; ++h) {
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(w[4 * h % W]), "=r"(w[(4 * h + 1) % W]),
                           "=r"(w[(4 * h + 2) % W]), "=r"(w[(4 * h + 3) % W])
                         : "l"((const u8*)ptr + 16 * h));
        }
    }
}
