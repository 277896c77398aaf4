// The GPU model's work between two layers' attention calls in a decode step of at most
// LAYER_TOKENS tokens, as one persistent kernel instead of eight (o product and residual,
// RMSNorm, gate/up product, SwiGLU, down product and residual, the next layer's RMSNorm, its
// q/k/v product, the split with RoPE). At these sizes each of those kernels costs its launch
// and a few memory round trips (3-4 us, session 36's trace), far more than its bytes; here the
// phases meet at grid-wide barriers instead (about 1 us each).
//
// Launched cooperatively (every CTA resident at once, one per multiprocessor) after the host
// zeroes `barrier`. Each phase is a matrix-vector product over the step's t rows: a warp takes
// an output row (or a RoPE pair of rows), its lanes 16-byte pieces of the weight row, against
// the inputs staged in shared memory as bf16; the warp's sums reduce by shuffles. The results
// are rounded where the separate kernels round them (cuBLAS writes q/k/v and gate/up as bf16;
// o and down add to the f32 residual stream), so the numbers are those of the kernels it
// replaces up to the order of the f32 sums. Compiled after llama.cu (bf16 helpers).
//
// Its argument, LayerParams, is generated before these files from src/models/gpu_llama.rs.

#define LAYER_TOKENS 8
#define LAYER_THREADS 256
#define LAYER_WARPS (LAYER_THREADS / 32)

// A load that bypasses L1: the rows other CTAs of this kernel wrote before a barrier. Every
// read of the residual stream goes this way, so that no SM's L1 holds a stale line of it.
__device__ __forceinline__ float load_shared_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ u16 load_shared_u16(const u16* p) {
    u16 v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// Every CTA arrives, then waits for all of them; `target` counts arrivals expected so far.
__device__ __forceinline__ void grid_sync(unsigned* counter, unsigned& target) {
    target += gridDim.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter));
        } while (seen < target);
        __threadfence();
    }
    __syncthreads();
}

// The most 16-byte pieces of a weight row a lane holds: rows of up to 3,072 elements (the
// widest input the staging takes, gpu_llama.rs's LAYER_STAGING_BYTES).
#define LAYER_PIECES 12

// A weight row's 16 bytes through the read-only path (weights never change in a kernel).
__device__ __forceinline__ uint4 load_weights(const u16* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// acc[r][t] = sum over e < k of in[t][e] * w[r][e] for each of the R weight rows and each
// t < tokens, in every lane: `in` is bf16 rows of `k` in shared memory (k a multiple of 8, at
// most 8 LAYER_PIECES x 32), w[r] bf16 weight rows in global memory. Every lane issues all
// its pieces of the R rows before it uses any, so that their memory round trips overlap
// (one at a time, a row of 1,536 would cost six in a row).
template <int R>
__device__ __forceinline__ void dot_rows(const u16* in, int k, int tokens, const u16* const (&w)[R],
                                         float (&acc)[R][LAYER_TOKENS]) {
    const int lane = threadIdx.x % 32;
    const int pieces = k / 8;
    uint4 held[R][LAYER_PIECES];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int i = 0; i < LAYER_PIECES; ++i) {
            const int c = lane + 32 * i;
            held[r][i] = c < pieces ? load_weights(w[r] + 8 * c) : make_uint4(0, 0, 0, 0);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < LAYER_TOKENS; ++t) acc[r][t] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < LAYER_PIECES; ++i) {
        const int c = lane + 32 * i;
        if (c >= pieces) break;
#pragma unroll
        for (int t = 0; t < LAYER_TOKENS; ++t) {
            if (t < tokens) {
                const uint4 xp = *(const uint4*)(in + (size_t)t * k + 8 * c);
                const u32 xs[4] = {xp.x, xp.y, xp.z, xp.w};
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const u32 ws[4] = {held[r][i].x, held[r][i].y, held[r][i].z, held[r][i].w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        acc[r][t] = fmaf(__uint_as_float(xs[e] << 16),
                                         __uint_as_float(ws[e] << 16), acc[r][t]);
                        acc[r][t] = fmaf(__uint_as_float(xs[e] & 0xffff0000u),
                                         __uint_as_float(ws[e] & 0xffff0000u), acc[r][t]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < LAYER_TOKENS; ++t) {
            for (int o = 16; o > 0; o >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], o);
        }
    }
}

// acc[t] of lane t (t < LAYER_TOKENS), with constant register indices.
__device__ __forceinline__ float token_value(const float (&acc)[LAYER_TOKENS]) {
    const int lane = threadIdx.x % 32;
    float v = acc[0];
#pragma unroll
    for (int t = 1; t < LAYER_TOKENS; ++t) v = lane == t ? acc[t] : v;
    return v;
}

// Stages RMSNorm(x[t]) * weight, rounded to bf16, for t < tokens into `out` ([tokens][hidden]
// in shared memory): warp t normalizes row t (tokens <= LAYER_WARPS), reading the residual
// stream past L1 (other CTAs wrote it).
__device__ __forceinline__ void stage_norm(const float* x, const float* weight, int hidden,
                                           float eps, int tokens, u16* out) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp < tokens) {
        const float* row = x + (size_t)warp * hidden;
        float sum = 0.0f;
        for (int i = lane; i < hidden; i += 32) {
            const float v = load_shared_f32(row + i);
            sum += v * v;
        }
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        const float inv = rsqrtf(sum / hidden + eps);
        for (int i = lane; i < hidden; i += 32) {
            out[(size_t)warp * hidden + i] = f32_to_bf16(load_shared_f32(row + i) * inv * weight[i]);
        }
    }
    __syncthreads();
}

