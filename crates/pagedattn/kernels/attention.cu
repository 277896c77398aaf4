// Attention over the paged KV cache or over the call's key/value tensors: the function of
// docs/semantics.md, accumulated in f32. Compiled after elements.cuh.
//
// A thread block (CTA) runs one work unit of the plan (crates/pagedattn/src/cuda/plan.rs):
// one sequence, one kv head, some of its query rows (tokens x query heads of that kv head,
// which share every key and value load: GQA), over a range of key positions. Three kernels:
// * `decode` (units of one query token, up to 8 query heads): keys and values straight from
//   global memory in 16-byte loads, several keys in flight per thread, a group of lanes per
//   key (8 dimensions each) reducing the dot products with warp shuffles, the kv head's
//   query heads sharing every load; the four warps walk interleaved key chunks with their own
//   online softmax and are merged exactly at the end. A split-K unit (one partition of a long
//   decode) writes its (m, l, attended, acc) partial to the workspace, which
//   attention_merge.cu combines.
// * `prefill_mma` (bf16 and f16 activations with keys and values stored as such): 128 rows
//   per CTA, 32 per warp (64 and 16 above D = 128, two CTAs per unit), FlashAttention-2
//   style on the tensor cores (mma.sync m16n8k16, f32 accumulators): key/value tiles
//   gathered through the block table with cp.async into a two-stage shared-memory pipeline,
//   query fragments in registers (up to D = 64) or read from shared memory per tile, the
//   online softmax on the score fragments in registers, probabilities rounded to the
//   activation type for P.V.
// * `prefill_scalar` (f32 activations and fp8 caches): 16 of the unit's rows per CTA
//   (blockIdx.y picks which), tiles converted to f32 in shared memory, scalar dot products.
//
// Variants are template parameters: the activation type E, the key/value storage C, the head
// size D and the score modifiers (mask, ALiBi, soft cap), so that no inner loop branches on a
// setting; the library instantiates each variant it needs through a generated
// ATTENTION_KERNELS line (src/cuda/variant.rs) and compiles it with NVRTC at first use.
//
// The contract's edges, and where they are met (every kernel):
// * positions are exact integers: masks compare integers; ALiBi's distance j - i is an
//   integer difference rounded once to f32 (cross attention measures it from the last
//   encoder key, which only drops a constant of the row; see `row_of`);
// * a key a row does not attend (masked, outside the window, outside the unit, a padding
//   token) never reaches that row's output: 0 * NaN would be NaN. Keys that are not keys at
//   all (positions past the unit, padding tokens, unused cache slots, table entries past
//   the sequence) are never read: the scalar kernels skip them, the tensor-core kernel
//   zero-fills their tile rows (and then 0 * 0 enters). A masked score is replaced by -Inf
//   (a select, not arithmetic), and a masked key's value is never multiplied into the row:
//   the scalar kernels select, the tensor-core kernel runs the P.V of a tile where some row
//   masks some key (the diagonal, a window's edge) through selects whenever that tile holds
//   a non-finite value;
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
    UNIT_KEY_START,  // key positions visited: [start, end), the union of the rows' keys
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
constexpr u32 FULL = 0xffffffffu;
// Query rows of a decode unit (the query heads of one kv head, one token), of a prefill unit
// (tokens x heads; plan.rs's PREFILL_ROWS), and of the scalar prefill's CTAs (a unit's rows
// take PREFILL_ROWS / SCALAR_ROWS of them, blockIdx.y).
constexpr int DECODE_ROWS = 8;
constexpr int PREFILL_ROWS = 128;
constexpr int SCALAR_ROWS = 16;
static_assert(PREFILL_ROWS % (16 * WARPS * 2) == 0 && PREFILL_ROWS % SCALAR_ROWS == 0 &&
                  DECODE_ROWS == 8,
              "whole CTAs of the tensor-core prefill (16 or 32 rows per warp) and of the "
              "scalar prefill per unit; decode8 covers a decode unit");

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

// One query row of a prefill unit: its position, the keys it attends ([lo, hi), inside the
// unit's range) and its ALiBi slope.
struct Row {
    i64 pos, lo, hi;
    float slope;
};

// Row r (< the unit's rows) of `unit`: token r / heads, query head r % heads of the unit.
template <int MASK, bool ALIBI>
__device__ __forceinline__ Row row_of(const Params& p, const i64* seq, const i64* unit, int r) {
    const int heads = (int)unit[UNIT_HEADS];
    Row row;
    row.pos = seq[SEQ_FIRST_POS] + unit[UNIT_TOKEN] + r / heads;
    if (MASK == MASK_NONE && ALIBI) {
        // A cross-attention query past every encoder key: its bias -slope * (i - j) is
        // -slope * (n - 1 - j) plus a constant of the row, which the softmax ignores (as the
        // cpu backend does). Position n - 1 keeps the distances small, exact, and the scores
        // free of a huge constant that f32 would round them into. (Encoder types' queries
        // are keys' positions already; non-causal positions serve nothing else.)
        row.pos = min(row.pos, seq[SEQ_KEYS] - 1);
    }
    row.lo = unit[UNIT_KEY_START];
    row.hi = unit[UNIT_KEY_END];
    if (MASK != MASK_NONE) {
        row.hi = min(row.hi, row.pos + 1);
    }
    if (MASK == MASK_WINDOW) {
        // i - W < j: no overflow, pos >= 0 and W <= i64 max.
        row.lo = max(row.lo, row.pos + 1 - p.window);
    }
    row.slope = 0.0f;
    if (ALIBI) {
        row.slope = p.slopes[unit[UNIT_KV_HEAD] * p.group + unit[UNIT_HEAD] + r % heads];
    }
    return row;
}

// Step 2 and 3 of the contract after the scaled dot product `s` (already rounded to f32's
// range): the soft cap, then ALiBi with the integer distance j - pos rounded once.
template <int MASK, bool ALIBI, bool CAP>
__device__ __forceinline__ float modify_score(const Params& p, float s, i64 distance,
                                              float slope) {
    if (CAP) {
        s = p.soft_cap * tanhf(s / p.soft_cap);
    }
    if (ALIBI) {
        const float d = (float)distance;
        s = MASK == MASK_NONE ? fmaf(-slope, fabsf(d), s) : fmaf(slope, d, s);
    }
    return s;
}

// The finished row: normalized with v_scale applied, NaN for a row that attended only -Inf
// (or NaN) scores, exactly 0 for a row that attended no key. `finish_by` takes the row's
// factor v_scale / l computed once; `finish_f64` the same for f64 sums (rounded once).
__device__ __forceinline__ float finish_by(float acc, float m, bool attended, float factor) {
    return m == -f32_inf() ? (attended ? f32_nan() : 0.0f) : acc * factor;
}
__device__ __forceinline__ float finish_f64(double acc, float m, bool attended, double factor) {
    return m == -f32_inf() ? (attended ? f32_nan() : 0.0f) : (float)(acc * factor);
}

// ---------------------------------------------------------------------------------------------
// The scalar prefill: f32 activations and fp8 caches.
// ---------------------------------------------------------------------------------------------

// Static shared memory of the scalar prefill's tiles, in floats: queries, keys (rows padded
// by one float, so that threads scoring different keys hit different banks), values,
// probabilities.
constexpr int tile_floats(int rows, int d, int keys) {
    return rows * d + keys * (d + 1) + keys * d + rows * keys;
}
// Keys per tile: the most of 32, 16, 8, 4 whose tiles fit in 44 KiB (static shared memory is
// limited to 48 KiB per block; the rest holds the per-row state).
constexpr bool fits(int rows, int d, int keys) {
    return tile_floats(rows, d, keys) * 4 <= 44 * 1024;
}
constexpr int key_tile(int rows, int d) {
    return fits(rows, d, 32) ? 32 : fits(rows, d, 16) ? 16 : fits(rows, d, 8) ? 8 : 4;
}

