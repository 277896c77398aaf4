// The scalar prefill: f32 activations and fp8 caches. Its shape S (ScalarShape in
// src/cuda/variant.rs, generated into the program): ROWS rows per CTA, tiles of KT keys, the
// most of 32, 16, 8, 4 whose f32 tiles (queries, keys padded by one float so that threads
// scoring different keys hit different banks, values, probabilities) fit in 44 KiB of static
// shared memory (48 KiB per block, the rest for the per-row state).

// ROWS rows of a prefill unit (from row blockIdx.y * ROWS): it walks the keys
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
template <class E, class C, class V, class S>
__device__ __forceinline__ void prefill_scalar(const Params& p) {
    constexpr int D = S::D, ROWS = S::ROWS, KT = S::KT;
    static_assert(KT <= 32, "one lane per key in the softmax step");
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
    typename E::Bits* output = (typename E::Bits*)p.output;

    const i64* unit = p.units + (i64)blockIdx.x * UNIT_FIELDS;
    const i64* seq = p.seqs + unit[UNIT_SEQ] * SEQ_FIELDS;
    const typename C::Type* keys = (const typename C::Type*)p.key;
    const typename C::Type* values = (const typename C::Type*)p.value;
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
    const i64 key_start = V::row(p, seq, unit, row_base).lo;
    const i64 key_end = V::row(p, seq, unit, row_base + rows - 1).hi;
    const u32 block_div = block_divisor(p);
    const int tid = threadIdx.x;

    // Each row's position, attended key range and slope; rows past `rows` attend nothing.
#pragma unroll 1
    for (int r = tid; r < ROWS; r += THREADS) {
        Row row = {0, 0, 0, 0.0f};
        if (r < rows) {
            row = V::row(p, seq, unit, row_base + r);
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
                s = V::logits(p, dot, j - pos_s[r],
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
            output[(token * p.num_heads + head) * D + d] = E::from_f32(V::output(
                o[i], m_s[r], attended_s[r] != 0, (double)p.out_scale / l_s[r]));
        }
    }
}

