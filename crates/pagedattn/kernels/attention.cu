// Attention over the paged KV cache or over the call's key/value tensors: the function of
// docs/semantics.md, accumulated in f32. Compiled after elements.cuh.
//
// A thread block (CTA) runs one work unit of the plan (crates/pagedattn/src/cuda/plan.rs):
// one sequence, one kv head, some of its query rows (tokens x query heads of that kv head,
// which share every key and value load: GQA), over a range of key positions. It walks the
// keys in tiles: decodes the tile's keys and values into shared memory as f32 (the query
// rows too, once), scores every (row, key) pair, folds each row's scores into its online
// softmax state (running max m, running sum l) and adds the weighted values into the rows'
// accumulators (in shared memory: every loop but the dot product and P.V stays a plain loop,
// which keeps each variant's code, and NVRTC's time per variant, small). A unit that covers
// all of its rows' keys writes the output; a split-K unit (one partition of a long decode)
// writes its (m, l, attended, acc) partial to the workspace, which attention_merge.cu
// combines.
//
// Variants are template parameters: the activation type E, the key/value storage C, the head
// size D and the score modifiers (mask, ALiBi, soft cap), so that no inner loop branches on a
// setting; the library instantiates each variant it needs through a generated
// ATTENTION_KERNELS line (src/cuda/variant.rs) and compiles it with NVRTC at first use.
//
// The contract's edges, and where they are met:
// * positions are exact integers (i64): masks compare integers; ALiBi's distance j - i is an
//   integer difference rounded once to f32 (cross attention measures it from the last
//   encoder key, which only drops a constant of the row; see the rows' setup);
// * a key a row does not attend (masked, outside the window, outside the unit, a padding
//   token) is never multiplied into that row's P.V: 0 * NaN would be NaN. Keys that are not
//   keys at all (positions past the sequence, padding tokens, unused cache slots, table
//   entries past the sequence) are never read;
// * scores follow IEEE arithmetic in f32: the scale multiplies the dot product (one f32
//   factor, scale * k_scale), overflow gives infinities; the max ignores NaN scores (as the
//   reference's fold does) while their exp poisons the row's sum; +Inf makes the row NaN
//   (Inf - Inf); a -Inf score weighs 0 and its value still enters as 0 * v;
// * a row whose running max is still -Inf at the end attended only -Inf (or NaN) scores and
//   is NaN, unless it attended no key at all, which gives exactly 0: the `attended` flag
//   tells the two apart, also across split-K partials.

// The fields of one sequence in the plan's `seqs` section (i64 each); plan.rs writes them in
// this order.
enum {
    SEQ_QUERY_START,  // index of the sequence's first query token in the call
    SEQ_KEYS,         // key positions n
    SEQ_FIRST_POS,    // position of the first query (decoder, cross: context length; else 0)
    SEQ_KEY_BASE,     // paged: index of its first block in `tables`; dense: its first key row
    SEQ_NEW_START,    // first position that is a new token whose slot may be -1 (n: none)
    SEQ_SLOT_BASE,    // index in `slots` of position SEQ_NEW_START
    SEQ_FIELDS
};

// The fields of one work unit in the plan's unit sections.
enum {
    UNIT_SEQ,        // sequence
    UNIT_KV_HEAD,    // kv head
    UNIT_TOKEN,      // first query token, counted from the sequence's first
    UNIT_TOKENS,     // query tokens
    UNIT_HEAD,       // first query head inside the kv head's group
    UNIT_HEADS,      // query heads: rows = tokens * heads, row r is (token r / heads,
                     // head r % heads)
    UNIT_KEY_START,  // key positions visited: [start, end)
    UNIT_KEY_END,
    UNIT_PART_BASE,  // split-K: row r writes partial slot base + r * parts + part; -1: output
    UNIT_PARTS,
    UNIT_PART,
    UNIT_FIELDS
};

// Mask kinds: non-causal (encoder types, cross attention), causal, causal with a window.
enum { MASK_NONE = 0, MASK_CAUSAL = 1, MASK_WINDOW = 2 };