// Copies `n` bf16 values from global memory (written by other CTAs: past L1) to shared.
__device__ __forceinline__ void stage_copy(const u16* from, int n, u16* to) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) to[i] = load_shared_u16(from + i);
    __syncthreads();
}

// x[t] += in[t] w^T for t < tokens: the residual stream's `hidden` rows of w (each `k` wide)
// over the grid's warps, `in` staged in shared memory (o or SwiGLU's output).
__device__ __forceinline__ void add_product(float* x, int hidden, const u16* w, int k,
                                            int tokens, const u16* in) {
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * LAYER_WARPS;
    for (int r = blockIdx.x * LAYER_WARPS + threadIdx.x / 32; r < hidden; r += warps) {
        float acc[1][LAYER_TOKENS];
        const u16* const row[1] = {w + (size_t)r * k};
        dot_rows<1>(in, k, tokens, row, acc);
        const float sum = token_value(acc[0]);
        if (lane < tokens) {
            float* at = x + (size_t)lane * hidden + r;
            *at = load_shared_f32(at) + sum;
        }
    }
}

extern "C" __global__ void __launch_bounds__(LAYER_THREADS) between_layers(const LayerParams args) {
    extern __shared__ __align__(16) u16 staged[];  // [tokens][widest input] bf16
    const int tokens = args.tokens, hidden = args.hidden, ffn = args.ffn;
    const int heads = args.heads, kv_heads = args.kv_heads, head_size = args.head_size;
    const int qw = heads * head_size, kw = kv_heads * head_size;
    const int lane = threadIdx.x % 32;
    const int warp_id = blockIdx.x * LAYER_WARPS + threadIdx.x / 32;
    const int warps = gridDim.x * LAYER_WARPS;
    float* x = args.x;
    unsigned target = 0;

    // 1. x += o wo^T (o: the attention's output, written before this kernel).
    for (int i = threadIdx.x; i < tokens * qw; i += blockDim.x) staged[i] = args.o[i];
    __syncthreads();
    add_product(x, hidden, args.wo, qw, tokens, staged);
    grid_sync(args.barrier, target);

    // 2. act = SwiGLU(RMSNorm(x) gate_up^T): a warp computes gate row j and up row ffn + j.
    stage_norm(x, args.ffn_norm, hidden, args.eps, tokens, staged);
    for (int j = warp_id; j < ffn; j += warps) {
        float both[2][LAYER_TOKENS];
        const u16* const rows[2] = {args.gate_up + (size_t)j * hidden,
                                    args.gate_up + (size_t)(ffn + j) * hidden};
        dot_rows<2>(staged, hidden, tokens, rows, both);
        // As cuBLAS's bf16 output, then `swiglu`.
        const float g = bf16_to_f32(f32_to_bf16(token_value(both[0])));
        const float u = bf16_to_f32(f32_to_bf16(token_value(both[1])));
        if (lane < tokens) args.act[(size_t)lane * ffn + j] = f32_to_bf16(swiglu_of(g, u));
    }
    grid_sync(args.barrier, target);

    // 3. x += act down^T.
    stage_copy(args.act, tokens * ffn, staged);
    add_product(x, hidden, args.down, ffn, tokens, staged);
    if (!args.qkv) return;  // the last layer: the host's final norm follows
    grid_sync(args.barrier, target);

    // 4. The next layer's q, k, v = split(RMSNorm(x) qkv^T + bias), q and k rotated: a warp
    // takes a rotated pair of rows, or one row that does not rotate.
    stage_norm(x, args.attn_norm, hidden, args.eps, tokens, staged);
    const int half = args.rope_dim / 2, adjacent = args.adjacent;
    const int pairs = (heads + kv_heads) * half;
    for (int task = warp_id; task < pairs + qw + 2 * kw; task += warps) {
        int a, b, head;
        if (task < pairs) {
            head = task / half;
            const int i = task % half;
            a = head * head_size + (adjacent ? 2 * i : i);
            b = head * head_size + (adjacent ? 2 * i + 1 : i + half);
        } else {
            a = task - pairs;
            head = a / head_size;
            if (head < heads + kv_heads && a % head_size < args.rope_dim) continue;  // rotated
            b = -1;
        }
        float va, vb = 0.0f;
        if (b >= 0) {
            float both[2][LAYER_TOKENS];
            const u16* const rows[2] = {args.qkv + (size_t)a * hidden, args.qkv + (size_t)b * hidden};
            dot_rows<2>(staged, hidden, tokens, rows, both);
            va = token_value(both[0]);
            vb = token_value(both[1]);
        } else {
            float one[1][LAYER_TOKENS];
            const u16* const row[1] = {args.qkv + (size_t)a * hidden};
            dot_rows<1>(staged, hidden, tokens, row, one);
            va = token_value(one[0]);
        }
        if (lane >= tokens) continue;
        // As cuBLAS's bf16 output, then `split_rope`.
        const float* bias = args.bias;
        const float xa = bf16_to_f32(f32_to_bf16(va)) + (bias ? bias[a] : 0.0f);
        u16* out;
        int at;
        if (a < qw) {
            out = args.q + (size_t)lane * qw;
            at = 0;
        } else if (a < qw + kw) {
            out = args.k + (size_t)lane * kw;
            at = qw;
        } else {
            out = args.v + (size_t)lane * kw;
            at = qw + kw;
        }
        if (b < 0) {
            out[a - at] = f32_to_bf16(xa);
            continue;
        }
        const float xb = bf16_to_f32(f32_to_bf16(vb)) + (bias ? bias[b] : 0.0f);
        const int i = adjacent ? (a % head_size) / 2 : a % head_size;
        rotate_pair(xa, xb, (float)args.positions[lane], args.inv_freq[i], &out[a - at],
                    &out[b - at]);
    }
}
