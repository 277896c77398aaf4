// The tensor-core prefill's epilogue: each row's sum and attended flag gathered over the quad
// of lanes that shares it, then the row finished by the variant's output transform and
// stored, two elements at a time, as E. Rows past the unit's are never written.
// `block_row[mt]`: the unit row of row block mt's first row.
template <class E, class V, int D, int MT, int DT>
__device__ __forceinline__ void prefill_epilogue(const Params& p, const float (&o)[MT][DT][4],
                                                 const float (&m)[MT][2],
                                                 const float (&l)[MT][2], u32 attended,
                                                 const int (&block_row)[MT], int rows,
                                                 i64 first_token, i64 first_head, int heads) {
    typedef typename E::Bits Bits;
    const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
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
            const int r = block_row[mt] + g + 8 * ri;
            if (r < rows) {
                const i64 token = first_token + r / heads, head = first_head + r % heads;
                Bits* out = (Bits*)p.output + (token * p.num_heads + head) * D;
                const float factor = p.out_scale / sum;
#pragma unroll
                for (int n = 0; n < DT; ++n) {
                    const int d = 8 * n + 2 * t4;
                    if (d < D) {
                        *(u32*)(out + d) =
                            E::pack2(V::output(o[mt][n][2 * ri], m[mt][ri], any != 0, factor),
                                     V::output(o[mt][n][2 * ri + 1], m[mt][ri], any != 0, factor));
                    }
                }
            }
        }
    }
}