// SCALAR_ROWS rows of a prefill unit (from row blockIdx.y * SCALAR_ROWS): it walks the keys
// in tiles, decodes each tile's keys and values into shared memory as f32 (the query rows
// too, once), scores every (row, key) pair, folds each row's scores into its online softmax
// state (running max m, running sum l) and adds the weighted values into the rows'
// accumulators (every loop but the dot product and P.V stays a plain loop, which keeps each
// variant's code, and NVRTC's time per variant, small).
//
// The running sums are f64 (l in shared memory, the accumulators in registers: thread tid
// owns elements tid + i THREADS of the rows' ROWS x D); a tile's weighted values are summed in
// f32 from 0 and then added, so an f32 sum takes at most KT <= 32 keys (31 2^-24 = 1.8e-6
// of its magnitudes' sum at worst) and an f64 one a term per tile of KT >= 8 keys (at most
// 2^28: 2^-25 at worst). Accumulated in f32 across tiles, l took a term per tile and the
// accumulators every key of the row: up to 2^31 terms, whose bound (n - 1) 2^-24 exceeds 1.
template <class E, class C, int D, int MASK, bool ALIBI, bool CAP>
__device__ __forceinline__ void prefill_scalar(const Params& p) {
    constexpr int ROWS = SCALAR_ROWS;
    constexpr int KT = key_tile(ROWS, D);
    static_assert(KT <= 32 && fits(ROWS, D, KT), "one lane per key in the softmax step");
    __shared__ float q_s[ROWS][D];
    __shared__ float k_s[KT][D + 1];
    __shared__ float v_s[KT][D];
    __shared__ float p_s[ROWS][KT];
    __shared__ i64 key_row[KT];  // element offset of a tile key's row; -1: not a key
    __shared__ i64 lo_s[ROWS];   // the keys a row attends inside the unit: [lo, hi)
    __shared__ i64 hi_s[ROWS];
    __shared__ i64 pos_s[ROWS];  // the row's query position
    __shared__ float slope_s[ROWS];
    __shared__ float m_s[ROWS];  // online softmax: running max, running sum, rescale factor
    __shared__ double l_s[ROWS];
    __shared__ double alpha_s[ROWS];
    __shared__ int attended_s[ROWS];  // whether the row attended at least one key
    __shared__ u32 mask_s[ROWS];      // bit t: the row attends the tile's key t

    const typename E::Bits* query = (const typename E::Bits*)p.query;
    const typename C::Type* keys = (const typename C::Type*)p.key;
    const typename C::Type* values = (const typename C::Type*)p.value;
    typename E::Bits* output = (typename E::Bits*)p.output;

    const i64* unit = p.units + (i64)blockIdx.x * UNIT_FIELDS;
    const i64* seq = p.seqs + unit[UNIT_SEQ] * SEQ_FIELDS;
    const i64 kv_head = unit[UNIT_KV_HEAD];
    const int heads = (int)unit[UNIT_HEADS];
    const int row_base = (int)blockIdx.y * ROWS;
    const int rows = min((int)(unit[UNIT_TOKENS] * heads) - row_base, ROWS);
    if (rows <= 0) {
        return;  // (uniform: the unit has fewer rows than this grid row starts at)
    }
    const i64 first_token = seq[SEQ_QUERY_START] + unit[UNIT_TOKEN];
    const i64 first_head = kv_head * p.group + unit[UNIT_HEAD];
    // The keys of these rows: the first row's lo and the last row's hi (both grow with the
    // token), inside the unit's union.
    const i64 key_start = row_of<MASK, ALIBI>(p, seq, unit, row_base).lo;
    const i64 key_end = row_of<MASK, ALIBI>(p, seq, unit, row_base + rows - 1).hi;
    const u32 block_div = block_divisor(p);
    const int tid = threadIdx.x;

    // Each row's position, attended key range and slope; rows past `rows` attend nothing.
#pragma unroll 1
    for (int r = tid; r < ROWS; r += THREADS) {
        Row row = {0, 0, 0, 0.0f};
        if (r < rows) {
            row = row_of<MASK, ALIBI>(p, seq, unit, row_base + r);
        }
        lo_s[r] = row.lo;
        hi_s[r] = row.hi;
        pos_s[r] = row.pos;
        slope_s[r] = row.slope;
        m_s[r] = -f32_inf();
        l_s[r] = 0.0;
        attended_s[r] = 0;
    }
#pragma unroll 1
    for (int x = tid; x < ROWS * D; x += THREADS) {
        const int r = x / D, d = x % D;
        float q = 0.0f;
        if (r < rows) {
            const i64 token = first_token + (row_base + r) / heads;
            const i64 head = first_head + (row_base + r) % heads;
            q = E::to_f32(query[(token * p.num_heads + head) * D + d]);
        }
        q_s[r][d] = q;
    }
    // This thread's accumulators: element x = tid + i THREADS is row x / D, dimension x % D.
    constexpr int PER_THREAD = ROWS * D / THREADS;
    static_assert(ROWS * D % THREADS == 0, "head sizes are multiples of 8");
    double o[PER_THREAD];
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        o[i] = 0.0;
    }
    // The rows' state is read by other threads from here on (also when there is no tile).
    __syncthreads();
    for (i64 tile = key_start; tile < key_end; tile += KT) {
        // Where each key of the tile is stored, if it is a key. The previous tile's readers
        // are past the barrier at the end of the loop.
#pragma unroll 1
        for (int t = tid; t < KT; t += THREADS) {
            key_row[t] = key_offset<D>(p, seq, kv_head, key_end, block_div, tile + t);
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
                s = modify_score<MASK, ALIBI, CAP>(p, dot * p.score_scale, j - pos_s[r],
                                                   slope_s[r]);
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
                tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL, tile_max, o));
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
                sum += __shfl_xor_sync(FULL, sum, o);
            }
            const u32 mask = __ballot_sync(FULL, attends);
            if (lane == 0) {
                // An unchanged max rescales by exactly 1 (also -Inf to -Inf and +Inf to +Inf).
                // In f64: a max that grows a little at every tile rescales the older keys
                // once per tile, and f32 factors would distort their weight against the
                // newer keys' by up to a rounding per tile.
                const double alpha = m_old == m_new ? 1.0 : exp((double)m_old - (double)m_new);
                alpha_s[r] = alpha;
                l_s[r] = fma(l_s[r], alpha, (double)sum);
                m_s[r] = m_new;
                attended_s[r] |= mask != 0 ? 1 : 0;
                mask_s[r] = mask;
            }
        }
        __syncthreads();

        // P.V: only the keys each row attends enter its sum (a select, not a product by 0).
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int x = tid + i * THREADS, r = x / D, d = x % D;
            const u32 mask = mask_s[r];
            float acc = 0.0f;
