// The decode on the tensor cores (bf16 and f16 activations; keys and values stored as such
// or as fp8 codes): units of one query token, as decode.cuh's, with the kv head's query
// heads as the 8 columns of mma.sync m16n8k16 and keys as its rows, so that no element of an
// accumulator is padding: S^T = K Q^T (A: a key tile read with ldmatrix, B: the queries, in
// registers), then O^T += V^T P^T (A: the value tile read with ldmatrix.trans, B: the weights,
// moved from S^T's layout with movmatrix). A lane (g = lane / 4, t4 = lane % 4) holds the
// scores of keys g and g + 8 of each 16 for heads 2 t4 and 2 t4 + 1, and O^T's elements of
// those heads for two dimensions of each 16 (`dim`).
//
// The tensor math runs on element type M: E for keys and values stored as E; f16 for fp8
// codes, which convert exactly into f16 pairs. With bf16 queries and fp8 codes (SCALE_Q),
// each head's queries are scaled by a power of two that puts their largest magnitude in
// [2^14, 2^15) before rounding to f16 (exact for every element down to 2^-31 of the largest,
// whose 8 significant bits then stay above f16's 2^-24), and the scores are scaled back
// exactly.
// For fp8 keys the dimensions of a k-step are taken in the order ldmatrix delivers the codes
// (lane t4 gets dimensions 4 t4 .. 4 t4 + 3 of 16), the queries' B fragments likewise; for fp8
// values O^T's rows g and g + 8 are dimensions 2 g and 2 g + 1 of 16 (ldmatrix.trans delivers
// both of a key pair in one register, which a byte permute splits).
//
// Its shape S (DecodeMmaShape in src/cuda/variant.rs, generated into the program): rows of
// keys and values are D elements (STORED bytes each), padded with zeros to DP (a multiple
// of 16), ROW_BYTES apart in shared memory, laid out so that the 8 rows an ldmatrix reads
// fall in 8 different bank groups: with SWIZZLE (rows of a multiple of 8 16-byte units, no
// padding) unit u of row r is stored at unit u ^ (r % 8); else ROW_BYTES is an odd number of
// units. Warps take interleaved tiles of KT keys, each with its own ring of STAGES tiles (the
// keys' tile, then the values', TILE_BYTES each) that its own lanes fill with cp.async (COPY
// bytes a copy, CPR copies a row), so that a warp waits on no other; the lanes read the tile
// written by each other after their waits and a __syncwarp. Each warp folds its f32 state into
// an f64 one every FOLD tiles (128 keys), as decode.cuh's, its accumulators after the rings
// (STAGING bytes; BYTES in all), and the warps merge as decode_merge.cuh says.

// Where unit u of a row whose index is this lane's modulo 8 is stored (see the shape).
template <bool SWIZZLE>
__device__ __forceinline__ int unit(int u) {
    return SWIZZLE ? u ^ (threadIdx.x % 8) : u;
}

// The byte offset in a row of unit 2 v + b, where `lane_unit` is 16 unit<SW>(b) (b = 0 or 1,
// this lane's): swizzled, the bits of 2 v and b do not overlap, so the offset is one XOR.
template <bool SWIZZLE>
__device__ __forceinline__ u32 unit_pair(u32 lane_unit, int v) {
    return SWIZZLE ? lane_unit ^ (32 * v) : lane_unit + 32 * v;
}

// This lane's dimension of O^T's half hh (0: accumulators 0 and 1, 1: 2 and 3) of m-tile c.
template <bool FP8>
__device__ __forceinline__ int dim(int c, int hh) {
    const int g = threadIdx.x % 32 / 4;
    return FP8 ? 16 * c + 2 * g + hh : 16 * c + g + 8 * hh;
}

