// The decode: units of one query token, keys and values straight from global memory.
// Its shape S (DecodeShape in src/cuda/variant.rs, generated into the program): LANES lanes
// hold one key (8 dimensions each; lanes past D / 8 idle where D / 8 is no power of two), so
// a warp covers KPW keys per step, and a chunk is U such steps (CHUNK keys). Each lane copies
// its own pieces (COPIES copies of COPY bytes, PIECE bytes for the 32 lanes) of a chunk's keys
// and values into the warp's ring in shared memory with cp.async and later reads back exactly
// those bytes: no barrier orders the copies (a thread's wait_group covers its own), and the
// layout (each piece of the 32 lanes side by side) is free of bank conflicts. The ring holds
// STAGES chunks of STAGE_BYTES, so that the loads of the chunks ahead are in flight while one
// is computed, without registers held for them. After the rings (STAGING bytes), each warp's
// f64 accumulators, into which its f32 state is folded every FOLD chunks (`decode`'s fold).

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
        for (int h = 0; h < 2; ++h) {
            u32 pair[2];
            C::quad_to_f16x2(w[h], pair[0], pair[1]);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                x[4 * h + 2 * i] = F16::to_f32((u16)pair[i]);
                x[4 * h + 2 * i + 1] = F16::to_f32((u16)(pair[i] >> 16));
            }
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            x[e] = element<C>(w, e);
        }
    }
}

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
// load. Non-keys (past the unit) are never read: their staged bytes are zeros and
// their scores -Inf, so they weigh 0 * 0. At the end the warps' states merge exactly (as
// attention_merge.cu merges partitions) into the output or this partition's partial.
template <class E, class C, class V, class S>
__device__ __forceinline__ void decode(const Params& p) {
    constexpr int D = S::D, ROWS = S::ROWS;
    typedef typename C::Type T;
    constexpr int CH = S::CH, LANES = S::LANES, KPW = S::KPW, W = S::W, U = S::U;
    constexpr int CHUNK = S::CHUNK, COPY = S::COPY, COPIES = S::COPIES, PIECE = S::PIECE;
    constexpr int STAGES = S::STAGES;
    constexpr int QW = 2 * (int)sizeof(typename E::Bits);
    static_assert(LANES <= 32 && CHUNK <= 32, "one lane per key of a chunk");
    // Each warp's f64 state (see `fold`): its base and sums of weights here, its
    // accumulators after the staging ring.
    __shared__ DecodeStates<ROWS> states;
    u8* const smem = dynamic_shared(S::BYTES);

    typedef typename E::Bits Bits;

    const i64* unit = p.units + (i64)blockIdx.x * UNIT_FIELDS;
    const i64* seq = p.seqs + unit[UNIT_SEQ] * SEQ_FIELDS;
    const T* keys = (const T*)p.key;
    const T* values = (const T*)p.value;
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

    const i64 pos = V::position(seq, unit[UNIT_TOKEN]);
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
            if (V::ALIBI) {
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
            states.base[warp][r] = -f32_inf();
            states.l[warp][r] = 0.0;
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
    //   often costs time on every decode, docs/design/cuda.md); the f64 sums take one term per fold, at
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
            const float base = states.base[warp][r];
            const double scale = base == m[r] ? 1.0 : exp((double)base - (double)m[r]);
            if (r % KPW == group && dims) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    double* const o = acc_o + r * D + li * 8 + e;
                    *o = fma(*o, scale, (double)acc[r][e]);
                }
            }
            if (lane == 0) {
                states.l[warp][r] = fma(states.l[warp][r], scale, (double)l[r]);
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
                states.base[warp][r] = m[r];
            }
        }
    };
    const int chunks = (int)((key_end - key_start + CHUNK - 1) / CHUNK);
    // This warp's chunks, as a value the compiler knows to be the same in every lane (a
    // lane's broadcast): shuffles under a branch it cannot prove uniform get wrapped in
    // code for a diverged warp.
    const int count =
        __shfl_sync(FULL, chunks > warp ? (chunks - warp + WARPS - 1) / WARPS : 0, 0);
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
                s[u][r] = (keys_here >> t) & 1 ? V::logits(p, dot, j0 + t - pos, slope[r])
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
        states.attended[warp] = attended ? 1 : 0;
    }
    __syncthreads();
    merge_warps<E, V, D, ROWS>(p, unit, states, (const double*)(smem + S::STAGING), heads, token,
                               first_head);
}