#pragma unroll 1
            for (int t = 0; t < KT; ++t) {
                const float a = fmaf(p_s[r][t], v_s[t][d], acc);
                acc = (mask >> t) & 1u ? a : acc;
            }
            o[i] = fma(o[i], alpha_s[r], (double)acc);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int x = tid + i * THREADS, r = x / D, d = x % D;
        if (r < rows) {
            const i64 token = first_token + (row_base + r) / heads;
            const i64 head = first_head + (row_base + r) % heads;
            output[(token * p.num_heads + head) * D + d] = E::from_f32(finish_f64(
                o[i], m_s[r], attended_s[r] != 0, (double)p.out_scale / l_s[r]));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared by the fast kernels.
// ---------------------------------------------------------------------------------------------

constexpr float LOG2E = 1.4426950408889634f;

// 2^x in one instruction (the special-function unit's approximation, within 2 ulp): results
// below 2^-126 flush to 0, which the contract allows for a weight (an underflowed weight),
// and NaN stays NaN. exp2f would add a range fix-up for those subnormal results to every
// score, which costs more than the rest of the softmax.
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The running max m as the softmax's base: with the max still -Inf every score so far is
// -Inf or NaN, and against base 0 -Inf weighs 0 (against -Inf it would be NaN) and NaN stays
// NaN.
__device__ __forceinline__ float softmax_base(float m) { return m == -f32_inf() ? 0.0f : m; }

// The weight e^(s - m) of a score s under a base from `softmax_base`, as 2^((s - m) log2(e))
// (one rounding more than e^(s - m), far inside the tolerance of f32 scores).
__device__ __forceinline__ float weight(float s, float base) {
    return exp2_fast((s - base) * LOG2E);
}

// The weight as 2^(x to_log2 - base log2(e)) in one FFMA, given base log2(e) (rounded once)
// and a value x whose score is x to_log2 / log2(e) (the score itself with to_log2 = log2(e),
// or the unscaled dot product with to_log2 = scale log2(e), rounded once), for a base where
// `foldable`: of magnitude at most 2^10, where those roundings move the weight by less than
// 1e-4 relative (2^10 log2(e) 2^-23 ln 2), far inside the 16-bit outputs' tolerance. Larger
// bases (huge scores) take `weight`, whose error does not grow with the base.
__device__ __forceinline__ bool foldable(float base) { return fabsf(base) <= 1024.0f; }
__device__ __forceinline__ float weight_folded(float s, float to_log2, float base_log2e) {
    return exp2_fast(fmaf(s, to_log2, -base_log2e));
}

// The factor rescaling a state of max m_old to the max m_new: an unchanged max rescales by
// exactly 1 (also -Inf to -Inf and +Inf to +Inf).
__device__ __forceinline__ float rescale(float m_old, float m_new) {
    return m_old == m_new ? 1.0f : exp2_fast((m_old - m_new) * LOG2E);
}

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

// ---------------------------------------------------------------------------------------------
// The tensor-core prefill: bf16 and f16.
// ---------------------------------------------------------------------------------------------

// Four 8x8 matrices of 16-bit elements from shared memory; lane l gives the address of row
// l % 8 of matrix l / 8, and register i receives matrix i's (row lane / 4, columns
// 2 (lane % 4) and 2 (lane % 4) + 1); `.trans` delivers the transposed matrices.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// Hopper's warpgroup MMA (wgmma, sm_90a): the four warps of the CTA multiply together, the
// tensor cores reading B (and for S = Q K^T also A) straight from shared memory, once for all
// 64 rows of an m64 block: a fraction of the shared-memory traffic of mma.sync's fragments,
// which is what bounds the mma.sync prefill. Operands live in the 128-byte-swizzled layout
// (`MmaShape::chunk_at`); a descriptor names a tile's start inside a 1024-byte-aligned
// swizzle atom, `lbo` bytes between its 64-element atoms along N (N-major B only) and 1024
// bytes between its groups of 8 rows.
template <class E>
struct Wgmma;
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
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
#endif

// The tensor-core prefill's tiles. Rows of keys, values and queries are D elements padded
// with zero columns to DP, a multiple of the mma's k = 16. For mma.sync they are stored
// DP + 8 elements apart: the 16 bytes of padding put the 8 rows an ldmatrix reads in 8
// different 4-bank groups for every head size (row strides of 4, 12, 20 or 28 banks modulo
// 32). For wgmma (sm_90a, DP = 128) they are in the 128-byte-swizzled layout the tensor cores
// read: 64-element atoms, each a column of 128-byte lines (one per row) whose 16-byte chunk c
// sits at position c ^ (row % 8), also free of bank conflicts for cp.async and the scans.
// A warp holds MT row blocks of 16 (MT = 2 up to D = 128: each key and value fragment read
// from shared memory feeds two mma, and a tile's copies serve twice the rows; 1 above, where
// the accumulators would not fit), so a CTA runs CTA_ROWS rows and a unit's PREFILL_ROWS take
// PREFILL_ROWS / CTA_ROWS CTAs. With wgmma, row block mt of warp w is rows 64 mt + 16 w (the
// warp's part of m64 block mt), else 16 (MT w + mt).
// Dynamic shared memory: two stages of key tiles, two of value tiles, then the query tile
// (read into registers once, when Q_REGS) and the scratch of the P.V by selects (one row
// block at a time: in the query tile's bytes when the queries live in registers, else in the
// tile's own key stage when that is large enough: its keys are used up by then, else after
// the query tile); wgmma's atoms start 1024-byte aligned, ALIGN bytes allowing for that.
// src/cuda/variant.rs computes the padded layout's BYTES (`mma_shared_bytes`), which holds
// the swizzled one's too; the kernel checks what the launch gave.
template <int D>
struct MmaShape {
    static constexpr int DP = (D + 15) / 16 * 16;
    static constexpr int MT = DP <= 128 ? 2 : 1;
    static constexpr int CTA_ROWS = 16 * WARPS * MT;
    static constexpr int KT = D <= 128 ? 64 : 32;  // keys per tile
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    static constexpr bool WGMMA = DP == 128;
#else
    static constexpr bool WGMMA = false;
#endif
    static constexpr int ROW_BYTES = (DP + 8) * 2;  // the padded layout's
    // Byte offset of 16-byte chunk c of row t in a tile of `rows` rows.
    static __device__ __forceinline__ u32 chunk_at(int rows, int t, int c) {
        return WGMMA ? (c / 8) * rows * 128 + t * 128 + ((c % 8) ^ (t % 8)) * 16
                     : t * ROW_BYTES + c * 16;
    }
    static constexpr int TILE_BYTES = WGMMA ? KT * DP * 2 : KT * ROW_BYTES;
    // Query fragments in registers (MT * DP / 4 of them per thread), else read from shared
    // memory at every tile (by wgmma itself, with WGMMA).
    static constexpr bool Q_REGS = !WGMMA && MT * DP <= 128;
    static constexpr int Q_BYTES = WGMMA ? CTA_ROWS * DP * 2 : CTA_ROWS * ROW_BYTES;
    static constexpr int P_BYTES = WARPS * 16 * KT * 4;
    static constexpr bool SCRATCH_IN_KEYS = !Q_REGS && TILE_BYTES >= P_BYTES;
    static constexpr int SCRATCH = Q_REGS            ? (Q_BYTES > P_BYTES ? Q_BYTES : P_BYTES)
                                   : SCRATCH_IN_KEYS ? Q_BYTES
                                                     : Q_BYTES + P_BYTES;
    static constexpr int ALIGN = WGMMA ? 1024 : 16;
    static constexpr int BYTES = 4 * TILE_BYTES + SCRATCH + (ALIGN - 16);
};

// CTA_ROWS rows of a prefill unit (row block mt of warp w, as MmaShape says: rows + lane / 4
// and + 8 of it are this thread's, after the CTA's first row blockIdx.y * CTA_ROWS) over the
// unit's keys, in tiles of KT keys.
//
// Pipeline: tile i lands in stage i % 2 while tile i - 1 is computed. The block-table entries
// and slots of tile i's keys (threads 0..KT-1, one key each) are copied asynchronously while
// tile i - 2 is computed, and after it the same threads turn them into row offsets in
// off_s[i % 3], with a bit mask of the tile's non-keys (past the unit, slot -1), whose rows
// cp.async fills with zeros instead of reading: no thread waits on a lookup's global reads
// (a warp that did would hold the others at the next barrier). Per tile: S = Q K^T
// on the tensor cores (wgmma: after each thread's copies are fenced for the async proxy);
// the scale (unless `unscaled`), soft cap and ALiBi on the fragments; where the tile is
// `masked` (a non-key in it, or a row that does not attend all of it) a select puts -Inf on
// the scores rows do not attend; the online softmax per row (a quad of lanes holds a row); P
// rounded to E, then O += P V on the tensor cores. A masked tile where some row does not
// attend some key of it (`rows_full` false: the diagonal, a window's edge) is scanned for
// non-finite values first; if it holds one, its P.V runs through selects instead (`P_BYTES`
// of scratch), so that 0 * NaN never reaches a row that does not attend that key. (Non-keys
// are zeros: 0 * 0 enters.)
template <class E, int D, int MASK, bool ALIBI, bool CAP>
__device__ __forceinline__ void prefill_mma(const Params& p) {
    typedef MmaShape<D> S;
    constexpr int DP = S::DP, KT = S::KT, ROW_BYTES = S::ROW_BYTES, MT = S::MT;
    constexpr int CH = D / 8;   // 16-byte chunks of a stored row
    constexpr int NT = KT / 8;  // n-tiles of the scores
    constexpr int DT = DP / 8;  // n-tiles of the output
    static_assert(KT <= 64 && THREADS >= 64, "threads 0..63 look up a tile's keys");
    __shared__ i64 off_s[3][KT];     // element offset of each key's row; -1: not a key
    __shared__ i64 table_s[3][KT];   // paged: the block-table entry of each key
    __shared__ i64 slot_s[3][KT];    // each new token's slot
    __shared__ u32 invalid_s[3][2];  // bit t: key t of the tile is not a key
    __shared__ int range_s[2];       // the largest lo and the smallest hi of the real rows
    __shared__ i64 seq_s[3];         // the sequence's SEQ_NEW_START, SEQ_SLOT_BASE, SEQ_KEY_BASE

    u8* const given = dynamic_shared(S::BYTES);
    const u32 base = (smem_address(given) + S::ALIGN - 1) & ~(u32)(S::ALIGN - 1);
    u8* const smem = given + (base - smem_address(given));
    const u32 q_base = base + 4 * S::TILE_BYTES;

    typedef typename E::Bits Bits;
    const Bits* query = (const Bits*)p.query;
    const Bits* keys = (const Bits*)p.key;
    const Bits* values = (const Bits*)p.value;
    Bits* output = (Bits*)p.output;

    const i64* unit = p.units + (i64)blockIdx.x * UNIT_FIELDS;
    const i64* seq = p.seqs + unit[UNIT_SEQ] * SEQ_FIELDS;
    const i64 kv_head = unit[UNIT_KV_HEAD];
    const int heads = (int)unit[UNIT_HEADS];
    const int rows = (int)(unit[UNIT_TOKENS] * heads);  // <= PREFILL_ROWS
    const int row_base = blockIdx.y * S::CTA_ROWS;     // this CTA's first row of the unit
    const i64 first_token = seq[SEQ_QUERY_START] + unit[UNIT_TOKEN];
    const i64 first_head = kv_head * p.group + unit[UNIT_HEAD];
    // Key positions fit in an int (below 2^31 - 1).
    const int key_start = (int)unit[UNIT_KEY_START];
    const int key_end = (int)unit[UNIT_KEY_END];
    // (In 64 bits: key_end - key_start + KT - 1 overflows an int past 2^31 - KT keys. Below,
    // key positions j0 + t of a tile are likewise never formed in an int: the last tile's
    // may pass 2^31 - 1; they are compared as t against bounds minus j0.)
    const int tiles = (int)(((i64)key_end - key_start + KT - 1) / KT);
    const u32 block_div = block_divisor(p);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t4 = lane % 4;
    const bool unscaled = !ALIBI && !CAP && p.score_scale > 0.0f;  // see `scores`
    // Row ri of this thread's row block mt, counted in the unit.
    auto row_index = [&](int mt, int ri) {
        return row_base + (S::WGMMA ? 64 * mt + 16 * warp : 16 * (MT * warp + mt)) + g + 8 * ri;
    };

    // This thread's rows; rows past `rows` attend nothing (and are never written). The keys
    // a row attends, [lo, hi), are only needed on masked tiles: they wait in shared memory
    // (registers are what limits this kernel).
    __shared__ int lo_s[S::CTA_ROWS], hi_s[S::CTA_ROWS];
    int pos[MT][2], lo[MT][2], hi[MT][2];  // lo and hi: until the prologue's range
    float slope[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
            const int r = row_index(mt, ri);
            lo[mt][ri] = hi[mt][ri] = pos[mt][ri] = 0;
            slope[mt][ri] = 0.0f;
            if (r < rows) {
                const Row row = row_of<MASK, ALIBI>(p, seq, unit, r);
                // An empty range stays empty when clamped into the unit's keys.
                lo[mt][ri] = (int)row.lo;
                hi[mt][ri] = (int)max(row.hi, row.lo);
                pos[mt][ri] = (int)row.pos;
                slope[mt][ri] = row.slope;
            }
            if (t4 == 0) {
                lo_s[r - row_base] = lo[mt][ri];
                hi_s[r - row_base] = hi[mt][ri];
            }
        }
    }

    // Key t = tid of tile i (threads 0..KT-1): its slot (a new token) and block-table entry
    // (paged) copied into slot_s and table_s, one commit group (empty for the other threads
    // and past the tiles).
    auto request = [&](int i) {
        const i64 j = (i64)key_start + (i64)i * KT + tid;
        if (tid < KT && i < tiles && j < key_end) {
            const i64 new_start = seq_s[0];
            if (j >= new_start) {
                cp_async<8>(smem_address(&slot_s[i % 3][tid]), p.slots + seq_s[1] + j - new_start,
                            false);
            }
            if (p.paged) {
                cp_async<8>(smem_address(&table_s[i % 3][tid]),
                            p.tables + seq_s[2] + (u32)j / block_div, false);
            }
        }
        cp_async_commit();
    };
    // Tile i's row offsets from its requested entries (which must have landed) into shared
    // memory (threads 0..63; both warps vote on the non-key mask).
    auto publish = [&](int i) {
        if (tid < 64) {
            const i64 j = (i64)key_start + (i64)i * KT + tid;
            i64 off = -1;
            if (tid < KT && i < tiles &&
                is_key(j, key_end, seq_s[0], j >= seq_s[0] ? slot_s[i % 3][tid] : 0)) {
                off = p.paged ? paged_offset<D>(p, table_s[i % 3][tid], kv_head, (u32)j, block_div)
                              : dense_offset<D>(p, seq_s[2], kv_head, j);
            }
            if (tid < KT) {
                off_s[i % 3][tid] = off;
            }
            const u32 absent = __ballot_sync(FULL, tid < KT && off < 0);
            if (lane == 0) {
                invalid_s[i % 3][warp] = absent;
            }
        }
    };
    // Tile i's keys and values into stage i % 2 (zeros for non-keys), one commit group (empty
    // past the tiles).
    auto fetch = [&](int i) {
        const u32 k_dst = base + (i % 2) * S::TILE_BYTES;
        const u32 v_dst = k_dst + 2 * S::TILE_BYTES;
        constexpr int COPIES = (KT * CH + THREADS - 1) / THREADS;  // per thread
        // Where the threads divide into whole rows (CH a divisor of THREADS), a thread's
        // 16-byte column is the same in every copy: its part of the address is made once.
        constexpr bool FIXED_COL = THREADS % CH == 0;
        if (i < tiles) {
            // Every offset first: one shared-memory latency for the tile, not one per copy.
            i64 offs[COPIES];
#pragma unroll
            for (int k = 0; k < COPIES; ++k) {
                const int c = tid + k * THREADS;
                const int t = FIXED_COL ? tid / CH + k * (THREADS / CH) : c / CH;
                offs[k] = KT * CH % THREADS != 0 && c >= KT * CH ? -1 : off_s[i % 3][t];
            }
#pragma unroll
            for (int k = 0; k < COPIES; ++k) {
                const int c = tid + k * THREADS;
                if (KT * CH % THREADS != 0 && c >= KT * CH) {
                    break;
                }
                const int t = FIXED_COL ? tid / CH + k * (THREADS / CH) : c / CH;
                const int col = FIXED_COL ? tid % CH : c % CH;
                const u32 at = S::chunk_at(KT, t, col);
                // A non-key's row reads nothing (zeros), from any valid address.
                const i64 src = (offs[k] >= 0 ? offs[k] : 0) + col * 8;
                cp_async<16>(k_dst + at, keys + src, offs[k] < 0);
                cp_async<16>(v_dst + at, values + src, offs[k] < 0);
            }
        }
        cp_async_commit();
    };

    // Prologue: the sequence's fields, the padding columns of every stage (never written by
    // cp.async), the first two tiles' key lookups, the query tile (its own commit group, which
    // the loop's first wait covers), the first tile.
    if (tid == 0) {
        range_s[0] = -0x7fffffff - 1;
        range_s[1] = 0x7fffffff;
        seq_s[0] = seq[SEQ_NEW_START];
        seq_s[1] = seq[SEQ_SLOT_BASE];
        seq_s[2] = seq[SEQ_KEY_BASE];
    }
    if constexpr (DP > D) {
        constexpr int PAD = (DP - D) / 8;
        for (int c = tid; c < 4 * KT * PAD; c += THREADS) {
            const int row = c / PAD, col = CH + c % PAD;
            *(U128*)(smem + row / KT * S::TILE_BYTES + S::chunk_at(KT, row % KT, col)) =
                U128{0, 0, 0, 0};
        }
    }
    __syncthreads();
    request(0);
    request(1);
    for (int c = tid; c < S::CTA_ROWS * (DP / 8); c += THREADS) {
        const int r = c / (DP / 8), col = c % (DP / 8);
        const int ur = row_base + r;
        const bool real = ur < rows && col < CH;
        const i64 token = first_token + ur / heads, head = first_head + ur % heads;
        // Padding rows and columns: zeros, from any valid address.
        cp_async<16>(q_base + S::chunk_at(S::CTA_ROWS, r, col),
                     query + (real ? (token * p.num_heads + head) * D + col * 8 : 0), !real);
    }
    cp_async_commit();
    cp_async_wait<1>();
    publish(0);
    publish(1);
    __syncthreads();
    fetch(0);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
            if (row_index(mt, ri) < rows && t4 == 0) {
                atomicMax(&range_s[0], lo[mt][ri]);
                atomicMin(&range_s[1], hi[mt][ri]);
            }
        }
    }
    // Query fragments (A operands, row-major 16 x 16 per k-step) of row block mt.
    auto q_lane = [&](int mt) {
        return q_base +
               (16 * (MT * warp + mt) + lane % 8 + 8 * ((lane / 8) % 2)) * ROW_BYTES +
               8 * (lane / 16) * 2;
    };
    constexpr int QF = S::Q_REGS ? DP / 16 : 1;
    u32 qf[MT][QF][4];
    if constexpr (S::Q_REGS) {
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int kk = 0; kk < QF; ++kk) {
                ldmatrix_x4(qf[mt][kk], q_lane(mt) + kk * 32);
            }
        }
    }

    float o[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < DT; ++n) {
            o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
        }
    }
    float m[MT][2], l[MT][2];
    u32 attended = 0;  // bit 2 mt + ri: the row attended a key
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = -f32_inf();
        l[mt][0] = l[mt][1] = 0.0f;
    }
    // Lane offsets of the ldmatrix addresses: keys (B of S = Q K^T, rows = keys) and values
    // (B of O = P V, transposed).
    const u32 k_lane = (lane % 8 + 8 * (lane / 16)) * ROW_BYTES + 8 * ((lane / 8) % 2) * 2;
    const u32 v_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * ROW_BYTES + 8 * (lane / 16) * 2;

