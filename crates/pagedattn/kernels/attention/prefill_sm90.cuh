// The Hopper prefill (sm_90a; bf16 and f16 activations, keys and values stored as such or as
// fp8 codes), warp-specialized as FlashAttention-3 is. A CTA of three warpgroups runs a
// unit's 128 rows:
//
// * warpgroup 0, the producer (its registers lowered to PRODUCER_REGS), looks up each tile's
//   keys (thread t: key t; its block-table entry) and gathers
//   the tile's key rows, then the previous tile's value rows, with cp.async into a ring of
//   STAGES key and STAGES value tiles (our blocks are of any size, so no TMA box describes a
//   page). An mbarrier per tile tells the consumers when every copy landed (`full`); another
//   tells the producer when both consumers are done with it (`empty`). Non-keys (past the
//   unit) are zero-filled rows, and their bits are published with the key tile.
//   fp8 codes are copied into the stage and widened into E there by the thread that copied
//   them (StageRows, paged_kv.cuh) before its arrival on `full`.
// * warpgroups 1 and 2, the consumers (registers raised to CONSUMER_REGS), own 64 rows each:
//   S = Q K^T with wgmma from shared memory, the variant's logits and masks and the online
//   softmax on the accumulators (softmax.cuh), P rounded to E in registers, O += P V with
//   wgmma (P from registers). Each iteration issues tile i's S = Q K^T together with tile
//   i - 1's P V, so that the softmax of tile i runs while the tensor cores do P V; and the two
//   consumers take turns issuing (named barriers), so that one's softmax overlaps the other's
//   multiplications.
//
// A tile where some row does not attend some key (the diagonal, a window's edge) is scanned
// for non-finite values; if it holds one, its P V runs through selects (`pv_by_selects`, in
// each consumer warp's scratch), so that 0 x NaN never reaches a row that does not attend
// that key. Keys past the unit are never read.
//
// Its shape S (Sm90Shape in src/cuda/variant.rs, generated into the program): rows are D
// elements padded with zero columns to DP, a multiple of the 64-element swizzle atom; tiles of
// KT keys; dynamic shared memory (1 KiB aligned): the query tile (Q_BYTES, 128 rows), the key
// ring, the value ring (TILE_BYTES each tile), the consumer warps' scratch (SCRATCH_BYTES
// each), a zero slab of ZERO_BYTES at ZERO_AT; BYTES in all, which the kernel checks the
// launch gave.

// Named barriers: the producer's own; each consumer warpgroup's own (+ 0 or 1); each
// consumer's turn on the tensor cores (+ 0 or 1).
enum { BAR_PRODUCER = 1, BAR_CONSUMER = 2, BAR_TURN = 4 };

