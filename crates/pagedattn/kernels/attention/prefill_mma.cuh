// The FlashAttention-2 prefill on the tensor cores (bf16 and f16 activations, keys and values
// stored as such or as fp8 codes, which each thread widens into E in the stage once its copies
// landed: StageRows, paged_kv.cuh) for the tensor-core steps TC (MmaSync:
// tensor_core_sm80.cuh), which store the tiles and compute S = Q K^T and O += P V; this file
// owns the pipeline, and runs the masks and the softmax (softmax.cuh) on the fragments.
// Hopper runs prefill_sm90.cuh from D = 64.
//
// Its shape S (MmaShape in src/cuda/variant.rs, generated into the program): rows of keys,
// values and queries are D elements padded with zero columns to DP, a multiple of the mma's
// k = 16. A warp holds MT row blocks of 16 (MT = 2 up to D = 128: each key and value fragment
// read from shared memory feeds two mma, and a tile's copies serve twice the rows; 1 above,
// where the accumulators would not fit), so a CTA runs CTA_ROWS rows and a unit's
// PREFILL_ROWS take PREFILL_ROWS / CTA_ROWS CTAs. Tiles hold KT keys. Dynamic shared memory:
// two stages of key tiles (TILE_BYTES each), two of value tiles, then the query tile (Q_BYTES;
// read into registers once, when Q_REGS) and the scratch of the P.V by selects (P_BYTES, one
// row block at a time: in the query tile's bytes when the queries live in registers, else in
// the tile's own key stage when that is large enough (SCRATCH_IN_KEYS: its keys are used up by
// then), else after the query tile). BYTES in all, which the kernel checks the launch gave.

