// The paged-KV loader: where a unit's sequence stores key position j (a block of the paged
// cache through the compacted block table, or a row of the call's own keys and values), and
// which positions are no keys at all (past the unit), which no kernel ever reads. Each
// mainloop gathers its tiles through these: prefill_mma.cuh's `request` / `publish` /
// `fetch`, prefill_sm90.cuh's producer warpgroup. (A sequence with a new token whose slot is -1,
// not written but still a key, reads every key from the call's private cache, through its own
// table: its units run in a launch of their own whose `p.key` / `p.value` are that cache;
// src/detached.rs.)

// The element offset of key position j's row in the key and value buffers: in block `block`
// of the paged cache (at j % block size), or row `key_base + j` of the call's own keys.
template <int D>
__device__ __forceinline__ i64 paged_offset(const Params& p, i64 block, i64 kv_head, u32 j,
                                            u32 block_div) {
    return ((block * p.num_kv_heads + kv_head) * p.block_size + j % block_div) * D;
}
template <int D>
__device__ __forceinline__ i64 dense_offset(const Params& p, i64 key_base, i64 kv_head, i64 j) {
    return ((key_base + j) * p.num_kv_heads + kv_head) * D;
}

// Where the unit's sequence stores key position j (< 2^31 - 1): the element offset of its
// row in the key and value buffers, or -1 if j is no key (at or past `key_end`).
template <int D>
__device__ __forceinline__ i64 key_offset(const Params& p, const i64* seq, i64 kv_head,
                                          i64 key_end, u32 block_div, i64 j) {
    if (j >= key_end) {
        return -1;
    }
    if (p.paged) {
        const u32 jj = (u32)j;
        return paged_offset<D>(p, p.tables[seq[SEQ_KEY_BASE] + jj / block_div], kv_head, jj,
                               block_div);
    }
    return dense_offset<D>(p, seq[SEQ_KEY_BASE], kv_head, j);
}

// Key positions are below 2^31 - 1 (the metadata's lengths are i32): a block size clamped to
// that divides them as the real one does, in 32 bits.
__device__ __forceinline__ u32 block_divisor(const Params& p) {
    return p.block_size < 0x7fffffff ? (u32)p.block_size : 0x7fffffffu;
}

// How the stored rows of a tile (elements of C) reach a tensor-core prefill's stage, which
// holds rows of D elements of E in 16-byte chunks (chunk c: elements 8c..8c+7, placed by the
// mainloop's layout: `at(c)`, its byte offset in the tile). A row is copied with cp.async in
// UNITS units of UNIT bytes (unit u from `source` into chunk `chunk(u)`).
// Rows of E are copied as they are, a chunk per unit. Rows of fp8 codes (WIDEN) are copied as
// codes, each unit into the chunk where its last elements will be (16 codes into chunk
// 2u + 1, or 8 codes, where a row is no multiple of 16 bytes, into the front of chunk u);
// once its copy landed, the thread that issued it widens the unit in place into E (`widen`,
// exact: every code's value is an f16 and a bf16). A unit's codes and elements share no byte
// with another unit's, so no thread waits for another to widen.
template <class C, class E, int D>
struct StageRows {
    typedef typename C::Type Stored;
    static constexpr bool WIDEN = sizeof(Stored) == 1;
    static constexpr int ROW_BYTES = D * (int)sizeof(Stored);
    static constexpr int UNIT = ROW_BYTES % 16 == 0 ? 16 : 8;
    static constexpr int UNITS = ROW_BYTES / UNIT;
    static_assert(ROW_BYTES % 8 == 0, "rows of whole 8-byte units");
    static_assert(WIDEN || (sizeof(Stored) == sizeof(typename E::Bits) && UNIT == 16),
                  "rows of E in 16-byte chunks");

    // The chunk unit u is copied into.
    static __device__ __forceinline__ int chunk(int u) {
        return WIDEN && UNIT == 16 ? 2 * u + 1 : u;
    }

    // Unit u of the row at element offset `off` of `buffer` (any valid address for no key:
    // off < 0, whose copy reads nothing and fills zeros).
    static __device__ __forceinline__ const Stored* source(const void* buffer, i64 off, int u) {
        return (const Stored*)buffer + (off >= 0 ? off : 0) + u * (UNIT / (int)sizeof(Stored));
    }

    // Unit u (landed) widened into E in the tile at `tile`.
    template <class At>
    static __device__ __forceinline__ void widen(u8* tile, At at, int u) {
        static_assert(WIDEN, "only codes widen");
        auto pairs = [](u32 codes, u32& lo, u32& hi) {
            C::quad_to_f16x2(codes, lo, hi);
            lo = E::from_f16x2(lo);
            hi = E::from_f16x2(hi);
        };
        U128 a, b;
        if constexpr (UNIT == 16) {
            const U128 codes = *(const U128*)(tile + at(chunk(u)));
            pairs(codes.x, a.x, a.y);
            pairs(codes.y, a.z, a.w);
            pairs(codes.z, b.x, b.y);
            pairs(codes.w, b.z, b.w);
            *(U128*)(tile + at(2 * u)) = a;
            *(U128*)(tile + at(chunk(u))) = b;
        } else {
            const u64 codes = *(const u64*)(tile + at(chunk(u)));
            pairs((u32)codes, a.x, a.y);
            pairs((u32)(codes >> 32), a.z, a.w);
            *(U128*)(tile + at(u)) = a;
        }
    }
};