#pragma unroll 1
    for (int i = 0; i < tiles; ++i) {
        // (A) Everyone is past tile i - 1, whose stage tile i + 1 now overwrites, and sees
        // tile i + 1's offsets (and, at i = 0, the rows' range).
        __syncthreads();
        request(i + 2);
        fetch(i + 1);
        cp_async_wait<2>();
        if constexpr (S::WGMMA) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
            fence_async_shared();
#endif
        }
        // (B) Tile i has landed (every group but the two just made), for every thread's copies
        // (and, with wgmma, for the tensor cores' reads).
        __syncthreads();
        const int j0 = key_start + i * KT;
        const u64 absent = (u64)invalid_s[i % 3][1] << 32 | invalid_s[i % 3][0];
        const bool rows_full = range_s[0] <= j0 && range_s[1] - j0 >= min(KT, key_end - j0);
        const bool masked = !rows_full || absent != 0;
        const u32 k_tile = base + (i % 2) * S::TILE_BYTES;
        const u32 v_tile = k_tile + 2 * S::TILE_BYTES;

        // S = Q K^T: with wgmma, per k-step one m64 block after the other; else each key
        // fragment serves the warp's MT row blocks.
        float s[MT][NT][4];
        if constexpr (S::WGMMA) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
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
#endif
        } else {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
                }
            }
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk) {
                u32 a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if (S::Q_REGS) {
#pragma unroll
                        for (int x = 0; x < 4; ++x) {
                            a[mt][x] = qf[mt][S::Q_REGS ? kk : 0][x];
                        }
                    } else {
                        ldmatrix_x4(a[mt], q_lane(mt) + kk * 32);
                    }
                }