// CTA_ROWS rows of a prefill unit (row block mt of warp w, as MmaShape says: rows + lane / 4
// and + 8 of it are this thread's, after the CTA's first row blockIdx.y * CTA_ROWS) over the
// unit's keys, in tiles of KT keys.
//
// Pipeline: tile i lands in stage i % 2 while tile i - 1 is computed. The block-table entries
// of tile i's keys (threads 0..KT-1, one key each) are copied asynchronously while tile i - 2
// is computed, and after it the same threads turn them into row offsets in off_s[i % 3],
// with a bit mask of the tile's non-keys (past the unit), whose rows
// cp.async fills with zeros instead of reading: no thread waits on a lookup's global reads
// (a warp that did would hold the others at the next barrier). Per tile: S = Q K^T
// on the tensor cores;
// the scale (unless `unscaled`), soft cap and ALiBi on the fragments; where the tile is
// `masked` (a non-key in it, or a row that does not attend all of it) a select puts -Inf on
// the scores rows do not attend; the online softmax per row (a quad of lanes holds a row); P
// rounded to E, then O += P V on the tensor cores. A masked tile where some row does not
// attend some key of it (`rows_full` false: the diagonal, a window's edge) is scanned for
// non-finite values first; if it holds one, its P.V runs through selects instead (`P_BYTES`
// of scratch: 16 x KT elements per warp), so that 0 * NaN never reaches a row that does not attend that key. (Non-keys
// are zeros: 0 * 0 enters.)
template <class E, class C, class V, class S, class TC>
__device__ __forceinline__ void prefill_mma(const Params& p) {
    constexpr int D = S::D, DP = S::DP, KT = S::KT, MT = S::MT;
    constexpr int CH = D / 8;   // 16-byte chunks of a row of E
    typedef StageRows<C, E, D> R;  // how stored rows reach the stages
    constexpr int NT = KT / 8;  // n-tiles of the scores
    constexpr int DT = DP / 8;  // n-tiles of the output
    constexpr int WORDS = (KT + 31) / 32;  // of a tile's non-key mask
    static_assert(KT <= 64 && THREADS >= 64, "threads 0..63 look up a tile's keys");
    __shared__ i64 off_s[3][KT];     // element offset of each key's row; -1: not a key
    __shared__ i64 table_s[3][KT];   // paged: the block-table entry of each key
    __shared__ u32 invalid_s[3][2];  // bit t: key t of the tile is not a key
    __shared__ int range_s[2];       // the largest lo and the smallest hi of the real rows
    __shared__ i64 key_base_s;       // the sequence's SEQ_KEY_BASE

    u8* const smem = dynamic_shared(S::BYTES);
    const u32 base = smem_address(smem);
    const u32 q_base = base + 4 * S::TILE_BYTES;

    typedef typename E::Bits Bits;
    const Bits* query = (const Bits*)p.query;

    const i64* unit = p.units + (i64)blockIdx.x * UNIT_FIELDS;
    const i64* seq = p.seqs + unit[UNIT_SEQ] * SEQ_FIELDS;
    const i64 kv_head = unit[UNIT_KV_HEAD];
    const int heads = (int)unit[UNIT_HEADS];
    const int rows = (int)(unit[UNIT_TOKENS] * heads);  // <= PREFILL_ROWS
    const int row_base = blockIdx.y * S::CTA_ROWS;     // this CTA's first row of the unit
    const i64 first_token = seq[SEQ_QUERY_START] + unit[UNIT_TOKEN];
    const i64 first_head = kv_head * p.group + unit[UNIT_HEAD];
    // Key positions fit in an int (below 2^31 - 1).
    const int key_start = (int)unit[UNIT_KEY_START];
    const int key_end = (int)unit[UNIT_KEY_END];
    // (In 64 bits: key_end - key_start + KT - 1 overflows an int past 2^31 - KT keys. Below,
    // key positions j0 + t of a tile are likewise never formed in an int: the last tile's
    // may pass 2^31 - 1; they are compared as t against bounds minus j0.)
    const int tiles = (int)(((i64)key_end - key_start + KT - 1) / KT);
    const u32 block_div = block_divisor(p);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t4 = lane % 4;
    const bool unscaled = keeps_scale_out<V>(p);
    // Row ri of this thread's row block mt, counted in the unit.
    auto row_index = [&](int mt, int ri) { return row_base + TC::row_block(warp, mt) + g + 8 * ri; };

    // This thread's rows; rows past `rows` attend nothing (and are never written). The keys
    // a row attends, [lo, hi), are only needed on masked tiles: they wait in shared memory
    // (registers are what limits this kernel).
    __shared__ int lo_s[S::CTA_ROWS], hi_s[S::CTA_ROWS];
    int pos[MT][2], lo[MT][2], hi[MT][2];  // lo and hi: until the prologue's range
    float slope[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
            const int r = row_index(mt, ri);
            lo[mt][ri] = hi[mt][ri] = pos[mt][ri] = 0;
            slope[mt][ri] = 0.0f;
            if (r < rows) {
                const Row row = V::row(p, seq, unit, r);
                // An empty range stays empty when clamped into the unit's keys.
                lo[mt][ri] = (int)row.lo;
                hi[mt][ri] = (int)max(row.hi, row.lo);
                pos[mt][ri] = (int)row.pos;
                slope[mt][ri] = row.slope;
            }
            if (t4 == 0) {
                lo_s[r - row_base] = lo[mt][ri];
                hi_s[r - row_base] = hi[mt][ri];
            }
        }
    }

    // Key t = tid of tile i (threads 0..KT-1): its block-table entry (paged) copied into
    // table_s, one commit group (empty for the other threads and past the tiles).
    auto request = [&](int i) {
        const i64 j = (i64)key_start + (i64)i * KT + tid;
        if (tid < KT && i < tiles && j < key_end && p.paged) {
            cp_async<8>(smem_address(&table_s[i % 3][tid]),
                        p.tables + key_base_s + (u32)j / block_div, false);
        }
        cp_async_commit();
    };
    // Tile i's row offsets from its requested entries (which must have landed) into shared
    // memory (threads 0..63; both warps vote on the non-key mask).
    auto publish = [&](int i) {
        if (tid < 64) {
            const i64 j = (i64)key_start + (i64)i * KT + tid;
            i64 off = -1;
            if (tid < KT && i < tiles && j < key_end) {
                off = p.paged ? paged_offset<D>(p, table_s[i % 3][tid], kv_head, (u32)j, block_div)
                              : dense_offset<D>(p, key_base_s, kv_head, j);
            }
            if (tid < KT) {
                off_s[i % 3][tid] = off;
            }
            const u32 absent = __ballot_sync(FULL, tid < KT && off < 0);
            if (lane == 0) {
                invalid_s[i % 3][warp] = absent;
            }
        }
    };
    // This thread's copies of a tile: copy k (of COPIES) is unit u of key t's row (a stored
    // row is R::UNITS units), if k is one (`copy_of` true).
    constexpr int COPIES = (KT * R::UNITS + THREADS - 1) / THREADS;
    auto copy_of = [&](int k, int& t, int& u) {
        // Where the threads divide into whole rows (UNITS a divisor of THREADS), a thread's
        // unit column is the same in every copy: its part of the address is made once.
        constexpr bool FIXED_COL = THREADS % R::UNITS == 0;
        const int c = tid + k * THREADS;
        t = FIXED_COL ? tid / R::UNITS + k * (THREADS / R::UNITS) : c / R::UNITS;
        u = FIXED_COL ? tid % R::UNITS : c % R::UNITS;
        return KT * R::UNITS % THREADS == 0 || c < KT * R::UNITS;
    };
    // Where key t's chunks are in a tile.
    auto row_at = [](int t) { return [=](int c) { return TC::chunk_at(KT, t, c); }; };
    // Tile i's keys and values into stage i % 2 (zeros for non-keys), one commit group (empty
    // past the tiles).
    auto fetch = [&](int i) {
        const u32 k_dst = base + (i % 2) * S::TILE_BYTES;
        const u32 v_dst = k_dst + 2 * S::TILE_BYTES;
        if (i < tiles) {
            // Every offset first: one shared-memory latency for the tile, not one per copy.
            i64 offs[COPIES];
#pragma unroll
            for (int k = 0; k < COPIES; ++k) {
                int t, u;
                offs[k] = copy_of(k, t, u) ? off_s[i % 3][t] : -1;
            }
#pragma unroll
            for (int k = 0; k < COPIES; ++k) {
                int t, u;
                if (!copy_of(k, t, u)) {
                    break;
                }
                const u32 at = TC::chunk_at(KT, t, R::chunk(u));
                cp_async<R::UNIT>(k_dst + at, R::source(p.key, offs[k], u), offs[k] < 0);
                cp_async<R::UNIT>(v_dst + at, R::source(p.value, offs[k], u), offs[k] < 0);
            }
        }
        cp_async_commit();
    };
    // The codes this thread copied into stage i % 2 (landed) widened into E (a loop, not
    // unrolled: its registers are few, the accumulators' many).
    auto widen = [&](int i) {
        if constexpr (R::WIDEN) {
            u8* const k_at = smem + (i % 2) * S::TILE_BYTES;
#pragma unroll 1
            for (int k = 0; k < COPIES; ++k) {
                int t, u;
                if (!copy_of(k, t, u)) {
                    break;
                }
                R::widen(k_at, row_at(t), u);
                R::widen(k_at + 2 * S::TILE_BYTES, row_at(t), u);
            }
        }
    };

    // Prologue: the sequence's fields, the padding columns of every stage (never written by
    // cp.async), the first two tiles' key lookups, the query tile (its own commit group, which
    // the loop's first wait covers), the first tile.
    if (tid == 0) {
        range_s[0] = -0x7fffffff - 1;
        range_s[1] = 0x7fffffff;
        key_base_s = seq[SEQ_KEY_BASE];
    }
    if constexpr (DP > D) {
        constexpr int PAD = (DP - D) / 8;
        for (int c = tid; c < 4 * KT * PAD; c += THREADS) {
            const int row = c / PAD, col = CH + c % PAD;
            *(U128*)(smem + row / KT * S::TILE_BYTES + TC::chunk_at(KT, row % KT, col)) =
                U128{0, 0, 0, 0};
        }
    }
    __syncthreads();
    request(0);
    request(1);
    for (int c = tid; c < S::CTA_ROWS * (DP / 8); c += THREADS) {
        const int r = c / (DP / 8), col = c % (DP / 8);
        const int ur = row_base + r;
        const bool real = ur < rows && col < CH;
        const i64 token = first_token + ur / heads, head = first_head + ur % heads;
        // Padding rows and columns: zeros, from any valid address.
        cp_async<16>(q_base + TC::chunk_at(S::CTA_ROWS, r, col),
                     query + (real ? (token * p.num_heads + head) * D + col * 8 : 0), !real);
    }
    cp_async_commit();
    cp_async_wait<1>();
    publish(0);
    publish(1);
    __syncthreads();
    fetch(0);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
            if (row_index(mt, ri) < rows && t4 == 0) {
                atomicMax(&range_s[0], lo[mt][ri]);
                atomicMin(&range_s[1], hi[mt][ri]);
            }
        }
    }
    // The tensor-core steps' state; the query fragments into registers where TC keeps them
    // there.
    TC tc(q_base, warp, lane);
    if constexpr (S::Q_REGS) {
        cp_async_wait<0>();
        __syncthreads();
        tc.load_queries();
    }

    float o[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < DT; ++n) {
            o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
        }
    }
    float m[MT][2], l[MT][2];
    u32 attended = 0;  // bit 2 mt + ri: the row attended a key
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = -f32_inf();
        l[mt][0] = l[mt][1] = 0.0f;
    }
