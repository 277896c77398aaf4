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