// The arguments of every attention kernel; attention.rs mirrors this struct (repr(C)).
struct Params {
    const void* query;   // [T, H, D] of E
    const void* key;     // cache [NB, Hkv, B, D] of C, or the call's keys [Tk, Hkv, D] of E
    const void* value;   // same layout as key
    void* output;        // [T, H, D] of E
    float* partials;     // split-K partial records of D + 4 floats: m, l, attended, -, acc[D]
    const i64* seqs;     // SEQ_FIELDS per sequence
    const i64* tables;   // the block table entries the sequences' keys need, compacted
    const i64* slots;    // the new tokens' slots (the write's slot mapping)
    const i64* units;    // UNIT_FIELDS per thread block
    const float* slopes; // [H] ALiBi slopes (when ALiBi is on)
    i64 block_size;
    i64 window;          // W (MASK_WINDOW only)
    i64 num_heads;
    i64 num_kv_heads;
    i64 group;           // query heads per kv head
    i64 paged;           // keys and values are read through the block tables
    float score_scale;   // scale * k_scale: multiplies each dot product
    float out_scale;     // v_scale: multiplies each finished weighted sum
    float soft_cap;
    float unused;
};

constexpr int THREADS = 128;
constexpr int WARPS = THREADS / 32;
// Query rows of a decode unit (the query heads of one kv head, one token) and of a prefill
// unit (tokens x heads).
constexpr int DECODE_ROWS = 8;
constexpr int PREFILL_ROWS = 16;

// Static shared memory of a unit's tiles, in floats: queries and accumulators, keys (rows
// padded by one float, so that threads scoring different keys hit different banks), values,
// probabilities.
constexpr int tile_floats(int rows, int d, int keys) {
    return 2 * rows * d + keys * (d + 1) + keys * d + rows * keys;
}
// Keys per tile: the most of 32, 16, 8, 4 whose tiles fit in 44 KiB (static shared memory is
// limited to 48 KiB per block; the rest holds the per-row state).
constexpr bool fits(int rows, int d, int keys) {
    return tile_floats(rows, d, keys) * 4 <= 44 * 1024;
}
constexpr int key_tile(int rows, int d) {
    return fits(rows, d, 32) ? 32 : fits(rows, d, 16) ? 16 : fits(rows, d, 8) ? 8 : 4;
}

