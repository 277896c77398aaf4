// The paged-KV loader: where a unit's sequence stores key position j (a block of the paged
// cache through the compacted block table, or a row of the call's own keys and values), and
// which positions are no keys at all (past the unit, or a new token whose slot is -1), which
// no kernel ever reads. Each mainloop gathers its tiles through these: prefill_mma.cuh's
// `request` / `publish` / `fetch`, prefill_sm90.cuh's producer warpgroup.

// Whether position j is a key of a unit whose keys end at `key_end`: a cached token, or a new
// token (j >= new_start) whose slot, read by the caller only for those, is not -1.
__device__ __forceinline__ bool is_key(i64 j, i64 key_end, i64 new_start, i64 slot) {
    return j < key_end && (j < new_start || slot >= 0);
}

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
// row in the key and value buffers, or -1 if j is no key (at or past `key_end`, or a new
// token whose slot is -1; the slot is looked up only for a new token inside the unit).
template <int D>
__device__ __forceinline__ i64 key_offset(const Params& p, const i64* seq, i64 kv_head,
                                          i64 key_end, u32 block_div, i64 j) {
    const i64 new_start = seq[SEQ_NEW_START];
    const i64 slot =
        j < key_end && j >= new_start ? p.slots[seq[SEQ_SLOT_BASE] + j - new_start] : 0;
    if (!is_key(j, key_end, new_start, slot)) {
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
