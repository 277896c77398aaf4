// The online softmax's arithmetic, shared by every kernel: the base a running max gives,
// the weights, the rescale of an older state. (The states themselves live where their
// layout does: the mainloops' fragments, the decode's lanes.)

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

// ---- The tensor-core mainloops' steps on accumulator fragments ----
// A thread holds rows of MT row blocks of 16, two rows each (ri = 0: row lane / 4, ri = 1: that
// + 8); element e of n-tile n of a tile's scores is row e / 2, key 8 n + 2 (lane % 4) + e % 2
// (mma.sync's C layout, which wgmma's accumulators share). Non-keys of a tile (past the unit)
// are bits of `absent`, 32 keys per word.

// Bit t of `absent`, for a t known only at run time (selects, not an indexed register array).
template <int WORDS>
__device__ __forceinline__ bool absent_key(const u32 (&absent)[WORDS], int t) {
    u32 word = absent[0];
#pragma unroll
    for (int x = 1; x < WORDS; ++x) {
        word = t / 32 == x ? absent[x] : word;
    }
    return (word >> (t % 32)) & 1;
}

// A tile's scores from its dot products s (keys j0 + t): the variant's logits transform
// (unless UNSCALED: a positive scale kept out of the scores, see `prefill_mma.cuh`) and, on a
// MASKED tile, -Inf (a select) where a row does not attend a key ([lo, hi) per row, absolute
// positions) or the key is absent; `attended` collects bit 2 mt + ri for a row that attends
// a key of the tile.
template <class V, bool MASKED, bool UNSCALED, int MT, int NT, int WORDS>
__device__ __forceinline__ void tile_scores(const Params& p, float (&s)[MT][NT][4], int j0,
                                            const int (&pos)[MT][2], const float (&slope)[MT][2],
                                            const int (&lo)[MT][2], const int (&hi)[MT][2],
                                            const u32 (&absent)[WORDS], u32& attended) {
    const int t4 = threadIdx.x % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = 8 * n + 2 * t4 + e % 2, ri = e / 2;
                float x = UNSCALED ? s[mt][n][e]
                                   : V::logits(p, s[mt][n][e], (i64)j0 + t - pos[mt][ri],
                                               slope[mt][ri]);
                if (MASKED) {
                    const bool a = !absent_key(absent, t) & (t >= lo[mt][ri] - j0) &
                                   (t < hi[mt][ri] - j0);
                    x = a ? x : -f32_inf();
                    attended |= (u32)a << (2 * mt + ri);
                }
                s[mt][n][e] = x;
            }
        }
    }
}

// Whether a mainloop keeps the scale out of the scores (`unscaled` below): a positive scale
// alone, whose weights' exponent factor scale log2(e) is finite. A larger scale (up to
// f32::MAX, as the contract allows) takes scaled scores, rounded to f32's range: folded, its
// factor would be +Inf and every weight NaN (0 x Inf).
template <class V>
__device__ __forceinline__ bool keeps_scale_out(const Params& p) {
    return V::SCALE_ONLY && p.score_scale > 0.0f && p.score_scale * LOG2E < f32_inf();
}

// A tile's scores by the right instance of `tile_scores`: masked where some row does not
// attend the whole tile (`rows_full` false) or a key is absent, the rows' bounds then read by
// `bounds(row_lo, row_hi)` (they wait in shared memory: registers are what limits the
// mainloops); plain otherwise, with no mask arithmetic, and nothing at all where `unscaled`
// (a positive scale kept out of the scores: the max and the masks work on the dot products,
// whose order is the scaled scores', and the scale joins the weights' exponent factor).
template <class V, int MT, int NT, int WORDS, class Bounds>
__device__ __forceinline__ void tile_logits(const Params& p, float (&s)[MT][NT][4], int j0,
                                            const int (&pos)[MT][2], const float (&slope)[MT][2],
                                            const int (&lo)[MT][2], const int (&hi)[MT][2],
                                            const u32 (&absent)[WORDS], bool rows_full,
                                            bool unscaled, Bounds bounds, u32& attended) {
    bool any_absent = false;
#pragma unroll
    for (int x = 0; x < WORDS; ++x) {
        any_absent |= absent[x] != 0;
    }
    if (!rows_full || any_absent) {
        int row_lo[MT][2], row_hi[MT][2];
        bounds(row_lo, row_hi);
        if (unscaled) {
            tile_scores<V, true, true>(p, s, j0, pos, slope, row_lo, row_hi, absent, attended);
        } else {
            tile_scores<V, true, false>(p, s, j0, pos, slope, row_lo, row_hi, absent, attended);
        }
    } else {
        if (!unscaled) {
            tile_scores<V, false, false>(p, s, j0, pos, slope, lo, hi, absent, attended);
        }
        attended = ~0u;
    }
}

