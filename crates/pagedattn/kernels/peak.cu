// The tensor cores' bf16 rate through mma.sync, for benchmarks (`cuda::PeakProbe`): every warp
// issues CHAINS independent m16n8k16 products (bf16 operands, f32 accumulators) back to back,
// `iters` times, on register operands (no memory traffic). Operands are small non-zero bf16
// values that differ by lane (a product of zeros can run faster than real data); the sums stay
// far inside f32. The result is stored only when it equals an impossible value, so the products
// cannot be optimized away and nothing is written.
//
// One product = 2 * 16 * 8 * 16 = 4096 FLOPs per warp.

#define CHAINS 8

extern "C" __global__ void __launch_bounds__(256) mma_bf16_peak(float* out, int iters) {
    const unsigned lane = threadIdx.x & 31u;
    // bf16 values near 2^-10 (0x3A80 | small mantissa bits), two per 32-bit register.
    const unsigned lo = 0x3A80u | (lane & 0x3Fu);
    const unsigned hi = 0x3A80u | ((lane * 7u) & 0x3Fu);
    const unsigned a0 = lo | (hi << 16), a1 = hi | (lo << 16);
    const unsigned a2 = a0 ^ 0x00010001u, a3 = a1 ^ 0x00020002u;
    const unsigned b0 = a1 ^ 0x00040004u, b1 = a0 ^ 0x00080008u;
    float acc[CHAINS][4];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[c][j] = 0.0f;
        }
    }
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
    }
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
        sum += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    }
    if (sum == -1.0f) {
        out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
    }
}