// The A fragments of S^T = K Q^T for keys 16 mk .. of the key tile at `tile` (row stride
// RB), k-steps kk and kk + 1 (kk even; the second only below KS). 16-bit keys: one ldmatrix
// per k-step. fp8 codes: one for both, each register's four codes (key g or g + 8,
// dimensions 4 t4 .. 4 t4 + 3 of the k-step) converted into two f16 pairs: the k-step's
// columns 2 t4, 2 t4 + 1 (register 0 or 1) and 2 t4 + 8, 2 t4 + 9 (register 2 or 3).
template <class C, int KS, int RB, bool SW>
__device__ __forceinline__ void key_fragments(u32 (&a)[2][4], u32 tile, int mk, int kk) {
    const int lane = threadIdx.x % 32;
    const u32 at = tile + (16 * mk + lane % 8 + 8 * (lane / 8 % 2)) * RB;
    const u32 lane_unit = 16 * unit<SW>(lane / 16);
    if constexpr (sizeof(typename C::Type) == 2) {
#pragma unroll
        for (int h = 0; h < 2 && kk + h < KS; ++h) {
            ldmatrix_x4(a[h], at + unit_pair<SW>(lane_unit, kk + h));
        }
    } else {
        u32 r[4];
        ldmatrix_x4(r, at + unit_pair<SW>(lane_unit, kk / 2));
#pragma unroll
        for (int h = 0; h < 2 && kk + h < KS; ++h) {
            C::quad_to_f16x2(r[2 * h], a[h][0], a[h][2]);
            C::quad_to_f16x2(r[2 * h + 1], a[h][1], a[h][3]);
        }
    }
}

// The A fragments of O^T += V^T P^T for keys 16 mk .. of the value tile at `tile`, m-tiles
// c and c + 1 of dimensions (c even; the second only below KS). 16-bit values: one
// ldmatrix.trans per m-tile. fp8 codes: one for both, each register holding two keys' codes
// of dimensions 2 g and 2 g + 1, split by a byte permute into the f16 pairs of dimension 2 g
// (rows g) and 2 g + 1 (rows g + 8).
template <class C, int KS, int RB, bool SW>
__device__ __forceinline__ void value_fragments(u32 (&a)[2][4], u32 tile, int mk, int c) {
    const int lane = threadIdx.x % 32;
    if constexpr (sizeof(typename C::Type) == 2) {
        const u32 at = tile + (16 * mk + lane % 8 + 8 * (lane / 16)) * RB;
        const u32 lane_unit = 16 * unit<SW>(lane / 8 % 2);
#pragma unroll
        for (int h = 0; h < 2 && c + h < KS; ++h) {
            ldmatrix_x4_trans(a[h], at + unit_pair<SW>(lane_unit, c + h));
        }
    } else {
        const u32 at = tile + (16 * mk + lane % 8 + 8 * (lane / 8 % 2)) * RB;
        u32 r[4];
        ldmatrix_x4_trans(r, at + unit_pair<SW>(16 * unit<SW>(lane / 16), c / 2));
#pragma unroll
        for (int h = 0; h < 2 && c + h < KS; ++h) {
            u32 x[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                // Bytes (key 2 t4: dims 2 g, 2 g + 1; key 2 t4 + 1: the same) as
                // (dim 2 g: both keys; dim 2 g + 1: both keys).
                asm("prmt.b32 %0, %1, 0, 0x3120;" : "=r"(x[i]) : "r"(r[2 * h + i]));
            }
            C::quad_to_f16x2(x[0], a[h][0], a[h][1]);
            C::quad_to_f16x2(x[1], a[h][2], a[h][3]);
        }
    }
}