template <class E, class C, class V, class S>
__device__ __forceinline__ void prefill_sm90(const Params& p) {
    constexpr int D = S::D, DP = S::DP, KT = S::KT, STAGES = S::STAGES;
    constexpr int CH = D / 8;       // 16-byte chunks of a row of E
    typedef StageRows<C, E, D> R;   // how stored rows reach the stages
    constexpr int NT = KT / 8;      // n-tiles of the scores
    constexpr int DT = DP / 8;      // n-tiles of the output
    constexpr int WORDS = KT / 32;  // of a tile's non-key mask
    constexpr int ROWS = 64;        // per consumer warpgroup
    constexpr int GROUP = 128;      // threads of a warpgroup
    constexpr int PV_N = DP % 128 == 0 ? 128 : 64;  // columns of one P V wgmma
    static_assert(S::THREADS == 3 * GROUP && S::CTA_ROWS == 2 * ROWS, "three warpgroups");
    static_assert(KT % 32 == 0 && KT <= GROUP && DP % PV_N == 0, "tile shapes");
    __shared__ i64 off_s[3][KT];              // element offset of each key's row; -1: no key
    __shared__ u32 absent_s[STAGES][WORDS];   // bit t: key t of the stage's tile is no key
    __shared__ int lo_s[2 * ROWS], hi_s[2 * ROWS];
    __shared__ int range_s[2][2];  // per consumer: the largest lo, smallest hi of its real rows
    __shared__ u64 k_full[STAGES], k_empty[STAGES], v_full[STAGES], v_empty[STAGES];

    u8* const given = dynamic_shared(S::BYTES);
    const u32 base = (smem_address(given) + S::ALIGN - 1) & ~(u32)(S::ALIGN - 1);
    u8* const smem = given + (base - smem_address(given));
    const u32 q_tile = base;
    auto k_tile = [&](int stage) { return base + S::Q_BYTES + stage * S::TILE_BYTES; };
    auto v_tile = [&](int stage) {
        return base + S::Q_BYTES + (STAGES + stage) * S::TILE_BYTES;
    };

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
    // Key positions fit in an int (below 2^31 - 1); a tile's are never formed past key_end
    // in an int (see prefill_mma.cuh).
    const int key_start = (int)unit[UNIT_KEY_START];
    const int key_end = (int)unit[UNIT_KEY_END];
    const int tid = threadIdx.x;
    // The role, the warpgroup and the tile count as values the assembler knows to be the same
    // in every lane (a lane's broadcast): a wgmma it cannot prove to run in an undiverged warp
    // is serialized.
    const int tiles = __shfl_sync(FULL, (int)(((i64)key_end - key_start + KT - 1) / KT), 0);
    const int role = __shfl_sync(FULL, tid / GROUP, 0);

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&k_full[s], GROUP);
            mbar_init(&v_full[s], GROUP);
            mbar_init(&k_empty[s], 2 * GROUP);
            mbar_init(&v_empty[s], 2 * GROUP);
        }
        range_s[0][0] = range_s[1][0] = -0x7fffffff - 1;
        range_s[0][1] = range_s[1][1] = 0x7fffffff;
    }
    // The zero slab: the values of the dummy multiplications.
    for (int c = tid; c < S::ZERO_BYTES / 16; c += S::THREADS) {
        *(U128*)(smem + S::ZERO_AT + 16 * c) = U128{0, 0, 0, 0};
    }
    // The padding columns of every key and value tile, which cp.async never writes.
    if constexpr (DP > D) {
        constexpr int PAD = (DP - D) / 8;
        for (int c = tid; c < 2 * STAGES * KT * PAD; c += S::THREADS) {
            const int row = c / PAD, col = CH + c % PAD;
            *(U128*)(smem + S::Q_BYTES + row / KT * S::TILE_BYTES +
                     swizzled_chunk(KT, row % KT, col)) = U128{0, 0, 0, 0};
        }
    }
    fence_async_shared();  // these writes, for the tensor cores' reads
    __syncthreads();

    if (role == 0) {
        // The producer.
        registers_down<S::PRODUCER_REGS>();
        const int lane = tid % 32;
        const i64 key_base = seq[SEQ_KEY_BASE];
        const u32 block_div = block_divisor(p);
        // Key `tid` of tile i: the element offset of its row, -1 if it is no key.
        auto lookup = [&](int i) -> i64 {
            const i64 j = (i64)key_start + (i64)i * KT + tid;
            if (tid >= KT || j >= key_end) {
                return -1;
            }
            return p.paged ? paged_offset<D>(p, p.tables[key_base + (u32)j / block_div],
                                             kv_head, (u32)j, block_div)
                           : dense_offset<D>(p, key_base, kv_head, j);
        };
        // A thread copies one unit column u (of UP, a stored row's units rounded up to a
        // power of two: lanes past UNITS idle) of every STRIDE-th row of a tile: its column's
        // address part is fixed, and the loop is the same for every head size.
        constexpr int UP = R::UNITS <= 4 ? 4 : R::UNITS <= 8 ? 8 : R::UNITS <= 16 ? 16 : 32;
        constexpr int STRIDE = GROUP / UP;  // rows a pass covers
        constexpr int COPIES = KT / STRIDE;
        const int u = tid % UP, first_row = tid / UP;
        // Copy k's row: where its chunks are in a tile.
        auto row_at = [&](int k) {
            const int row = first_row + k * STRIDE;
            return [=](int c) { return swizzled_chunk(KT, row, c); };
        };
        // Tile i's rows of `src` (keys or values) into the tile at `dst`, zeros for no key.
        auto gather = [&](const void* src, u32 dst, int i) {
            // Offsets read BATCH at a time: one shared-memory latency per batch, in the few
            // registers the producer keeps.
            constexpr int BATCH = 4;
            if (u >= R::UNITS) {
                return;
            }
#pragma unroll
            for (int k0 = 0; k0 < COPIES; k0 += BATCH) {
                i64 offs[BATCH];
#pragma unroll
                for (int k = k0; k < k0 + BATCH && k < COPIES; ++k) {
                    offs[k - k0] = off_s[i % 3][first_row + k * STRIDE];
                }
#pragma unroll
                for (int k = k0; k < k0 + BATCH && k < COPIES; ++k) {
                    const i64 off = offs[k - k0];
                    cp_async<R::UNIT>(dst + row_at(k)(R::chunk(u)), R::source(src, off, u),
                                      off < 0);
                }
            }
        };
        // The codes this thread copied into the tile at `dst` (landed) widened into E, then
        // made visible to the tensor cores.
        auto widen = [&](u32 dst) {
            if constexpr (R::WIDEN) {
                if (u < R::UNITS) {
#pragma unroll 1
                    for (int k = 0; k < COPIES; ++k) {
                        R::widen(smem + (dst - base), row_at(k), u);
                    }
                }
                fence_async_shared();
            }
        };
        // A tile's copies issued: the stage is full once they land (rows of E), or they form a
        // commit group that this thread widens below before its arrival (codes).
        auto publish = [&](u64* full) {
            if constexpr (R::WIDEN) {
                cp_async_commit();
            } else {
                mbar_track_copies(full);
                mbar_arrive(full);
            }
        };
        // Step i: tile i's keys, then tile i - 1's values (which the consumers need a step
        // later than its keys). off_s has three slots: a thread writes tile i's after the
        // barrier of step i - 1, which every thread passes only once done with step i - 2.
        // (Widening a step later, with the next step's copies in flight, puts the widening on
        // the consumers' path: see docs/design/cuda.md.)
#pragma unroll 1
        for (int i = 0; i <= tiles; ++i) {
            if (i < tiles) {
                const int stage = i % STAGES;
                const i64 off = lookup(i);
                mbar_wait(&k_empty[stage], ((i / STAGES) & 1) ^ 1);
                if (tid < KT) {
                    off_s[i % 3][tid] = off;
                }
                const u32 absent = __ballot_sync(FULL, tid < KT && off < 0);
                if (tid / 32 < WORDS && lane == 0) {
                    absent_s[stage][tid / 32] = absent;
                }
                bar_sync(BAR_PRODUCER, GROUP);
                gather(p.key, k_tile(stage), i);
                publish(&k_full[stage]);
            }
            if (i > 0) {
                const int stage = (i - 1) % STAGES;
                mbar_wait(&v_empty[stage], (((i - 1) / STAGES) & 1) ^ 1);
                gather(p.value, v_tile(stage), i - 1);
                publish(&v_full[stage]);
            }
            if constexpr (R::WIDEN) {
                // The keys' copies (all but the values' group, if any), then the values'.
                if (i < tiles) {
                    if (i > 0) {
                        cp_async_wait<1>();
                    } else {
                        cp_async_wait<0>();
                    }
                    widen(k_tile(i % STAGES));
                    mbar_arrive(&k_full[i % STAGES]);
                }
                if (i > 0) {
                    cp_async_wait<0>();
                    widen(v_tile((i - 1) % STAGES));
                    mbar_arrive(&v_full[(i - 1) % STAGES]);
                }
            }
        }
        cp_async_wait<0>();
        return;
    }

    // A consumer: warpgroup wg of the two, rows 64 wg + 16 w + lane / 4 (and + 8) of the CTA
    // in its warp w.
    registers_up<S::CONSUMER_REGS>();
    const int ct = tid - GROUP, wg = role - 1, wt = ct % GROUP;
    const int lane = ct % 32, g = lane / 4, t4 = lane % 4;
    const int block_row[1] = {row_base + ROWS * wg + 16 * (wt / 32)};
    int pos[1][2], lo[1][2], hi[1][2];
    float slope[1][2];
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
        const int r = block_row[0] + g + 8 * ri;
        lo[0][ri] = hi[0][ri] = pos[0][ri] = 0;
        slope[0][ri] = 0.0f;
        if (r < rows) {
            const Row row = V::row(p, seq, unit, r);
            lo[0][ri] = (int)row.lo;
            hi[0][ri] = (int)max(row.hi, row.lo);
            pos[0][ri] = (int)row.pos;
            slope[0][ri] = row.slope;
            if (t4 == 0) {
                atomicMax(&range_s[wg][0], lo[0][ri]);
                atomicMin(&range_s[wg][1], hi[0][ri]);
            }
        }
        if (t4 == 0) {
            lo_s[r - row_base] = lo[0][ri];
            hi_s[r - row_base] = hi[0][ri];
        }
    }
    // The warpgroup's query rows (zeros past the unit's rows and in the padding columns).
    for (int c = wt; c < ROWS * (DP / 8); c += GROUP) {
        const int r = ROWS * wg + c / (DP / 8), col = c % (DP / 8);
        const int ur = row_base + r;
        const bool real = ur < rows && col < CH;
        const i64 token = first_token + ur / heads, head = first_head + ur % heads;
        cp_async<16>(q_tile + swizzled_chunk(2 * ROWS, r, col),
                     query + (real ? (token * p.num_heads + head) * D + col * 8 : 0), !real);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_shared();
    bar_sync(BAR_CONSUMER + wg, GROUP);
    const int range_lo = range_s[wg][0], range_hi = range_s[wg][1];
    const bool unscaled = keeps_scale_out<V>(p);
    u32* const scratch =
        (u32*)(smem + S::Q_BYTES + 2 * STAGES * S::TILE_BYTES + (ct / 32) * S::SCRATCH_BYTES);
    const u32 zero_slab = base + S::ZERO_AT;

    float o[1][DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) {
        o[0][n][0] = o[0][n][1] = o[0][n][2] = o[0][n][3] = 0.0f;
    }
    float m[1][2] = {{-f32_inf(), -f32_inf()}}, l[1][2] = {{0.0f, 0.0f}};
    u32 attended = 0;  // bit ri: the row attended a key
    float s[1][NT][4];
    u32 pa[KT / 16][4];  // P of the previous tile, as A fragments (none yet: zeros)
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
        pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0;
    }
    // The previous tile's: its first key, its non-keys, whether every row attends all of it.
    int prev_j0 = 0;
    u32 prev_absent[WORDS];
    bool prev_full = true;

    if (wg == 0 && tiles > 0) {
        bar_arrive(BAR_TURN, 2 * GROUP);  // the first consumer's first turn
    }
    // Step i: S = Q K^T of tile i with O += P V of tile i - 1.
