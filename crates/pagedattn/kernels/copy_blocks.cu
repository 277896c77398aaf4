// Block copies inside every layer's KV cache, all layers in one launch (vLLM's copy_blocks,
// used for copy-on-write).
//
// `table` holds, per layer, the key buffer's address, the value buffer's address and the
// size of one block in bytes; then `num_pairs` (source block, destination block) pairs.
// Pairs apply in order, as on the host: a destination may be the source of a later pair, so
// one thread block owns one (layer, key or value) buffer and copies its pairs one after
// another, synchronizing its threads between two pairs.

typedef unsigned char u8;
typedef unsigned long long u64;
typedef long long i64;

// 16 bytes, copied as one access when a block's size allows it.
struct alignas(16) Chunk {
    u64 lo, hi;
};

// grid = (num_layers, 2): blockIdx.y picks the key (0) or value (1) buffer. The argument,
// CopyBlocksParams (table, num_layers, num_pairs), is generated before this file from
// src/cuda/kernels.rs.
extern "C" __global__ void copy_blocks(const CopyBlocksParams args) {
    const u64* table = args.table;
    const i64 num_layers = args.num_layers, num_pairs = args.num_pairs;
    const u64* layer = table + 3 * blockIdx.x;
    u8* base = (u8*)layer[blockIdx.y];
    const u64 block_bytes = layer[2];
    const u64* pairs = table + 3 * num_layers;
    // Buffers are allocated 256-byte aligned, so every block is 16-byte aligned when the block
    // size is a multiple of 16.
    const bool wide = block_bytes % sizeof(Chunk) == 0;
    for (i64 p = 0; p < num_pairs; ++p) {
        const u8* src = base + pairs[2 * p] * block_bytes;
        u8* dst = base + pairs[2 * p + 1] * block_bytes;
        if (src != dst) {
            if (wide) {
                const u64 n = block_bytes / sizeof(Chunk);
                for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
                    ((Chunk*)dst)[i] = ((const Chunk*)src)[i];
                }
            } else {
                for (u64 i = threadIdx.x; i < block_bytes; i += blockDim.x) {
                    dst[i] = src[i];
                }
            }
        }
        // The next pair may read what this one wrote.
        __syncthreads();
    }
}