template <class E, class C, class M, class V, class S>
__device__ __forceinline__ void decode_mma(const Params& p) {
    constexpr int D = S::D, DP = S::DP, ROWS = S::ROWS, KT = S::KT, RB = S::ROW_BYTES;
    constexpr int KS = DP / 16;  // k-steps of S^T, m-tiles of O^T
    constexpr int MK = KT / 16;  // m-tiles of S^T, k-steps of O^T
    constexpr bool FP8 = sizeof(typename C::Type) == 1;
    constexpr int STORED = S::STORED, COPY = S::COPY, CPR = S::CPR, STAGES = S::STAGES;
    static_assert(KT % 16 == 0 && KT <= 32, "one lane per key of a tile");
    static_assert(ROWS <= 8, "the heads are the mma's 8 columns");
    __shared__ DecodeStates<ROWS> states;
    u8* const smem = dynamic_shared(S::BYTES);
    typedef typename E::Bits Bits;

    const i64* unit = p.units + (i64)blockIdx.x * UNIT_FIELDS;
    const i64* seq = p.seqs + unit[UNIT_SEQ] * SEQ_FIELDS;
    const u8* keys = (const u8*)p.key;
    const u8* values = (const u8*)p.value;
    const i64 kv_head = unit[UNIT_KV_HEAD];
    const int heads = (int)unit[UNIT_HEADS];  // <= ROWS
    const i64 token = seq[SEQ_QUERY_START] + unit[UNIT_TOKEN];
    const i64 first_head = kv_head * p.group + unit[UNIT_HEAD];
    const i64 key_start = unit[UNIT_KEY_START];
    const i64 key_end = unit[UNIT_KEY_END];
    const u32 block_div = block_divisor(p);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t4 = lane % 4;
    const i64 pos = V::position(seq, unit[UNIT_TOKEN]);

    // The warp's ring; the padding of its rows zeroed once (cp.async writes D elements).
    u8* const ring = smem + warp * STAGES * S::STAGE_BYTES;
    const u32 ring_at = smem_address(ring);
    constexpr int PAD_WORDS = (RB - D * STORED) / 4;
    if constexpr (PAD_WORDS > 0) {
#pragma unroll 1
        for (int x = lane; x < STAGES * 2 * KT * PAD_WORDS; x += 32) {
            ((u32*)(ring + x / PAD_WORDS * RB + D * STORED))[x % PAD_WORDS] = 0;
        }
    }

    // The unit's keys in tiles at positions that are multiples of KT (keys before key_start
    // or at or past key_end in a tile are no keys: zeros, masked), so that a tile's 16-key
    // segments each lie in one block wherever the block size is a multiple of 16. There one
    // lookup gives a segment's first row, the others following D elements apart: a lane
    // looks up the segment of its index in a batch of 32 of the warp's segments, a batch
    // ahead, and staging a tile takes SPT shuffles. Other block sizes, and the call's own
    // keys, look up a row per key (a lane per key), two tiles ahead.
    constexpr int SPT = KT / 16;  // segments per tile: 1 or 2
    // The first n keys of a tile, a bit each; WHOLE_TILE: all of them.
    constexpr auto below = [](int n) { return n >= 32 ? FULL : (1u << n) - 1; };
    constexpr u32 WHOLE_TILE = below(KT);
    const i64 first = key_start - key_start % KT;
    const int tiles = (int)((key_end - first + KT - 1) / KT);
    // This warp's tiles, warp-uniform (a lane's broadcast: see decode.cuh).
    const int count = __shfl_sync(FULL, tiles > warp ? (tiles - warp + WARPS - 1) / WARPS : 0, 0);
    const bool by_segment = p.paged && p.block_size % 16 == 0;
    auto tile_start = [&](int k) -> i64 { return first + (i64)(warp + k * WARPS) * KT; };
    // The storage of key j, or -1 where none of the t keys from j is a key (a segment's 16
    // keys, or this lane's own: t = 1); key_offset says -1 from key_end on.
    auto storage = [&](i64 j, int t) -> i64 {
        return j + t > key_start ? key_offset<D>(p, seq, kv_head, key_end, block_div, j) : -1;
    };
    // By segment: this lane's segment of the warp's batch b. By key: this lane's key of the
    // warp's k-th tile.
    auto lookup = [&](int b) -> i64 {
        if (by_segment) {
            const int n = 32 * b + lane;
            return n / SPT < count ? storage(tile_start(n / SPT) + 16 * (n % SPT), 16) : -1;
        }
        return b < count && lane < KT ? storage(tile_start(b) + lane, 1) : -1;
    };
    // `held` holds the lookups of the tile to stage (by segment: its batch) and `ahead` the
    // next ones; called before staging tile k, in order.
    i64 held = lookup(0), ahead = lookup(1);
    auto advance = [&](int k) {
        if (k > 0 && (!by_segment || k * SPT % 32 == 0)) {
            held = ahead;
            ahead = lookup(by_segment ? k * SPT / 32 + 1 : k + 1);
        }
    };
    // A tile's copies: lane (r0, col) = (lane / CPR, lane % CPR) copies unit col of rows
    // r0 + x RPI (x < NX); lanes past RPI x CPR copy nothing. Where RPI divides 16 (every
    // power of two: CPR divides 32), a copy's rows lie in one segment, x RPI / 16, at
    // r0 + x RPI % 16 in it, so that its address is this lane's part plus a constant of x.
    constexpr int RPI = 32 / CPR, NX = (KT + RPI - 1) / RPI;
    constexpr bool WHOLE = 16 % RPI == 0;
    static_assert(CPR <= 32 && (!S::SWIZZLE || WHOLE), "swizzled rows: CPR divides 32");
    const int r0 = lane / CPR, col = lane % CPR;
    // Where copy x puts its unit in a stage: row r0 + x RPI; swizzled, unit col ^ (row % 8),
    // where row % 8 = (r0 % 8) ^ (x RPI % 8) (r0 < RPI, a power of two).
    const u32 lane_dst = r0 * RB + (S::SWIZZLE ? (col ^ (r0 % 8)) : col) * COPY;
    auto dst_of = [&](int x) -> u32 {
        return x * RPI * RB + (S::SWIZZLE ? lane_dst ^ (x * RPI % 8 * COPY) : lane_dst);
    };
    // The stage after the one at `at` in the ring (a register carried through the loop: an
    // address from k % STAGES is recomputed into every ldmatrix's address).
    auto next_stage = [&](u32 at) -> u32 {
        return at == ring_at + (STAGES - 1) * S::STAGE_BYTES ? ring_at : at + S::STAGE_BYTES;
    };
    // The warp's k-th tile into the stage at `at` (zeros for non-keys), as one commit group
    // (empty past the warp's tiles). Returns the tile's keys that are keys, one bit each.
    auto stage = [&](int k, u32 at) -> u32 {
        const i64 j0 = tile_start(k);
        u32 present = k < count ? WHOLE_TILE : 0;
        if (k < count && (key_start > j0 || key_end < j0 + KT)) {  // the unit's first or last
            const int lo = (int)max((i64)0, key_start - j0);
            const int hi = (int)max((i64)0, min((i64)KT, key_end - j0));
            present = below(hi) & ~below(lo);
        }
        // Unit col of row r0 + x RPI from byte `from` of the keys and the values (nothing
        // read without a key).
        auto copy = [&](int x, i64 from, bool key) {
            if ((KT % RPI == 0 || r0 + x * RPI < KT) && lane < RPI * CPR) {
                // (Swizzled rows take 16-byte copies: a copy is a unit.)
                const u32 dst = at + dst_of(x);
                cp_async<COPY>(dst, keys + from, !key);
                cp_async<COPY>(dst + S::TILE_BYTES, values + from, !key);
            }
        };
        if (k < count && by_segment) {
            // The segments' first rows, from which their rows follow D elements apart.
            const i64 first_row = max((i64)0, __shfl_sync(FULL, held, k * SPT % 32));
            const i64 second_row =
                SPT == 1 ? first_row : max((i64)0, __shfl_sync(FULL, held, (k * SPT + 1) % 32));
            const u32 mine = present >> r0;  // bit x RPI: row r0 + x RPI holds a key
            const int lane_from = (WHOLE ? r0 * D : 0) * STORED + col * COPY;
#pragma unroll
            for (int x = 0; x < NX; ++x) {
                const int t = r0 + x * RPI;
                const bool second = SPT > 1 && (WHOLE ? x * RPI >= 16 : t >= 16);
                const int row = (WHOLE ? x * RPI % 16 : t % 16) * D;
                const bool key = WHOLE ? (mine >> (x * RPI)) & 1 : t < 32 && (present >> t) & 1;
                copy(x, ((second ? second_row : first_row) + row) * STORED + lane_from, key);
            }
        } else if (k < count) {
#pragma unroll
            for (int x = 0; x < NX; ++x) {
                const i64 off = __shfl_sync(FULL, held, min(r0 + x * RPI, KT - 1));
                copy(x, max((i64)0, off) * STORED + col * COPY, off >= 0);
            }
        }
        cp_async_commit();
        return present;
    };

    u32 present[STAGES];  // the staged tiles' key bits, oldest first
    u32 fill_at = ring_at;  // the stage of the next tile staged (k % STAGES)
    // The first tiles are on their way before the queries are read.
#pragma unroll
    for (int k = 0; k + 1 < STAGES; ++k) {
        advance(k);
        present[k] = stage(k, fill_at);
        fill_at = next_stage(fill_at);
    }

    // Q^T's B fragments: head g's dimensions (k-step kk) 2 t4, 2 t4 + 1 and 2 t4 + 8, 2 t4 + 9
    // (fp8 keys: 4 t4 .. 4 t4 + 3); zeros past D and for heads past the unit's.
    u32 qb[KS][2];
    float qfactor[2] = {1.0f, 1.0f}, slope[2] = {0.0f, 0.0f};  // of heads 2 t4 + j
    {
        float q[KS][4];
        float amax = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int d = 16 * kk + (FP8 ? 4 * t4 + 2 * x : 2 * t4 + 8 * x);
                u32 w = 0;
                if (g < heads && d < D) {
                    w = *(const u32*)((const Bits*)p.query +
                                      (token * p.num_heads + first_head + g) * D + d);
                }
                q[kk][2 * x] = E::to_f32((u16)w);
                q[kk][2 * x + 1] = E::to_f32((u16)(w >> 16));
                amax = fmaxf(amax, fmaxf(fabsf(q[kk][2 * x]), fabsf(q[kk][2 * x + 1])));
            }
        }
        float up = 1.0f;
        if constexpr (S::SCALE_Q) {
            amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 2));
            // amax in [2^e, 2^(e + 1)) (e = 128 for Inf or NaN, -127 for 0 or a subnormal):
            // 2^(14 - e), within what an f32 power of two holds.
            const int e = (int)((__float_as_uint(amax) >> 23) & 0xff) - 127;
            const int up_exp = max(-114, min(126, 14 - e));
            up = __uint_as_float((u32)(127 + up_exp) << 23);
            const float down = __uint_as_float((u32)(127 - up_exp) << 23);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                qfactor[j] = __shfl_sync(FULL, down, 4 * (2 * t4 + j));
            }
        }
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            qb[kk][0] = M::pack2(q[kk][0] * up, q[kk][1] * up);
            qb[kk][1] = M::pack2(q[kk][2] * up, q[kk][3] * up);
        }
    }
    if (V::ALIBI) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (2 * t4 + j < heads) {
                slope[j] = p.slopes[first_head + 2 * t4 + j];
            }
        }
    }

    // The f32 state of heads 2 t4 + j (m agreed by the 8 lanes of a t4, l this lane's keys'),
    // O^T, and the f64 state: the base (m at the last fold), this lane's sums, and the
    // accumulators in shared memory, each element owned by the lane holding it in O^T.
    float m[2] = {-f32_inf(), -f32_inf()}, l[2] = {0.0f, 0.0f}, base[2] = {-f32_inf(), -f32_inf()};
    double l64[2] = {0.0, 0.0};
    float o[KS][4];