#pragma unroll 1
    for (int i = 0; i <= tiles; ++i) {
        const bool qk = i < tiles, pv = i > 0;
        const int ks = i % STAGES, vs = (i + STAGES - 1) % STAGES;
        u32 absent[WORDS];
        if (qk) {
            mbar_wait(&k_full[ks], (i / STAGES) & 1);
#pragma unroll
            for (int x = 0; x < WORDS; ++x) {
                absent[x] = absent_s[ks][x];
            }
        }
        if (pv) {
            mbar_wait(&v_full[vs], ((i - 1) / STAGES) & 1);
        }
        // The landed copies made visible to the tensor cores.
        fence_async_shared();
        const u8* const v_stage = smem + (v_tile(vs) - base);
        const bool selects =
            pv && !prev_full &&
            __shfl_sync(FULL,
                        bar_or(BAR_CONSUMER + wg, GROUP,
                               tile_nonfinite<E, Swizzled, KT, CH>(v_stage, wt, GROUP)),
                        0);
        if (selects) {
            // Before anything is issued: no wgmma writes O now. Its P V below is a dummy.
            const int r0 = block_row[0] - row_base + g;
            const int row_lo[2] = {lo_s[r0], lo_s[r0 + 8]}, row_hi[2] = {hi_s[r0], hi_s[r0 + 8]};
            pv_by_selects<E, Swizzled, KT>(o[0], pa, scratch, v_stage, prev_j0, row_lo, row_hi,
                                           prev_absent);
#pragma unroll
            for (int kk = 0; kk < KT / 16; ++kk) {
                pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0;
            }
        }
        if (qk) {
            bar_sync(BAR_TURN + wg, 2 * GROUP);  // this consumer's turn
        }
        // Both multiplications are issued at every step, one the step lacks as a dummy (the
        // assembler serializes a wgmma under a branch: the accumulators' values would merge
        // after it): S of the last step from the previous (landed) key tile, discarded; P V
        // of zeros (P) and the zero slab (4 KiB: 16 rows of PV_N columns). Two commit groups,
        // so that each wait retires the same one on every path.
        const bool real_pv = pv && !selects;
        const u32 k_at = k_tile(qk ? ks : vs);
        const u32 v_at = real_pv ? v_tile(vs) : zero_slab, v_atoms = real_pv ? KT * 128 : 2048;
        hold(s[0]);
        hold(o[0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk) {
            Wgmma<E>::qk(s[0],
                         wgmma_desc(q_tile + (kk / 4) * (2 * ROWS * 128) + wg * ROWS * 128 +
                                        (kk % 4) * 32,
                                    16, 1024),
                         wgmma_desc(k_at + (kk / 4) * (KT * 128) + (kk % 4) * 32, 16, 1024),
                         kk > 0);
        }
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
#pragma unroll
            for (int h = 0; h < DP / PV_N; ++h) {
                Wgmma<E>::pv(*reinterpret_cast<float(*)[PV_N / 8][4]>(&o[0][h * PV_N / 8][0]),
                             pa[kk],
                             wgmma_desc(v_at + (real_pv ? kk * 16 * 128 + h * (PV_N / 64) * v_atoms : 0),
                                        v_atoms, 1024));
            }
        }
        wgmma_commit();
        if (qk && !(wg == 1 && i == tiles - 1)) {
            // The other consumer's turn (the second consumer's last turn is given to no one:
            // the first has as many turns as it gave itself one).
            bar_arrive(BAR_TURN + 1 - wg, 2 * GROUP);
        }
        float alpha[1][2];
        bool changed = false;
        bool full = true;
        const int j0 = key_start + i * KT;
        wgmma_wait<1>();  // S = Q K^T
        hold(s[0]);
        if (qk) {
            mbar_arrive(&k_empty[ks]);
            full = range_lo <= j0 && range_hi - j0 >= min(KT, key_end - j0);
            tile_logits<V>(p, s, j0, pos, slope, lo, hi, absent, full, unscaled,
                           [&](int (&row_lo)[1][2], int (&row_hi)[1][2]) {
#pragma unroll
                               for (int ri = 0; ri < 2; ++ri) {
                                   const int r = block_row[0] - row_base + g + 8 * ri;
                                   row_lo[0][ri] = lo_s[r];
                                   row_hi[0][ri] = hi_s[r];
                               }
                           },
                           attended);
            changed = softmax_tile(s, m, l, alpha, unscaled ? p.score_scale : 1.0f);
        }
        wgmma_wait<0>();  // O += P V
        hold(o[0]);
        if (pv) {
            mbar_arrive(&v_empty[vs]);
        }
        if (qk) {
            hold(s[0]);
            if (changed) {
                rescale_rows(o, alpha);
            }
#pragma unroll
            for (int kk = 0; kk < KT / 16; ++kk) {
                p_fragment<E>(pa[kk], s, 0, kk);
            }
            prev_j0 = j0;
            prev_full = full;
#pragma unroll
            for (int x = 0; x < WORDS; ++x) {
                prev_absent[x] = absent[x];
            }
        }
    }

    prefill_epilogue<E, V, D>(p, o, m, l, attended, block_row, rows, first_token, first_head,
                              heads);
}
