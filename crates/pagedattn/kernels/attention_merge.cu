// The split-K merge: one output row (token, query head) from the partials its partitions left
// in the workspace (attention/decode.cuh), combined exactly by their log-sum-exp:
//   M = max_p m_p,  L = sum_p l_p e^(m_p - M),  out = (sum_p acc_p e^(m_p - M)) * v_scale / L.
// Compiled after elements.cuh.
//
// The contract's rules carry over: a partition whose max is -Inf weighs 0, and its sum and
// accumulators (0, or NaN from a NaN score or a 0 * NaN value) enter multiplied by that 0,
// NaN surviving; M = +Inf makes the row NaN (e^(Inf - Inf)); with every max -Inf the row is
// NaN if any partition attended a key (all its scores were -Inf or NaN) and exactly 0 if none
// did.

// The fields of one merge record (MERGE_TOKEN, MERGE_HEAD, MERGE_FIRST, MERGE_COUNT: the
// output row and its partitions' partial slots [first, first + count); a count of 0 leaves
// the row alone) are generated before this file from src/cuda/abi.rs.

// Partitions whose weights one pass computes, one per thread (the launch's 128 threads).
constexpr int MERGE_BATCH = 128;

// The sums run in f64: recursive f32 summation of P partitions errs by up to (P - 1) 2^-24
// of the magnitudes' sum (plan.rs splits a unit into up to 2 per multiprocessor: P = 264 on
// an H100, 1.6e-5), f64 by (P - 1) 2^-53, nothing next to the f32 rounding each partial
// carries (attention/decode.cuh's fold bounds that). Each weight e^(m_p - M) is computed once
// per partition (f64, from the exact difference of two f32 maxima) and shared through shared
// memory, not once per dimension.
template <class E>
__device__ __forceinline__ void merge(const float* partials, const i64* merges, void* output,
                                     i64 num_heads, i64 head_size, float out_scale) {
    __shared__ double weights[MERGE_BATCH];
    const i64* m = merges + (i64)blockIdx.x * MERGE_FIELDS;
    const i64 count = m[MERGE_COUNT];
    if (count == 0) {
        // A graph plan's idle merge: this step left the row's unit unsplit, and the unit
        // wrote the row itself (plan.rs, Split::Fixed).
        return;
    }
    const i64 record = head_size + 4;
    const float* first = partials + m[MERGE_FIRST] * record;
    float max = -f32_inf();
    bool attended = false;
    for (i64 k = 0; k < count; ++k) {
        max = fmaxf(max, first[k * record]);
        attended |= first[k * record + 2] != 0.0f;
    }
    // Each thread's dimensions: d = threadIdx.x + x blockDim.x (head sizes are at most 256,
    // the launch has MERGE_BATCH threads).
    constexpr int PER_THREAD = 2;
    if (head_size > PER_THREAD * (i64)blockDim.x || blockDim.x < MERGE_BATCH) {
        __trap();
    }
    double acc[PER_THREAD] = {0.0, 0.0};
    double sum = 0.0;
    for (i64 batch = 0; batch < count; batch += MERGE_BATCH) {
        const i64 k = batch + threadIdx.x;
        if (threadIdx.x < MERGE_BATCH && k < count) {
            weights[threadIdx.x] =
                max == -f32_inf() ? 0.0 : exp((double)first[k * record] - (double)max);
        }
        __syncthreads();
        const i64 n = min(count - batch, (i64)MERGE_BATCH);
        for (i64 i = 0; i < n; ++i) {
            const double w = weights[i];
            const float* part = first + (batch + i) * record;
            sum = fma((double)part[1], w, sum);
#pragma unroll
            for (int x = 0; x < PER_THREAD; ++x) {
                const i64 d = threadIdx.x + x * (i64)blockDim.x;
                if (d < head_size) {
                    acc[x] = fma((double)part[4 + d], w, acc[x]);
                }
            }
        }
        __syncthreads();
    }
    typename E::Bits* out =
        (typename E::Bits*)output + (m[MERGE_TOKEN] * num_heads + m[MERGE_HEAD]) * head_size;
    const double factor = (double)out_scale / sum;
#pragma unroll
    for (int x = 0; x < PER_THREAD; ++x) {
        const i64 d = threadIdx.x + x * (i64)blockDim.x;
        if (d < head_size) {
            const float o = max == -f32_inf() ? (attended ? f32_nan() : 0.0f)
                                              : (float)(acc[x] * factor);
            out[d] = E::from_f32(o);
        }
    }
}

// The argument, MergeParams, is generated before this file from src/cuda/kernels.rs.
#define MERGE_KERNEL(NAME, E)                                                                  \
    extern "C" __global__ void NAME(const MergeParams args) {                                  \
        merge<E>(args.partials, args.merges, args.output, args.num_heads, args.head_size,      \
                 args.out_scale);                                                              \
    }

MERGE_KERNEL(attention_merge_f32, F32)
MERGE_KERNEL(attention_merge_f16, F16)
MERGE_KERNEL(attention_merge_bf16, BF16)
