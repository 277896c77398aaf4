// The variant: what makes one attention differ from another, as hooks every kernel calls
// (FlashInfer's shape): the mask (which keys a row attends), the logits transform (scale,
// soft cap, ALiBi) and the output transform (normalization, v_scale, the empty and the
// poisoned row). A kernel never tests a setting itself: a new hook, or a new kind of mask or
// transform, is written here alone.

// One query row of a unit: its position, the keys it attends ([lo, hi), inside the unit's
// range) and its ALiBi slope.
struct Row {
    i64 pos, lo, hi;
    float slope;
};

template <int MASK_, bool ALIBI_, bool CAP_>
struct Variant {
    static constexpr int MASK = MASK_;
    static constexpr bool ALIBI = ALIBI_;
    static constexpr bool CAP = CAP_;
    // Whether the logits transform is the scale alone: a kernel may then keep a positive
    // scale out of the scores (their max and order are the dot products').
    static constexpr bool SCALE_ONLY = !ALIBI && !CAP;

    // The position of query token `token` (counted from the sequence's first) as the logits
    // transform measures distances from it.
    static __device__ __forceinline__ i64 position(const i64* seq, i64 token) {
        i64 pos = seq[SEQ_FIRST_POS] + token;
        if (MASK == MASK_NONE && ALIBI) {
            // A cross-attention query past every encoder key: its bias -slope * (i - j) is
            // -slope * (n - 1 - j) plus a constant of the row, which the softmax ignores (as
            // the cpu backend does). Position n - 1 keeps the distances small, exact, and the
            // scores free of a huge constant that f32 would round them into. (Encoder types'
            // queries are keys' positions already; non-causal positions serve nothing else.)
            pos = min(pos, seq[SEQ_KEYS] - 1);
        }
        return pos;
    }

    // The mask: row r (< the unit's rows) of `unit` (token r / heads, query head r % heads of
    // the unit), its position, the keys it attends and its slope.
    static __device__ __forceinline__ Row row(const Params& p, const i64* seq, const i64* unit,
                                              int r) {
        const int heads = (int)unit[UNIT_HEADS];
        Row row;
        row.pos = position(seq, unit[UNIT_TOKEN] + r / heads);
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

    // The logits transform of the contract's steps 1 to 3 after the dot product `dot`: the
    // scale (rounded to f32's range), the soft cap, then ALiBi with the integer distance
    // j - pos rounded once.
    static __device__ __forceinline__ float logits(const Params& p, float dot, i64 distance,
                                                   float slope) {
        float s = dot * p.score_scale;
        if (CAP) {
            s = p.soft_cap * tanhf(s / p.soft_cap);
        }
        if (ALIBI) {
            const float d = (float)distance;
            s = MASK == MASK_NONE ? fmaf(-slope, fabsf(d), s) : fmaf(slope, d, s);
        }
        return s;
    }

    // The output transform: the finished row, normalized with v_scale applied, NaN for a row
    // that attended only -Inf (or NaN) scores, exactly 0 for a row that attended no key.
    // `factor` is the row's v_scale / l, computed once; the f64 form rounds once.
    static __device__ __forceinline__ float output(float acc, float m, bool attended,
                                                   float factor) {
        return m == -f32_inf() ? (attended ? f32_nan() : 0.0f) : acc * factor;
    }
    static __device__ __forceinline__ float output(double acc, float m, bool attended,
                                                   double factor) {
        return m == -f32_inf() ? (attended ? f32_nan() : 0.0f) : (float)(acc * factor);
    }
};