#pragma unroll
                for (int nn = 0; nn < KT / 16; ++nn) {
                    u32 b[4];
                    ldmatrix_x4(b, k_tile + nn * 16 * ROW_BYTES + k_lane + kk * 32);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        E::mma(s[mt][2 * nn], a[mt], b[0], b[1]);
                        E::mma(s[mt][2 * nn + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }

        // Scores (element e of n-tile n: row e / 2, key 8 n + 2 t4 + e % 2) with their
        // modifiers and, on a masked tile, -Inf where a row does not attend a key; then the
        // online softmax of this thread's rows (a quad of lanes shares each row). The masked
        // and the plain tile are two copies of the loop, so that the plain one carries no
        // mask arithmetic. Variants without soft cap and ALiBi keep a positive scale out of the
        // scores (`unscaled`): the max and the masks work on the dot products themselves, whose
        // order is the scaled scores', and the scale joins the weights' exponent factor.
        auto scores = [&](auto masked_tile, auto unscaled_tile) {
            constexpr bool MASKED = decltype(masked_tile)::value;
            constexpr bool UNSCALED = decltype(unscaled_tile)::value;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                int row_lo[2], row_hi[2];
                if (MASKED) {
#pragma unroll
                    for (int ri = 0; ri < 2; ++ri) {
                        row_lo[ri] = lo_s[row_index(mt, ri) - row_base];
                        row_hi[ri] = hi_s[row_index(mt, ri) - row_base];
                    }
                }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int t = 8 * n + 2 * t4 + e % 2, ri = e / 2;
                        float x = UNSCALED ? s[mt][n][e]
                                           : modify_score<MASK, ALIBI, CAP>(
                                                 p, s[mt][n][e] * p.score_scale,
                                                 (i64)j0 + t - pos[mt][ri], slope[mt][ri]);
                        if (MASKED) {
                            const bool a = (((absent >> t) & 1) == 0) &
                                           (t >= row_lo[ri] - j0) & (t < row_hi[ri] - j0);
                            x = a ? x : -f32_inf();
                            attended |= (u32)a << (2 * mt + ri);
                        }
                        s[mt][n][e] = x;
                    }
                }
            }
        };
        if (masked && unscaled) {
            scores(Flag<true>(), Flag<true>());
        } else if (masked) {
            scores(Flag<true>(), Flag<false>());
        } else {
            if (!unscaled) {
                scores(Flag<false>(), Flag<false>());
            }
            attended = ~0u;
        }
        // Each row's new max, the factor rescaling its state, its softmax base.
        float alpha[MT][2], base_of[MT][2];
        bool all_foldable = true, changed = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int ri = 0; ri < 2; ++ri) {
                float tile_max = -f32_inf();
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    tile_max = fmaxf(tile_max, fmaxf(s[mt][n][2 * ri], s[mt][n][2 * ri + 1]));
                }
                tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL, tile_max, 1));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL, tile_max, 2));
                const float m_new =
                    fmaxf(m[mt][ri], unscaled ? tile_max * p.score_scale : tile_max);
                alpha[mt][ri] = rescale(m[mt][ri], m_new);
                m[mt][ri] = m_new;
                base_of[mt][ri] = softmax_base(m_new);
                all_foldable &= foldable(base_of[mt][ri]);
                changed |= alpha[mt][ri] != 1.0f;
            }
        }
        // The weights and the rows' sums: one FFMA per score where every row of the warp has
        // a small base, else `weight` (a warp-uniform choice). `to_score` turns a value of s
        // into its score, `to_log2` into the score times log2(e).
        const float to_score = unscaled ? p.score_scale : 1.0f;
        const float to_log2 = to_score * LOG2E;
        auto weights = [&](auto folded) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int ri = 0; ri < 2; ++ri) {
                    const float base_log2e = base_of[mt][ri] * LOG2E;
                    float sum = 0.0f;
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
#pragma unroll
                        for (int e = 2 * ri; e < 2 * ri + 2; ++e) {
                            s[mt][n][e] =
                                decltype(folded)::value
                                    ? weight_folded(s[mt][n][e], to_log2, base_log2e)
                                    : weight(s[mt][n][e] * to_score, base_of[mt][ri]);
                            sum += s[mt][n][e];
                        }
                    }
                    l[mt][ri] = l[mt][ri] * alpha[mt][ri] + sum;
                }
            }
        };
        if (__all_sync(FULL, all_foldable)) {
            weights(Flag<true>());
        } else {
            weights(Flag<false>());
        }
        // The accumulators rescaled, unless no row of the warp changed its max (every factor
        // exactly 1).
        if (__any_sync(FULL, changed)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int n = 0; n < DT; ++n) {
                    o[mt][n][0] *= alpha[mt][0];
                    o[mt][n][1] *= alpha[mt][0];
                    o[mt][n][2] *= alpha[mt][1];
                    o[mt][n][3] *= alpha[mt][1];
                }
            }
        }

        // A tile where some row does not attend some key: any non-finite value in it?
        bool by_selects = false;
        if (!rows_full) {
            bool bad = false;
            for (int c = tid; c < KT * CH; c += THREADS) {
                const int t = c / CH, col = c % CH;
                const U128 v =
                    *(const U128*)(smem + (v_tile - base) + S::chunk_at(KT, t, col));
                const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    bad |= (w[x] & E::EXPONENT) == E::EXPONENT ||
                           ((w[x] >> 16) & E::EXPONENT) == E::EXPONENT;
                }
            }
            by_selects = __syncthreads_or(bad) != 0;
        }

        // P's A fragment of row block mt for keys 16 kk.. 16 kk + 15: the score fragments of
        // n-tiles 2 kk and 2 kk + 1, rounded to E.
        auto p_fragment = [&](u32(&a)[4], int mt, int kk) {
            a[0] = E::pack2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            a[1] = E::pack2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            a[2] = E::pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            a[3] = E::pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        };
        if (!by_selects) {
            if constexpr (S::WGMMA) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
                // O += P V by wgmma: P's A fragments all made first, since they must not
                // change until the wgmma finish.
                u32 a[KT / 16][MT][4];
#pragma unroll
                for (int kk = 0; kk < KT / 16; ++kk) {
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        p_fragment(a[kk][mt], mt, kk);
                    }
                }
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < KT / 16; ++kk) {
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        Wgmma<E>::pv(o[mt], a[kk][mt],
                                     wgmma_desc(v_tile + kk * 16 * 128, KT * 128));
                    }
                }
                wgmma_finish();
