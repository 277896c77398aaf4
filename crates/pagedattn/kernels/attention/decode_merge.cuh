// The end of a decode unit, shared by both decodes (decode.cuh on the CUDA cores,
// decode_mma.cuh on the tensor cores): each warp kept an f64 state of the keys it took (a
// base, the sums of weights under it, and the accumulators in shared memory, [ROWS][D] per
// warp); the warps' states merge exactly, as attention_merge.cu merges partitions, into the
// output or this partition's partial record.

// Each warp's f64 state of up to ROWS rows, but for the accumulators.
template <int ROWS>
struct DecodeStates {
    float base[WARPS][ROWS];  // the max m at the warp's last fold
    double l[WARPS][ROWS];    // its sum of weights under that base (the merge's factors after)
    int attended[WARPS];      // whether the warp saw a key
};

// The warps' states merged in f64 (every warp's state written, then a barrier): M = max
// base, L = sum l e^(base - M), the accumulators likewise (with M = -Inf every weight is 0
// and NaN survives, as in attention_merge.cu). Thread r makes row r's factors once (they
// replace l), then every thread sums its elements. `acc` holds the warps' accumulators,
// [WARPS][ROWS][D]; the unit's `heads` rows are query heads first_head.. of `token`.
template <class E, class V, int D, int ROWS>
__device__ __forceinline__ void merge_warps(const Params& p, const i64* unit,
                                            DecodeStates<ROWS>& st, const double* acc,
                                            int heads, i64 token, i64 first_head) {
    __shared__ float big_r[ROWS];
    __shared__ double total_r[ROWS];  // the row's L, or v_scale / L for the output
    typedef typename E::Bits Bits;
    const int tid = threadIdx.x;
    const i64 part_base = unit[UNIT_PART_BASE];
    if (tid < heads) {
        const int r = tid;
        float big = -f32_inf();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            big = fmaxf(big, st.base[w][r]);
        }
        double sum = 0.0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const double f = big == -f32_inf() ? 0.0 : exp((double)st.base[w][r] - (double)big);
            sum = fma(st.l[w][r], f, sum);
            st.l[w][r] = f;
        }
        big_r[r] = big;
        total_r[r] = part_base < 0 ? (double)p.out_scale / sum : sum;
    }
    __syncthreads();
    bool any = false;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        any |= st.attended[w] != 0;
    }
#pragma unroll 1
    for (int x = tid; x < heads * D; x += THREADS) {
        const int r = x / D, d = x % D;
        double a = 0.0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            a = fma(acc[(w * ROWS + r) * D + d], st.l[w][r], a);
        }
        const float big = big_r[r];
        if (part_base < 0) {
            Bits* out = (Bits*)p.output + (token * p.num_heads + first_head + r) * D;
            out[d] = E::from_f32(V::output(a, big, any, total_r[r]));
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