#pragma unroll
    for (int c = 0; c < KS; ++c) {
        o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.0f;
    }
    double* const acc = (double*)(smem + S::STAGING) + warp * ROWS * D;  // [ROWS][D]
#pragma unroll
    for (int c = 0; c < KS; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int h = 2 * t4 + e % 2, d = dim<FP8>(c, e / 2);
            if (h < ROWS && d < D) {
                acc[h * D + d] = 0.0;
            }
        }
    }
    // The f32 state added into the f64 one, as decode.cuh's fold (which says why): O^T has
    // summed its keys already, so each element is one lane's.
    auto fold = [&]() {
        double scale[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            scale[j] = base[j] == m[j] ? 1.0 : exp((double)base[j] - (double)m[j]);
            l64[j] = fma(l64[j], scale[j], (double)l[j]);
            l[j] = 0.0f;
            base[j] = m[j];
        }
#pragma unroll
        for (int c = 0; c < KS; ++c) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = 2 * t4 + e % 2, d = dim<FP8>(c, e / 2);
                if (h < ROWS && d < D) {
                    double* const a = acc + h * D + d;
                    *a = fma(*a, scale[e % 2], (double)o[c][e]);
                }
                o[c][e] = 0.0f;
            }
        }
    };

    bool attended = false;
    u32 k_tile = ring_at;  // tile k's stage
    // Groups of FOLD tiles, each folded after its last: the inner loop keeps O^T in the same
    // registers (with a fold inside it, ptxas copied every product back: 32 moves a tile).