#endif
            } else {
                // O += P V: each value fragment serves the warp's MT row blocks.
#pragma unroll
                for (int kk = 0; kk < KT / 16; ++kk) {
                    u32 a[MT][4];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        p_fragment(a[mt], mt, kk);
                    }
#pragma unroll
                    for (int nd = 0; nd < DP / 16; ++nd) {
                        u32 b[4];
                        ldmatrix_x4_trans(b, v_tile + kk * 16 * ROW_BYTES + v_lane + nd * 32);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            E::mma(o[mt][2 * nd], a[mt], b[0], b[1]);
                            E::mma(o[mt][2 * nd + 1], a[mt], b[2], b[3]);
                        }
                    }
                }
            }
        } else {
            // The rare tile: each row block's probabilities through the warp's scratch, and
            // each key's value added only to the rows that attend it. (Every warp is past
            // this tile's S = Q K^T: the barrier of __syncthreads_or above.)
            u8* const scratch_at =
                S::Q_REGS           ? smem + 4 * S::TILE_BYTES
                : S::SCRATCH_IN_KEYS ? smem + (i % 2) * S::TILE_BYTES
                                     : smem + 4 * S::TILE_BYTES + S::Q_BYTES;
            float* const ps = (float*)scratch_at + warp * 16 * KT;
            const u8* const v_stage = smem + (v_tile - base);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int n = 0; n < NT; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        ps[(g + 8 * (e / 2)) * KT + 8 * n + 2 * t4 + e % 2] = s[mt][n][e];
                    }
                }
                __syncwarp();