template <class E, class C, int D, int MASK, bool ALIBI, bool CAP, int ROWS>
__device__ __forceinline__ void attend(const Params& p) {
    constexpr int KT = key_tile(ROWS, D);
    static_assert(KT <= 32 && fits(ROWS, D, KT), "one lane per key in the softmax step");

    __shared__ float q_s[ROWS][D];
    __shared__ float o_s[ROWS][D];  // the rows' weighted sums of values
    __shared__ float k_s[KT][D + 1];
    __shared__ float v_s[KT][D];
    __shared__ float p_s[ROWS][KT];
    __shared__ i64 key_row[KT];  // element offset of a tile key's row; -1: not a key
    __shared__ i64 lo_s[ROWS];   // the keys a row attends inside the unit: [lo, hi)
    __shared__ i64 hi_s[ROWS];
    __shared__ i64 pos_s[ROWS];  // the row's query position
    __shared__ float slope_s[ROWS];
    __shared__ float m_s[ROWS];  // online softmax: running max, running sum, rescale factor
    __shared__ float l_s[ROWS];
    __shared__ float alpha_s[ROWS];
    __shared__ int attended_s[ROWS];  // whether the row attended at least one key
    __shared__ u32 mask_s[ROWS];      // bit t: the row attends the tile's key t

    const typename E::Bits* query = (const typename E::Bits*)p.query;
    const typename C::Type* keys = (const typename C::Type*)p.key;
    const typename C::Type* values = (const typename C::Type*)p.value;
    typename E::Bits* output = (typename E::Bits*)p.output;

    const i64* unit = p.units + (i64)blockIdx.x * UNIT_FIELDS;
    const i64* seq = p.seqs + unit[UNIT_SEQ] * SEQ_FIELDS;
    const i64 kv_head = unit[UNIT_KV_HEAD];
    const i64 first_token = seq[SEQ_QUERY_START] + unit[UNIT_TOKEN];
    const int heads = (int)unit[UNIT_HEADS];  // <= ROWS
    const i64 first_head = kv_head * p.group + unit[UNIT_HEAD];
    const int rows = (int)(unit[UNIT_TOKENS] * heads);
    const i64 key_start = unit[UNIT_KEY_START];
    const i64 key_end = unit[UNIT_KEY_END];
    const i64 new_start = seq[SEQ_NEW_START];
    // Key positions are below 2^31 - 1 (the metadata's lengths are i32): a block size clamped
    // to that divides them as the real one does, in 32 bits.
    const u32 block_div = p.block_size < 0x7fffffff ? (u32)p.block_size : 0x7fffffffu;
    const int tid = threadIdx.x;

    // Each row's position, attended key range and slope; rows past `rows` attend nothing.
#pragma unroll 1
    for (int r = tid; r < ROWS; r += THREADS) {
        i64 lo = 0, hi = 0, pos = 0;
        float slope = 0.0f;
        if (r < rows) {
            pos = seq[SEQ_FIRST_POS] + unit[UNIT_TOKEN] + r / heads;
            if (MASK == MASK_NONE && ALIBI) {
                // A cross-attention query past every encoder key: its bias -slope * (i - j)
                // is -slope * (n - 1 - j) plus a constant of the row, which the softmax
                // ignores (as the cpu backend does). Position n - 1 keeps the distances small,
                // exact, and the scores free of a huge constant that f32 would round them
                // into. (Encoder types' queries are keys' positions already; non-causal
                // positions serve nothing else.)
                pos = min(pos, seq[SEQ_KEYS] - 1);
            }
            lo = key_start;
            hi = key_end;
            if (MASK != MASK_NONE) {
                hi = min(hi, pos + 1);
            }
            if (MASK == MASK_WINDOW) {
                // i - W < j: no overflow, pos >= 0 and W <= i64 max.
                lo = max(lo, pos + 1 - p.window);
            }
            if (ALIBI) {
                slope = p.slopes[first_head + r % heads];
            }
        }
        lo_s[r] = lo;
        hi_s[r] = hi;
        pos_s[r] = pos;
        slope_s[r] = slope;
        m_s[r] = -f32_inf();
        l_s[r] = 0.0f;
        attended_s[r] = 0;
    }
#pragma unroll 1
    for (int x = tid; x < ROWS * D; x += THREADS) {
        const int r = x / D, d = x % D;
        float q = 0.0f;
        if (r < rows) {
            const i64 token = first_token + r / heads;
            const i64 head = first_head + r % heads;
            q = E::to_f32(query[(token * p.num_heads + head) * D + d]);
        }
        q_s[r][d] = q;
        o_s[r][d] = 0.0f;
    }
    // The rows' state is read by other threads from here on (also when there is no tile).
    __syncthreads();
    for (i64 tile = key_start; tile < key_end; tile += KT) {
        // Where each key of the tile is stored, if it is a key (inside the unit, and not a
        // new token with slot -1). The previous tile's readers are past the barrier at the
        // end of the loop.
#pragma unroll 1
        for (int t = tid; t < KT; t += THREADS) {
            const i64 j = tile + t;
            i64 row = -1;
            // (Short-circuit: a slot is looked up only for a new token inside the unit.)
            const bool is_key = j < key_end && (j < new_start ||
                                                p.slots[seq[SEQ_SLOT_BASE] + j - new_start] >= 0);
            if (is_key) {
                if (p.paged) {
                    const u32 jj = (u32)j;
                    const i64 block = p.tables[seq[SEQ_KEY_BASE] + jj / block_div];
                    row = ((block * p.num_kv_heads + kv_head) * p.block_size + jj % block_div) * D;
                } else {
                    row = ((seq[SEQ_KEY_BASE] + j) * p.num_kv_heads + kv_head) * D;
                }
            }
            key_row[t] = row;
        }
        __syncthreads();
#pragma unroll 1
        for (int x = tid; x < KT * D; x += THREADS) {
            const int t = x / D, d = x % D;
            const i64 row = key_row[t];
            float k = 0.0f, v = 0.0f;
            if (row >= 0) {
                k = C::read(keys[row + d]);
                v = C::read(values[row + d]);
            }
            k_s[t][d] = k;
            v_s[t][d] = v;
        }
        __syncthreads();

        // Scores of the attended (row, key) pairs, each rounded to f32's range step by step.
#pragma unroll 1
        for (int x = tid; x < ROWS * KT; x += THREADS) {
            const int r = x / KT, t = x % KT;
            const i64 j = tile + t;
            float s = 0.0f;
            if (key_row[t] >= 0 && j >= lo_s[r] && j < hi_s[r]) {
                float dot = 0.0f;
#pragma unroll 8
                for (int d = 0; d < D; ++d) {
                    dot = fmaf(q_s[r][d], k_s[t][d], dot);
                }
                s = dot * p.score_scale;
                if (CAP) {
                    s = p.soft_cap * tanhf(s / p.soft_cap);
                }
                if (ALIBI) {
                    // The distance as an integer, rounded to f32 once.
                    const float distance = (float)(j - pos_s[r]);
                    s = MASK == MASK_NONE ? fmaf(-slope_s[r], fabsf(distance), s)
                                          : fmaf(slope_s[r], distance, s);
                }
            }
            p_s[r][t] = s;
        }
        __syncthreads();

        // Online softmax, one warp per row, one lane per key: the new running max (NaN
        // ignored), the probabilities relative to it, the rescale factor of the old state.
        const int warp = tid / 32, lane = tid % 32;
        for (int r = warp; r < ROWS; r += WARPS) {
            const i64 j = tile + lane;
            const bool attends = lane < KT && key_row[lane < KT ? lane : 0] >= 0 &&
                                 j >= lo_s[r] && j < hi_s[r];
            const float s = attends ? p_s[r][lane] : -f32_inf();
            float tile_max = s;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
            }
            const float m_old = m_s[r];
            const float m_new = fmaxf(m_old, tile_max);
            float prob = 0.0f;
            if (attends) {
                // With the max still -Inf every score so far is -Inf or NaN: -Inf weighs 0
                // (exp(-Inf - -Inf) would be NaN), NaN stays NaN.
                prob = m_new == -f32_inf() ? (s != s ? s : 0.0f) : expf(s - m_new);
            }
            if (lane < KT) {
                p_s[r][lane] = prob;
            }
            float sum = prob;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                sum += __shfl_xor_sync(0xffffffffu, sum, o);
            }
            const u32 mask = __ballot_sync(0xffffffffu, attends);
            if (lane == 0) {
                // An unchanged max rescales by exactly 1 (also -Inf to -Inf and +Inf to +Inf).
                const float alpha = m_old == m_new ? 1.0f : expf(m_old - m_new);
                alpha_s[r] = alpha;
                l_s[r] = l_s[r] * alpha + sum;
                m_s[r] = m_new;
                attended_s[r] |= mask != 0 ? 1 : 0;
                mask_s[r] = mask;
            }
        }
        __syncthreads();

        // P.V: only the keys each row attends enter its sum (a select, not a product by 0).