#pragma unroll 1
    for (int i = 0; i < tiles; ++i) {
        // (A) Everyone is past tile i - 1, whose stage tile i + 1 now overwrites, and sees
        // tile i + 1's offsets (and, at i = 0, the rows' range).
        __syncthreads();
        request(i + 2);
        fetch(i + 1);
        cp_async_wait<2>();
        widen(i);
        TC::copies_landed();
        // (B) Tile i has landed (every group but the two just made), for every thread's copies
        // (and, with wgmma, for the tensor cores' reads).
        __syncthreads();
        const int j0 = key_start + i * KT;
        u32 absent[WORDS];
#pragma unroll
        for (int x = 0; x < WORDS; ++x) {
            absent[x] = invalid_s[i % 3][x];
        }
        const bool rows_full = range_s[0] <= j0 && range_s[1] - j0 >= min(KT, key_end - j0);
        const u32 k_tile = base + (i % 2) * S::TILE_BYTES;
        const u32 v_tile = k_tile + 2 * S::TILE_BYTES;

        // S = Q K^T.
        float s[MT][NT][4];
        tc.qk(s, k_tile);

        // The scores with their modifiers and, on a masked tile, -Inf where a row does not
        // attend a key.
        tile_logits<V>(p, s, j0, pos, slope, lo, hi, absent, rows_full, unscaled,
                       [&](int (&row_lo)[MT][2], int (&row_hi)[MT][2]) {
#pragma unroll
                           for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                               for (int ri = 0; ri < 2; ++ri) {
                                   row_lo[mt][ri] = lo_s[row_index(mt, ri) - row_base];
                                   row_hi[mt][ri] = hi_s[row_index(mt, ri) - row_base];
                               }
                           }
                       },
                       attended);
        // The online softmax; the accumulators rescaled unless no row of the warp changed its
        // max (every factor exactly 1).
        float alpha[MT][2];
        if (softmax_tile(s, m, l, alpha, unscaled ? p.score_scale : 1.0f)) {
            rescale_rows(o, alpha);
        }

        // A tile where some row does not attend some key: any non-finite value in it? If so
        // its P.V runs through selects (every warp is past this tile's S = Q K^T: the barrier
        // of __syncthreads_or), each row block's probabilities through the warp's scratch.
        const bool by_selects =
            !rows_full && __syncthreads_or(tile_nonfinite<E, TC, KT, CH>(
                              smem + (v_tile - base), tid, THREADS)) != 0;
        if (!by_selects) {
            tc.pv(o, s, v_tile);
        } else {
            u8* const scratch_at =
                S::Q_REGS           ? smem + 4 * S::TILE_BYTES
                : S::SCRATCH_IN_KEYS ? smem + (i % 2) * S::TILE_BYTES
                                     : smem + 4 * S::TILE_BYTES + S::Q_BYTES;
            u32* const scratch = (u32*)scratch_at + warp * 8 * KT;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                u32 a[KT / 16][4];
#pragma unroll
                for (int kk = 0; kk < KT / 16; ++kk) {
                    p_fragment<E>(a[kk], s, mt, kk);
                }
                const int r0 = row_index(mt, 0) - row_base, r1 = r0 + 8;
                const int row_lo[2] = {lo_s[r0], lo_s[r1]}, row_hi[2] = {hi_s[r0], hi_s[r1]};
                pv_by_selects<E, TC, KT>(o[mt], a, scratch, smem + (v_tile - base), j0, row_lo,
                                         row_hi, absent);
            }
        }
        // Tile i + 2's entries (every group but tile i + 1's), then its offsets: seen by tile
        // i + 1's fetch of tile i + 2 after its barrier (A).
        cp_async_wait<1>();
        publish(i + 2);
    }
    // No copy outlives the kernel (with no tiles, the query tile's).
    cp_async_wait<0>();

    int block_row[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        block_row[mt] = row_base + TC::row_block(warp, mt);
    }
    prefill_epilogue<E, V, D>(p, o, m, l, attended, block_row, rows, first_token, first_head,
                              heads);
}