#pragma unroll 1
                for (int t = 0; t < KT; ++t) {
                    const bool key = !((absent >> t) & 1);
                    const int r0 = row_index(mt, 0) - row_base, r1 = r0 + 8;
                    const bool a0 = key && t >= lo_s[r0] - j0 && t < hi_s[r0] - j0;
                    const bool a1 = key && t >= lo_s[r1] - j0 && t < hi_s[r1] - j0;
                    const float p0 = ps[g * KT + t], p1 = ps[(g + 8) * KT + t];
#pragma unroll
                    for (int n = 0; n < DT; ++n) {
                        const Bits* v = (const Bits*)(v_stage + S::chunk_at(KT, t, n)) + 2 * t4;
                        const float v0 = E::to_f32(v[0]), v1 = E::to_f32(v[1]);
                        o[mt][n][0] = a0 ? fmaf(p0, v0, o[mt][n][0]) : o[mt][n][0];
                        o[mt][n][1] = a0 ? fmaf(p0, v1, o[mt][n][1]) : o[mt][n][1];
                        o[mt][n][2] = a1 ? fmaf(p1, v0, o[mt][n][2]) : o[mt][n][2];
                        o[mt][n][3] = a1 ? fmaf(p1, v1, o[mt][n][3]) : o[mt][n][3];
                    }
                }
                __syncwarp();
            }
        }
        // Tile i + 2's entries (every group but tile i + 1's), then its offsets: seen by tile
        // i + 1's fetch of tile i + 2 after its barrier (A).
        cp_async_wait<1>();
        publish(i + 2);
    }
    // No copy outlives the kernel (with no tiles, the query tile's).
    cp_async_wait<0>();

    // The rows' sums and flags over their quads, then the output (pairs of elements).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
            float sum = l[mt][ri];
            sum += __shfl_xor_sync(FULL, sum, 1);
            sum += __shfl_xor_sync(FULL, sum, 2);
            int any = (attended >> (2 * mt + ri)) & 1;
            any |= __shfl_xor_sync(FULL, any, 1);
            any |= __shfl_xor_sync(FULL, any, 2);
            const int r = row_index(mt, ri);
            if (r < rows) {
                const i64 token = first_token + r / heads, head = first_head + r % heads;
                Bits* out = output + (token * p.num_heads + head) * D;
                const float factor = p.out_scale / sum;
#pragma unroll
                for (int n = 0; n < DT; ++n) {
                    const int d = 8 * n + 2 * t4;
                    if (d < D) {
                        *(u32*)(out + d) =
                            E::pack2(finish_by(o[mt][n][2 * ri], m[mt][ri], any != 0, factor),
                                     finish_by(o[mt][n][2 * ri + 1], m[mt][ri], any != 0, factor));
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The decode: keys and values straight from global memory.
// ---------------------------------------------------------------------------------------------

constexpr int pow2_at_least(int x) {
    int p = 1;
    while (p < x) {
        p *= 2;
    }
    return p;
}
constexpr int min_of(int a, int b) { return a < b ? a : b; }

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

// Element i (a constant) of 8 stored elements of type T held in W words, as f32.
template <class C>
__device__ __forceinline__ float element(const u32* w, int i) {
    typedef typename C::Type T;
    if constexpr (sizeof(T) == 1) {
        return C::read((u8)(w[i / 4] >> (8 * (i % 4))));
    } else if constexpr (sizeof(T) == 2) {
        return C::read((u16)(w[i / 2] >> (16 * (i % 2))));
    } else {
        return C::read(__uint_as_float(w[i]));
    }
}

// The 8 stored elements of type C held in W words, as f32 (exact). fp8 codes convert two at
// a time where the GPU converts them in one instruction (sm_89 and later): one by one, their
// decoding costs more than the decode's arithmetic.
template <class C, int W>
__device__ __forceinline__ void elements(const u32 (&w)[W], float (&x)[8]) {
#if __CUDA_ARCH__ >= 890
    constexpr bool PAIRS = sizeof(typename C::Type) == 1;
#else
    constexpr bool PAIRS = false;
#endif
    if constexpr (PAIRS) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const u32 pair = C::pair_to_f16x2((u16)(w[h / 2] >> (16 * (h % 2))));
            x[2 * h] = F16::to_f32((u16)pair);
            x[2 * h + 1] = F16::to_f32((u16)(pair >> 16));
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            x[e] = element<C>(w, e);
        }
    }
}

// The decode's shapes. LANES lanes hold one key (8 dimensions each; lanes past D / 8 idle
// where D / 8 is no power of two), so a warp covers KPW keys per step, and a chunk is U
// such steps (CHUNK keys). Each lane copies its own pieces of a chunk's keys and values
// into the warp's ring in shared memory with cp.async and later reads back exactly those
// bytes: no barrier orders the copies (a thread's wait_group covers its own), and the layout
// (each piece of the 32 lanes side by side) is free of bank conflicts. The ring holds STAGES
// chunks, so that the loads of the chunks ahead (about AHEAD bytes per warp) are in flight
// while one is computed, without registers held for them. After the ring, each warp's f64
// accumulators (`decode`'s fold). src/cuda/variant.rs computes BYTES the same way
// (`decode_shared_bytes`).
template <class C, int D, int ROWS>
struct DecodeShape {
    static constexpr int CH = D / 8;
    static constexpr int LANES = pow2_at_least(CH);
    static constexpr int KPW = 32 / LANES;
    static constexpr int W = 2 * (int)sizeof(typename C::Type);  // words of 8 stored elements
    // Keys per lane and chunk: scores s[U][ROWS] live in registers.
    static constexpr int U = min_of(min_of(8, 32 / W), min_of(32 / ROWS, 32 / KPW));
    static constexpr int CHUNK = KPW * U;
    static constexpr int COPY = min_of(16, 4 * W);  // bytes per cp.async
    static constexpr int COPIES = 4 * W / COPY;     // per lane, key and K or V
    static constexpr int PIECE = 32 * COPY;         // one copy of every lane
    static constexpr int STAGE_BYTES = U * 2 * COPIES * PIECE;
    static constexpr int AHEAD = 16384;
    static constexpr int STAGES = min_of(8, 1 + (AHEAD + STAGE_BYTES - 1) / STAGE_BYTES);
    static constexpr int STAGING = WARPS * STAGES * STAGE_BYTES;
    // Chunks between folds of a warp's f32 state into its f64 one (`decode`): FOLD_TERMS
    // keys per lane's sum.
    static constexpr int FOLD_TERMS = 128;
    static constexpr int FOLD = FOLD_TERMS / U;
    // The warps' f64 accumulators, after the staging ring.
    static constexpr int OUTER = WARPS * ROWS * D * 8;
    static constexpr int BYTES = STAGING + OUTER;
};

// The W words one lane staged for one key's keys or values: COPIES copies of COPY bytes,
// PIECE bytes apart from `at`.
template <int W, int COPY, int PIECE>
__device__ __forceinline__ void staged_words(u32 (&w)[W], const u8* at) {
    if constexpr (COPY == 16) {
#pragma unroll
        for (int h = 0; h < W / 4; ++h) {
            const U128 v = *(const U128*)(at + h * PIECE);
            w[4 * h % W] = v.x;
            w[(4 * h + 1) % W] = v.y;
            w[(4 * h + 2) % W] = v.z;
            w[(4 * h + 3) % W] = v.w;
        }
    } else {
        static_assert(COPY == 8 && W == 2, "8-byte copies hold 8 fp8 elements");
        const uint2 v = *(const uint2*)at;
        w[0] = v.x;
        w[1 % W] = v.y;
    }
}

// A decode unit: one token, ROWS >= its query heads (the kv head's, up to DECODE_ROWS), a
// range of keys that every row attends (decode rows share their token's position, and the
// plan gives each unit exactly its token's allowed keys, or a split-K partition of them).
//
// Warps take interleaved chunks of CHUNK keys (DecodeShape), each with its own online
// softmax (one max per chunk and row) and its own ring of staged chunks: per chunk, one
// lane per key looks its storage up (a chunk ahead of its copies, so that the block-table
// read is off the critical path) and shuffles it to the lanes that copy it. Dot products
// over the lanes of a key by xor shuffles; the kv head's query heads (rows) share every
// load. Non-keys (past the unit, slot -1) are never read: their staged bytes are zeros and
// their scores -Inf, so they weigh 0 * 0. At the end the warps' states merge exactly (as
// attention_merge.cu merges partitions) into the output or this partition's partial.
template <class E, class C, int D, int MASK, bool ALIBI, bool CAP, int ROWS>
__device__ __forceinline__ void decode(const Params& p) {
    typedef DecodeShape<C, D, ROWS> S;
    typedef typename C::Type T;
    constexpr int CH = S::CH, LANES = S::LANES, KPW = S::KPW, W = S::W, U = S::U;
    constexpr int CHUNK = S::CHUNK, COPY = S::COPY, COPIES = S::COPIES, PIECE = S::PIECE;
    constexpr int STAGES = S::STAGES;
    constexpr int QW = 2 * (int)sizeof(typename E::Bits);
    static_assert(LANES <= 32 && CHUNK <= 32, "one lane per key of a chunk");
    // Each warp's f64 state (see `fold`): its base, its sums of weights, its accumulators
    // (after the staging ring); at the end, the merge's factors replace the sums.
    __shared__ float base_w[WARPS][ROWS];
    __shared__ double l_w[WARPS][ROWS];
    __shared__ int attended_w[WARPS];
    __shared__ float big_r[ROWS];
    __shared__ double total_r[ROWS];  // the row's L, or v_scale / L for the output
    u8* const smem = dynamic_shared(S::BYTES);

    const T* keys = (const T*)p.key;
    const T* values = (const T*)p.value;
    typedef typename E::Bits Bits;

    const i64* unit = p.units + (i64)blockIdx.x * UNIT_FIELDS;
    const i64* seq = p.seqs + unit[UNIT_SEQ] * SEQ_FIELDS;
    const i64 kv_head = unit[UNIT_KV_HEAD];
    const int heads = (int)unit[UNIT_HEADS];  // <= ROWS
    const i64 token = seq[SEQ_QUERY_START] + unit[UNIT_TOKEN];
    const i64 first_head = kv_head * p.group + unit[UNIT_HEAD];
    const i64 key_start = unit[UNIT_KEY_START];
    const i64 key_end = unit[UNIT_KEY_END];
    const u32 block_div = block_divisor(p);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int group = lane / LANES, li = lane % LANES;
    const bool dims = li < CH;  // this lane holds dimensions 8 li .. 8 li + 7

    i64 pos = seq[SEQ_FIRST_POS] + unit[UNIT_TOKEN];
    if (MASK == MASK_NONE && ALIBI) {
        pos = min(pos, seq[SEQ_KEYS] - 1);  // as row_of: distances from the last key
    }
    float q[ROWS][8], slope[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        u32 w[QW];
#pragma unroll
        for (int x = 0; x < QW; ++x) {
            w[x] = 0;
        }
        slope[r] = 0.0f;
        if (r < heads) {
            if (dims) {
                load_words(w, (const Bits*)p.query + (token * p.num_heads + first_head + r) * D +
                                  li * 8);
            }
            if (ALIBI) {
                slope[r] = p.slopes[first_head + r];
            }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            q[r][e] = element<Plain<E>>(w, e);
        }
    }

    float m[ROWS], l[ROWS], acc[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        m[r] = -f32_inf();
        l[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            acc[r][e] = 0.0f;
        }
    }
    bool attended = false;
    // The f64 state of this warp: lane (group g, li) owns dimensions 8 li .. 8 li + 7 of the
    // rows r with r % KPW == g (no other lane reads or writes them until the merge); lane 0
    // owns the bases and sums.
    double* const acc_o = (double*)(smem + S::STAGING) + warp * ROWS * D;  // [ROWS][D]
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (r % KPW == group && dims) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                acc_o[r * D + li * 8 + e] = 0.0;
            }
        }
        if (lane == 0) {
            base_w[warp][r] = -f32_inf();
            l_w[warp][r] = 0.0;
        }
    }
    // The fold: the warp's f32 state (m, l, acc, summed over its key groups) added into its
    // f64 state, which keeps its own base (the max m at its last fold: m only grows), and
    // the f32 sums restart from 0 under the same max. Why, in terms counted per running sum
    // (recursive summation of n terms errs by up to (n - 1) 2^-24 of their magnitudes' sum in
    // f32, (n - 1) 2^-53 in f64):
    // * without it, a lane's l and acc took every key its group saw: the unit's keys over
    //   WARPS x KPW, e.g. 2^24 keys in the 264 partitions of one kv head on an H100 give
    //   2K (D = 32) to 16K (D = 256) terms per sum, an unsplit unit (a busy GPU) or 2^31 keys
    //   up to 2^29;
    // * with it, an f32 sum takes at most FOLD_TERMS = 128 keys (FOLD chunks of U; the chunks'
    //   rescales by alpha add at most FOLD roundings to those terms): 127 2^-24 = 7.6e-6 at
    //   worst, ~11 2^-24 for independent roundings (under 1e-5 either way; folding twice as
    //   often costs time on every decode, NOTES.md); the f64 sums take one term per fold, at
    //   most 2^31 / (WARPS x 128) = 2^22 (2^-31 relative), and their rescale factor is one f64
    //   exp of the exact difference of two f32 maxima. Per FOLD chunks this costs each lane
    //   ROWS x 9 log2(KPW) shuffles and ROWS x 8 / KPW f64 FMAs on shared memory, against
    //   FOLD x U x ROWS x 16 FMAs of QK and P.V.
    auto fold = [&]() {
        __syncwarp();  // lane 0's last bases are visible to every lane
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
#pragma unroll
            for (int o = LANES; o < 32; o *= 2) {
                l[r] += __shfl_xor_sync(FULL, l[r], o);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    acc[r][e] += __shfl_xor_sync(FULL, acc[r][e], o);
                }
            }
            // m only grows, so the f64 state rescales by at most 1; an unchanged base
            // (-Inf or +Inf included) by exactly 1.
            const float base = base_w[warp][r];
            const double scale = base == m[r] ? 1.0 : exp((double)base - (double)m[r]);
            if (r % KPW == group && dims) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    double* const o = acc_o + r * D + li * 8 + e;
                    *o = fma(*o, scale, (double)acc[r][e]);
                }
            }
            if (lane == 0) {
                l_w[warp][r] = fma(l_w[warp][r], scale, (double)l[r]);
            }
            l[r] = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                acc[r][e] = 0.0f;
            }
        }
        __syncwarp();  // every lane has read the bases
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                base_w[warp][r] = m[r];
            }
        }
    };
    const int chunks = (int)((key_end - key_start + CHUNK - 1) / CHUNK);
    const int count = chunks > warp ? (chunks - warp + WARPS - 1) / WARPS : 0;  // this warp's
    const u32 ring = smem_address(smem) + warp * STAGES * S::STAGE_BYTES + lane * COPY;
    const u8* const ring_ptr = smem + warp * STAGES * S::STAGE_BYTES + lane * COPY;

    // This lane's key of the warp's k-th chunk (lanes < CHUNK): its storage, or -1.
    auto lookup = [&](int k) -> i64 {
        const i64 j = key_start + (i64)(warp + k * WARPS) * CHUNK + lane;
        return k < count && lane < CHUNK
                   ? key_offset<D>(p, seq, kv_head, key_end, block_div, j)
                   : -1;
    };
    // The warp's k-th chunk, whose keys' storage `mine` holds, into stage k % STAGES (zeros
    // for non-keys and idle lanes), as one commit group (empty past the warp's chunks).
    // Returns the chunk's keys that are keys, one bit each.
    auto stage = [&](int k, i64 mine) -> u32 {
        const u32 present = __ballot_sync(FULL, mine >= 0);
        if (k < count) {
            const u32 at = ring + (k % STAGES) * S::STAGE_BYTES;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const i64 off = __shfl_sync(FULL, mine, u * KPW + group);
                const bool load = off >= 0 && dims;
                const u8* k_src = (const u8*)(keys + (load ? off + li * 8 : 0));
                const u8* v_src = (const u8*)(values + (load ? off + li * 8 : 0));
#pragma unroll
                for (int h = 0; h < COPIES; ++h) {
                    cp_async<COPY>(at + ((2 * u) * COPIES + h) * PIECE, k_src + h * COPY, !load);
                    cp_async<COPY>(at + ((2 * u + 1) * COPIES + h) * PIECE, v_src + h * COPY,
                                   !load);
                }
            }
        }
        cp_async_commit();
        return present;
    };

    // The pipeline: STAGES - 1 chunks staged ahead, the next chunk's lookup made ahead.
    u32 present[STAGES];  // the staged chunks' key bits, oldest first
    i64 next = lookup(0);
