// The tensor-core steps of the FlashAttention-2 prefill (prefill_mma.cuh) with mma.sync
// (sm_80 and later): S = Q K^T and O += P V on m16n8k16 fragments read from shared memory
// with ldmatrix. Tiles are stored with rows DP + 8 elements apart: the 16 bytes of padding put
// the 8 rows an ldmatrix reads in 8 different 4-bank groups for every head size (row strides
// of 4, 12, 20 or 28 banks modulo 32). Warp w holds row blocks 16 (MT w + mt) of the CTA.

// Four 8x8 matrices of 16-bit elements from shared memory; lane l gives the address of row
// l % 8 of matrix l / 8, and register i receives matrix i's (row lane / 4, columns
// 2 (lane % 4) and 2 (lane % 4) + 1); `.trans` delivers the transposed matrices.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// An 8x8 matrix of 16-bit elements held as mma.sync fragments (lane l: row l / 4, columns
// 2 (l % 4) and + 1) transposed among the lanes (sm_75 and later).
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 r;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// P's A fragment of row block mt for keys 16 kk .. 16 kk + 15: the score fragments of
// n-tiles 2 kk and 2 kk + 1 (mma.sync's C layout), rounded to E.
template <class E, int MT, int NT>
__device__ __forceinline__ void p_fragment(u32 (&a)[4], const float (&s)[MT][NT][4], int mt,
                                           int kk) {
    a[0] = E::pack2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
    a[1] = E::pack2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
    a[2] = E::pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
    a[3] = E::pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
}

template <class E, class S>
struct MmaSync {
    static constexpr int MT = S::MT, DP = S::DP, KT = S::KT, NT = KT / 8, DT = DP / 8;
    static constexpr int ROW_BYTES = S::ROW_BYTES;
    // Query fragments in registers (MT * DP / 4 of them per thread), else read from shared
    // memory at every tile.
    static constexpr int QF = S::Q_REGS ? DP / 16 : 1;

    // Byte offset of 16-byte chunk c of row t in a tile of `rows` rows.
    static __device__ __forceinline__ u32 chunk_at(int, int t, int c) {
        return t * ROW_BYTES + c * 16;
    }
    // The first row (in the CTA) of row block mt of warp w.
    static __device__ __forceinline__ int row_block(int w, int mt) { return 16 * (MT * w + mt); }

    u32 q_base, q_lane0, k_lane, v_lane;
    u32 qf[MT][QF][4];

    __device__ __forceinline__ MmaSync(u32 q_tile, int warp, int lane) : q_base(q_tile) {
        // Lane offsets of the ldmatrix addresses: queries (A, row-major 16 x 16 per k-step),
        // keys (B of S = Q K^T, rows = keys) and values (B of O = P V, transposed).
        q_lane0 = (16 * MT * warp + lane % 8 + 8 * ((lane / 8) % 2)) * ROW_BYTES +
                  8 * (lane / 16) * 2;
        k_lane = (lane % 8 + 8 * (lane / 16)) * ROW_BYTES + 8 * ((lane / 8) % 2) * 2;
        v_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * ROW_BYTES + 8 * (lane / 16) * 2;
    }
    __device__ __forceinline__ u32 q_lane(int mt) const {
        return q_base + q_lane0 + 16 * mt * ROW_BYTES;
    }

    // After the query tile landed (and a barrier): its fragments into registers, with Q_REGS.
    __device__ __forceinline__ void load_queries() {
        if constexpr (S::Q_REGS) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int kk = 0; kk < QF; ++kk) {
                    ldmatrix_x4(qf[mt][kk], q_lane(mt) + kk * 32);
                }
            }
        }
    }
    // Between this thread's copies landing and the barrier that publishes them: nothing
    // (ldmatrix reads through the generic proxy).
    static __device__ __forceinline__ void copies_landed() {}

    // s = Q K^T for the key tile at k_tile: each key fragment serves the warp's MT row blocks.
    __device__ __forceinline__ void qk(float (&s)[MT][NT][4], u32 k_tile) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
            }
        }
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (S::Q_REGS) {
#pragma unroll
                    for (int x = 0; x < 4; ++x) {
                        a[mt][x] = qf[mt][S::Q_REGS ? kk : 0][x];
                    }
                } else {
                    ldmatrix_x4(a[mt], q_lane(mt) + kk * 32);
                }
            }
#pragma unroll
            for (int nn = 0; nn < KT / 16; ++nn) {
                u32 b[4];
                ldmatrix_x4(b, k_tile + nn * 16 * ROW_BYTES + k_lane + kk * 32);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    E::mma(s[mt][2 * nn], a[mt], b[0], b[1]);
                    E::mma(s[mt][2 * nn + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }

    // o += P V for the value tile at v_tile, P the weights in s: each value fragment serves
    // the warp's MT row blocks.
    __device__ __forceinline__ void pv(float (&o)[MT][DT][4], const float (&s)[MT][NT][4],
                                       u32 v_tile) const {
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                p_fragment<E>(a[mt], s, mt, kk);
            }
#pragma unroll
            for (int nd = 0; nd < DP / 16; ++nd) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_tile + kk * 16 * ROW_BYTES + v_lane + nd * 32);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    E::mma(o[mt][2 * nd], a[mt], b[0], b[1]);
                    E::mma(o[mt][2 * nd + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
};