#pragma unroll 1
    for (int k0 = 0; k0 < count; k0 += S::FOLD) {
        const int group_end = min(count, k0 + S::FOLD);
#pragma unroll 1
        for (int k = k0; k < group_end; ++k) {
            advance(k + STAGES - 1);
            present[STAGES - 1] = stage(k + STAGES - 1, fill_at);
            fill_at = next_stage(fill_at);
            cp_async_wait<STAGES - 1>();  // tile k has landed (this lane's copies of it)
            __syncwarp();                 // and every lane's
            const u32 keys_here = present[0];
#pragma unroll
            for (int x = 0; x + 1 < STAGES; ++x) {
                present[x] = present[x + 1];
            }
            attended |= keys_here != 0;
            const u32 v_tile = k_tile + S::TILE_BYTES;
            const i64 j0 = tile_start(k);

            // S^T = K Q^T, then the scores: element e of m-tile mk is key 16 mk + g + 8 (e / 2),
            // head 2 t4 + e % 2.
            float s[MK][4];
#pragma unroll
            for (int mk = 0; mk < MK; ++mk) {
                s[mk][0] = s[mk][1] = s[mk][2] = s[mk][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KS; kk += 2) {
                    u32 a[2][4];
                    key_fragments<C, KS, RB, S::SWIZZLE>(a, k_tile, mk, kk);
#pragma unroll
                    for (int h = 0; h < 2 && kk + h < KS; ++h) {
                        M::mma(s[mk], a[h], qb[kk + h][0], qb[kk + h][1]);
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int t = 16 * mk + g + 8 * (e / 2);
                    const float dot = S::SCALE_Q ? s[mk][e] * qfactor[e % 2] : s[mk][e];
                    s[mk][e] = V::logits(p, dot, j0 + t - pos, slope[e % 2]);
                }
            }
            // The keys that are none (a unit's first or last tile only, a warp-uniform test):
            // their rows are zeros, so the scores above are finite, and they weigh nothing.
            if (keys_here != WHOLE_TILE) {
#pragma unroll
                for (int mk = 0; mk < MK; ++mk) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (!((keys_here >> (16 * mk + g + 8 * (e / 2))) & 1)) {
                            s[mk][e] = -f32_inf();
                        }
                    }
                }
            }
            // The online softmax per head: one new max per tile (over the 8 lanes of a t4).
            float alpha[2], row_base[2];
            bool changed = false;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float tile_max = -f32_inf();
#pragma unroll
                for (int mk = 0; mk < MK; ++mk) {
                    tile_max = fmaxf(tile_max, fmaxf(s[mk][j], s[mk][j + 2]));
                }
#pragma unroll
                for (int x = 4; x < 32; x *= 2) {
                    tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL, tile_max, x));
                }
                const float m_new = fmaxf(m[j], tile_max);
                alpha[j] = rescale(m[j], m_new);
                changed |= alpha[j] != 1.0f;
                m[j] = m_new;
                row_base[j] = softmax_base(m_new);
                l[j] *= alpha[j];
            }
            // P^T's B fragments: the weights rounded to M, moved from S^T's layout (lane: key
            // g, heads 2 t4, 2 t4 + 1) to B's (lane: head g, keys 2 t4, 2 t4 + 1).
            u32 pb[MK][2];