#pragma unroll
    for (int k = 0; k + 1 < STAGES; ++k) {
        present[k] = stage(k, next);
        next = lookup(k + 1);
    }
#pragma unroll 1
    for (int k = 0; k < count; ++k) {
        present[STAGES - 1] = stage(k + STAGES - 1, next);
        next = lookup(k + STAGES);
        cp_async_wait<STAGES - 1>();  // chunk k has landed (this lane's copies of it)
        const u32 keys_here = present[0];
#pragma unroll
        for (int x = 0; x + 1 < STAGES; ++x) {
            present[x] = present[x + 1];
        }
        const u8* const chunk = ring_ptr + (k % STAGES) * S::STAGE_BYTES;
        const i64 j0 = key_start + (i64)(warp + k * WARPS) * CHUNK;
        attended |= keys_here != 0;
        // Scores of the chunk: key u * KPW + group of this lane's group, every row.
        float s[U][ROWS];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            u32 kw[W];
            staged_words<W, COPY, PIECE>(kw, chunk + (2 * u) * COPIES * PIECE);
            float k[8];
            elements<C>(kw, k);
            const int t = u * KPW + group;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    dot = fmaf(q[r][e], k[e], dot);
                }
#pragma unroll
                for (int o = LANES / 2; o > 0; o /= 2) {
                    dot += __shfl_xor_sync(FULL, dot, o);
                }
                s[u][r] = (keys_here >> t) & 1 ? modify_score<MASK, ALIBI, CAP>(
                                                     p, dot * p.score_scale, j0 + t - pos, slope[r])
                                               : -f32_inf();
            }
        }
        // The online softmax: one new max per row and chunk, then P.V.
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float chunk_max = -f32_inf();
#pragma unroll
            for (int u = 0; u < U; ++u) {
                chunk_max = fmaxf(chunk_max, s[u][r]);
            }
#pragma unroll
            for (int o = LANES; o < 32; o *= 2) {
                chunk_max = fmaxf(chunk_max, __shfl_xor_sync(FULL, chunk_max, o));
            }
            const float m_new = fmaxf(m[r], chunk_max);
            const float alpha = rescale(m[r], m_new);
            m[r] = m_new;
            l[r] *= alpha;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                acc[r][e] *= alpha;
            }
            const float base = softmax_base(m_new);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                s[u][r] = weight(s[u][r], base);
                l[r] += s[u][r];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            u32 vw[W];
            staged_words<W, COPY, PIECE>(vw, chunk + (2 * u + 1) * COPIES * PIECE);
            float v[8];
            elements<C>(vw, v);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    acc[r][e] = fmaf(s[u][r], v[e], acc[r][e]);
                }
            }
        }
        if ((k + 1) % S::FOLD == 0) {
            fold();
        }
    }
    fold();
    cp_async_wait<0>();
    if (lane == 0) {
        attended_w[warp] = attended ? 1 : 0;
    }
    __syncthreads();

    // The warps merged in f64: M = max base_w, L = sum l_w e^(base_w - M), acc likewise
    // (with M = -Inf every weight is 0 and NaN survives, as in attention_merge.cu). Thread r
    // makes row r's factors once (they replace l_w), then every thread sums its elements.
    const i64 part_base = unit[UNIT_PART_BASE];
    if (tid < heads) {
        const int r = tid;
        float big = -f32_inf();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            big = fmaxf(big, base_w[w][r]);
        }
        double sum = 0.0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const double f =
                big == -f32_inf() ? 0.0 : exp((double)base_w[w][r] - (double)big);
            sum = fma(l_w[w][r], f, sum);
            l_w[w][r] = f;
        }
        big_r[r] = big;
        total_r[r] = part_base < 0 ? (double)p.out_scale / sum : sum;
    }
    __syncthreads();
    const bool any = (attended_w[0] | attended_w[1] | attended_w[2] | attended_w[3]) != 0;
    const double* const acc_all = (const double*)(smem + S::STAGING);  // [WARPS][ROWS][D]
#pragma unroll 1
    for (int x = tid; x < heads * D; x += THREADS) {
        const int r = x / D, d = x % D;
        double a = 0.0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            a = fma(acc_all[(w * ROWS + r) * D + d], l_w[w][r], a);
        }
        const float big = big_r[r];
        if (part_base < 0) {
            Bits* out = (Bits*)p.output + (token * p.num_heads + first_head + r) * D;
            out[d] = E::from_f32(finish_f64(a, big, any, total_r[r]));
        } else {
            float* record =
                p.partials + (part_base + r * unit[UNIT_PARTS] + unit[UNIT_PART]) * (D + 4);
            if (d == 0) {
                record[0] = big;
                record[1] = (float)total_r[r];
                record[2] = any ? 1.0f : 0.0f;
            }
            record[4 + d] = (float)a;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The kernels of one variant.
// ---------------------------------------------------------------------------------------------

// Which prefill a variant runs: the tensor cores for bf16 and f16 activations with keys and
// values stored as such; the scalar kernel otherwise.
template <class E, class C>
struct TensorCores {
    static constexpr bool value = false;
};
template <>
struct TensorCores<BF16, Plain<BF16>> {
    static constexpr bool value = true;
};
template <>
struct TensorCores<F16, Plain<F16>> {
    static constexpr bool value = true;
};

template <class E, class C, int D, int MASK, bool ALIBI, bool CAP>
__device__ __forceinline__ void prefill(const Params& p) {
    if constexpr (TensorCores<E, C>::value) {
        prefill_mma<E, D, MASK, ALIBI, CAP>(p);
    } else {
        prefill_scalar<E, C, D, MASK, ALIBI, CAP>(p);
    }
}

// One variant: NAME_prefill (units of several query tokens; the tensor-core kernel takes
// MmaShape<D>::BYTES of dynamic shared memory in PREFILL_ROWS / MmaShape<D>::CTA_ROWS CTAs
// per unit, the scalar one a grid of PREFILL_ROWS / SCALAR_ROWS rows of CTAs) and
// NAME_decode1, _decode4, _decode8 (units of one token, for kv-head groups of 1, up to 4 and
// up to 8 query heads: a row without a head still costs its FMAs, shuffles and registers).
#define ATTENTION_KERNELS(NAME, E, C, D, MASK, ALIBI, CAP)                                    \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_prefill(const Params p) {   \
        prefill<E, C, D, MASK, ALIBI, CAP>(p);                                                \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_decode1(const Params p) {   \
        decode<E, C, D, MASK, ALIBI, CAP, 1>(p);                                              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_decode4(const Params p) {   \
        decode<E, C, D, MASK, ALIBI, CAP, 4>(p);                                              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_decode8(const Params p) {   \
        decode<E, C, D, MASK, ALIBI, CAP, 8>(p);                                              \
    }