#pragma unroll 1
        for (int x = tid; x < ROWS * D; x += THREADS) {
            const int r = x / D, d = x % D;
            const u32 mask = mask_s[r];
            float acc = o_s[r][d] * alpha_s[r];
            for (int t = 0; t < KT; ++t) {
                const float a = fmaf(p_s[r][t], v_s[t][d], acc);
                acc = (mask >> t) & 1u ? a : acc;
            }
            o_s[r][d] = acc;
        }
        __syncthreads();
    }

    // The output (normalized, v_scale applied), or this partition's partial.
    const i64 part_base = unit[UNIT_PART_BASE];
#pragma unroll 1
    for (int x = tid; x < rows * D; x += THREADS) {
        const int r = x / D, d = x % D;
        const float acc = o_s[r][d];
        if (part_base < 0) {
            const float o = m_s[r] == -f32_inf() ? (attended_s[r] ? f32_nan() : 0.0f)
                                                 : acc * (p.out_scale / l_s[r]);
            const i64 token = first_token + r / heads;
            const i64 head = first_head + r % heads;
            output[(token * p.num_heads + head) * D + d] = E::from_f32(o);
        } else {
            float* record =
                p.partials + (part_base + r * unit[UNIT_PARTS] + unit[UNIT_PART]) * (D + 4);
            if (d == 0) {
                record[0] = m_s[r];
                record[1] = l_s[r];
                record[2] = attended_s[r] ? 1.0f : 0.0f;
            }
            record[4 + d] = acc;
        }
    }
}

// One variant: its decode kernel (units of one query token) and prefill kernel (units of
// several), NAME_decode and NAME_prefill.
#define ATTENTION_KERNELS(NAME, E, C, D, MASK, ALIBI, CAP)                                    \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_decode(const Params p) {    \
        attend<E, C, D, MASK, ALIBI, CAP, DECODE_ROWS>(p);                                    \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_prefill(const Params p) {   \
        attend<E, C, D, MASK, ALIBI, CAP, PREFILL_ROWS>(p);                                   \
    }