#pragma unroll
            for (int mk = 0; mk < MK; ++mk) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[mk][e] = weight(s[mk][e], row_base[e % 2]);
                    l[e % 2] += s[mk][e];
                }
                pb[mk][0] = movmatrix_trans(M::pack2(s[mk][0], s[mk][1]));
                pb[mk][1] = movmatrix_trans(M::pack2(s[mk][2], s[mk][3]));
            }
            if (__any_sync(FULL, changed)) {
#pragma unroll
                for (int c = 0; c < KS; ++c) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        o[c][e] *= alpha[e % 2];
                    }
                }
            }
            // O^T += V^T P^T.
#pragma unroll
            for (int mk = 0; mk < MK; ++mk) {
#pragma unroll
                for (int c = 0; c < KS; c += 2) {
                    u32 a[2][4];
                    value_fragments<C, KS, RB, S::SWIZZLE>(a, v_tile, mk, c);
#pragma unroll
                    for (int h = 0; h < 2 && c + h < KS; ++h) {
                        M::mma(o[c + h], a[h], pb[mk][0], pb[mk][1]);
                    }
                }
            }
            __syncwarp();  // every lane has read the stage that the next iteration refills
            k_tile = next_stage(k_tile);
        }
        fold();
    }
    cp_async_wait<0>();
    // Each head's sum over the warp's lanes; lanes 0..3 hold heads 2 t4 + j.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int x = 4; x < 32; x *= 2) {
            l64[j] += __shfl_xor_sync(FULL, l64[j], x);
        }
        if (g == 0 && 2 * t4 + j < ROWS) {
            states.base[warp][2 * t4 + j] = m[j];
            states.l[warp][2 * t4 + j] = l64[j];
        }
    }
    if (lane == 0) {
        states.attended[warp] = attended ? 1 : 0;
    }
    __syncthreads();
    merge_warps<E, V, D, ROWS>(p, unit, states, (const double*)(smem + S::STAGING), heads, token,
                               first_head);
}
