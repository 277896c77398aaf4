// The split-K merge: one output row (token, query head) from the partials its partitions left
// in the workspace (attention.cu), combined exactly by their log-sum-exp:
//   M = max_p m_p,  L = sum_p l_p e^(m_p - M),  out = (sum_p acc_p e^(m_p - M)) * v_scale / L.
// Compiled after elements.cuh.
//
// The contract's rules carry over: a partition whose max is -Inf weighs 0, and its sum and
// accumulators (0, or NaN from a NaN score or a 0 * NaN value) enter multiplied by that 0,
// NaN surviving; M = +Inf makes the row NaN (e^(Inf - Inf)); with every max -Inf the row is
// NaN if any partition attended a key (all its scores were -Inf or NaN) and exactly 0 if none
// did.

// The fields of one merge in the plan's `merges` section (i64 each); plan.rs writes them.
enum {
    MERGE_TOKEN,  // the output row's token
    MERGE_HEAD,   // and query head
    MERGE_FIRST,  // its partitions' partial slots: [first, first + count)
    MERGE_COUNT,
    MERGE_FIELDS
};

template <class E>
__device__ __forceinline__ void merge(const float* partials, const i64* merges, void* output,
                                     i64 num_heads, i64 head_size, float out_scale) {
    const i64* m = merges + (i64)blockIdx.x * MERGE_FIELDS;
    const i64 record = head_size + 4;
    const float* first = partials + m[MERGE_FIRST] * record;
    const i64 count = m[MERGE_COUNT];
    float max = -f32_inf();
    bool attended = false;
    for (i64 k = 0; k < count; ++k) {
        max = fmaxf(max, first[k * record]);
        attended |= first[k * record + 2] != 0.0f;
    }
    float sum = 0.0f;
    for (i64 k = 0; k < count; ++k) {
        const float w = max == -f32_inf() ? 0.0f : expf(first[k * record] - max);
        sum = fmaf(first[k * record + 1], w, sum);
    }
    typename E::Bits* out =
        (typename E::Bits*)output + (m[MERGE_TOKEN] * num_heads + m[MERGE_HEAD]) * head_size;
    for (i64 d = threadIdx.x; d < head_size; d += blockDim.x) {
        float acc = 0.0f;
        for (i64 k = 0; k < count; ++k) {
            const float w = max == -f32_inf() ? 0.0f : expf(first[k * record] - max);
            acc = fmaf(first[k * record + 4 + d], w, acc);
        }
        const float o = max == -f32_inf() ? (attended ? f32_nan() : 0.0f) : acc * (out_scale / sum);
        out[d] = E::from_f32(o);
    }
}

#define MERGE_KERNEL(NAME, E)                                                                  \
    extern "C" __global__ void NAME(const float* partials, const i64* merges, void* output,   \
                                    i64 num_heads, i64 head_size, float out_scale) {           \
        merge<E>(partials, merges, output, num_heads, head_size, out_scale);                   \
    }

MERGE_KERNEL(attention_merge_f32, F32)
MERGE_KERNEL(attention_merge_f16, F16)
MERGE_KERNEL(attention_merge_bf16, BF16)