// The online softmax of a tile: each row's new max m (over the quad of lanes sharing the
// row), the factor alpha rescaling its older state, the weights in place of the scores, the
// rows' sums l. `to_score` turns a value of s into its score (the scale where the dot products
// were kept unscaled, else 1). The weights take one FFMA per score where every row of the warp
// has a small base, else `weight` (a warp-uniform choice). Returns whether some row of the
// warp changed its max (some alpha is not exactly 1).
template <int MT, int NT>
__device__ __forceinline__ bool softmax_tile(float (&s)[MT][NT][4], float (&m)[MT][2],
                                             float (&l)[MT][2], float (&alpha)[MT][2],
                                             float to_score) {
    float base_of[MT][2];
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
            const float m_new = fmaxf(m[mt][ri], tile_max * to_score);
            alpha[mt][ri] = rescale(m[mt][ri], m_new);
            m[mt][ri] = m_new;
            base_of[mt][ri] = softmax_base(m_new);
            all_foldable &= foldable(base_of[mt][ri]);
            changed |= alpha[mt][ri] != 1.0f;
        }
    }
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
                        s[mt][n][e] = decltype(folded)::value
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
    return __any_sync(FULL, changed);
}

// The accumulators of a thread's rows rescaled by their factors.
template <int MT, int DT>
__device__ __forceinline__ void rescale_rows(float (&o)[MT][DT][4], const float (&alpha)[MT][2]) {
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

// Whether a value tile of KT keys (CH 16-byte chunks of stored elements E per row, laid out
// as L::chunk_at says) holds a non-finite element, as far as this thread's share (`thread` of
// `threads`) goes.
template <class E, class L, int KT, int CH>
__device__ __forceinline__ bool tile_nonfinite(const u8* tile, int thread, int threads) {
    bool bad = false;
    for (int c = thread; c < KT * CH; c += threads) {
        const U128 v = *(const U128*)(tile + L::chunk_at(KT, c / CH, c % CH));
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            bad |= (w[x] & E::EXPONENT) == E::EXPONENT ||
                   ((w[x] >> 16) & E::EXPONENT) == E::EXPONENT;
        }
    }
    return bad;
}

// O += P V for one row block through selects, for a tile where some row does not attend some
// key and some value is not finite: each key's value is added only to the rows that attend it
// ([lo, hi) per row, absolute; absent keys to none), so that 0 x NaN never reaches a row that
// does not attend that key. P is the row block's A fragments (rounded to E, as the tensor
// cores take it), passed through the warp's `scratch` of 16 x KT elements; the value tile
// (KT keys, DT chunks of 8 per row) is laid out as L::chunk_at says.
template <class E, class L, int KT, int DT, int WORDS>
__device__ __forceinline__ void pv_by_selects(float (&o)[DT][4], const u32 (&a)[KT / 16][4],
                                              u32* scratch, const u8* v_tile, int j0,
                                              const int (&lo)[2], const int (&hi)[2],
                                              const u32 (&absent)[WORDS]) {
    typedef typename E::Bits Bits;
    const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    // A fragment kk: rows g and g + 8 (registers 0 and 1) of keys 16 kk + 2 t4 and + 1, then
    // (registers 2 and 3) the same 8 keys on.
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            scratch[(g + 8 * (x % 2)) * (KT / 2) + 8 * kk + 4 * (x / 2) + t4] = a[kk][x];
        }
    }
    __syncwarp();
    const Bits* ps = (const Bits*)scratch;
#pragma unroll 1
    for (int t = 0; t < KT; ++t) {
        const bool key = !absent_key(absent, t);
        const bool a0 = key && t >= lo[0] - j0 && t < hi[0] - j0;
        const bool a1 = key && t >= lo[1] - j0 && t < hi[1] - j0;
        const float p0 = E::to_f32(ps[g * KT + t]), p1 = E::to_f32(ps[(g + 8) * KT + t]);
#pragma unroll
        for (int n = 0; n < DT; ++n) {
            const Bits* v = (const Bits*)(v_tile + L::chunk_at(KT, t, n)) + 2 * t4;
            const float v0 = E::to_f32(v[0]), v1 = E::to_f32(v[1]);
            o[n][0] = a0 ? fmaf(p0, v0, o[n][0]) : o[n][0];
            o[n][1] = a0 ? fmaf(p0, v1, o[n][1]) : o[n][1];
            o[n][2] = a1 ? fmaf(p1, v0, o[n][2]) : o[n][2];
            o[n][3] = a1 ? fmaf(p1, v1, o[n][3]) : o[n][3];
        }
    }
    __syncwarp();
}
