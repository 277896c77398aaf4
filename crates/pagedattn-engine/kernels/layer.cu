// The GPU model's work between two layers' attention calls in a decode step of at most
// LAYER_TOKENS tokens, as one persistent kernel instead of eight (o product and residual,
// RMSNorm, gate/up product, SwiGLU, down product and residual, the next layer's RMSNorm, its
// q/k/v product, the split with RoPE). At these sizes each of those kernels costs its launch
// and a few memory round trips (3-4 us, session 36's trace), far more than its bytes; here the
// phases meet at grid-wide barriers instead.
//
// Launched cooperatively (every CTA resident at once, one per multiprocessor); the counter
// of its barriers is 0 at each launch (the kernel leaves it so). Each phase is a
// matrix-vector product over the step's t rows: a warp takes an output row (or a RoPE pair of
// rows), its lanes 16-byte pieces of the weight row, against the inputs staged in shared
// memory as bf16; the warp's sums reduce by shuffles. The results are rounded where the
// separate kernels round them (cuBLAS writes q/k/v and gate/up as bf16; o and down add to
// the f32 residual stream), so the numbers are those of the kernels it replaces up to the
// order of the f32 sums. Compiled after llama.cu (bf16 helpers).
//
// What the time goes to is the chain of memory round trips, not bytes (a layer of SmolLM2 is
// 7 MB, 1.5 us of DRAM): so every phase's weights are asked of L2 at the start, each warp's
// first rows of a phase are in its registers before it waits at the barrier before that
// phase, and the norm reads the residual stream once.
//
// Its argument, LayerParams, is generated before these files from src/models/gpu_llama.rs.

#define LAYER_TOKENS 8
#define LAYER_THREADS 256
#define LAYER_WARPS (LAYER_THREADS / 32)

// Every CTA arrives, then waits for all of them; `target` counts arrivals expected so far.
// The arrival is a release and the wait an acquire at GPU scope (the CTA's barriers around
// them carry the order to its other threads): what a CTA wrote before the barrier is visible
// to every CTA after it. Rows other CTAs wrote are read past L1 (`__ldcg`), so that no SM's
// L1 holds a stale line of them.
__device__ __forceinline__ void grid_sync(unsigned* counter, unsigned& target) {
    target += gridDim.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" : : "l"(counter) : "memory");
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        } while (seen < target);
    }
    __syncthreads();
}

// Leaves the counter at 0 for the next launch: every CTA arrives once more after its last
// barrier, and the last to arrive (every other CTA has left its last wait) zeroes it. Saves
// the launch a memset of its own.
__device__ __forceinline__ void grid_release(unsigned* counter, unsigned target) {
    if (threadIdx.x == 0 && atomicAdd(counter, 1u) == target + gridDim.x - 1) atomicExch(counter, 0u);
}

// Asks L2 for `rows` weight rows of `k` bf16 each, spread over the grid's warps: each
// phase's weights are requested at the kernel's start, so that their DRAM round trips overlap
// the phases before them instead of following a barrier.
__device__ __forceinline__ void prefetch_rows(const u16* w, int rows, int k) {
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * LAYER_WARPS;
    const int lines = (k * 2 + 127) / 128;
    for (int r = blockIdx.x * LAYER_WARPS + threadIdx.x / 32; r < rows; r += warps) {
        const char* row = (const char*)(w + (size_t)r * k);
        for (int i = lane; i < lines; i += 32) asm volatile("prefetch.global.L2 [%0];" : : "l"(row + 128 * i));
    }
}

// The most 16-byte pieces of a weight row a lane holds: rows of up to 2,048 elements where a
// warp holds two rows (gate/up, q/k/v: the hidden size), of up to 3,072 where it holds one (o,
// down: the widest input the staging takes). gpu_llama.rs's layer_staging checks both.
#define HIDDEN_PIECES 8
#define WIDE_PIECES 12

// A weight row's 16 bytes through the read-only path (weights never change in a kernel).
__device__ __forceinline__ uint4 load_weights(const u16* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// A lane's pieces of R weight rows of `k` bf16 (k a multiple of 8, at most 8 P x 32): lane l holds pieces l, l + 32, ... Every piece is asked for before any is used, so
// that their memory round trips overlap (one at a time, a row of 1,536 would cost six in a
// row).
template <int R, int P>
struct Pieces {
    uint4 v[R][P];

    __device__ __forceinline__ void load(const u16* const (&w)[R], int k) {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int i = 0; i < P; ++i) {
                const int c = lane + 32 * i;
                v[r][i] = 8 * c < k ? load_weights(w[r] + 8 * c) : make_uint4(0, 0, 0, 0);
            }
        }
    }

    // Lane t's mine[r] = sum over e < k of in[t][e] * w[r][e] for each t < tokens (other
    // lanes: 0), `in` bf16 rows of `k` in shared memory. The tokens go by one at a time in a
    // loop that is not unrolled, so that the kernel's code stays small: unrolled over 8
    // tokens it was 22,700 instructions, and warps waited for the instruction cache more than
    // for memory (ncu on an H200).
    __device__ __forceinline__ void dot(const u16* in, int k, int tokens, float (&mine)[R]) const {
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int r = 0; r < R; ++r) mine[r] = 0.0f;
#pragma unroll 1
        for (int t = 0; t < tokens; ++t) {
            // Two sums a row (the low and the high bf16 of each pair): half the dependent chain.
            float acc[R][2];
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = 0.0f;
#pragma unroll
            for (int i = 0; i < P; ++i) {
                const int c = lane + 32 * i;
                if (8 * c >= k) break;
                const uint4 xp = *(const uint4*)(in + (size_t)t * k + 8 * c);
                const u32 xs[4] = {xp.x, xp.y, xp.z, xp.w};
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const u32 ws[4] = {v[r][i].x, v[r][i].y, v[r][i].z, v[r][i].w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        acc[r][0] = fmaf(__uint_as_float(xs[e] << 16), __uint_as_float(ws[e] << 16), acc[r][0]);
                        acc[r][1] = fmaf(__uint_as_float(xs[e] & 0xffff0000u),
                                         __uint_as_float(ws[e] & 0xffff0000u), acc[r][1]);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float sum = acc[r][0] + acc[r][1];
                for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
                mine[r] = lane == t ? sum : mine[r];
            }
        }
    }
};

// Stages RMSNorm(x[t]) * weight, rounded to bf16, for t < tokens into `out` ([tokens][hidden]
// in shared memory). The whole CTA reads the residual stream (past L1: other CTAs wrote it),
// a thread the same four columns of every token at once, and keeps its first four columns of
// each token in registers for the scaling: one round trip where hidden <= 4 x LAYER_THREADS.
// The sums of squares are reduced in a fixed order, so that every CTA and every run rounds
// alike.
__device__ __forceinline__ void stage_norm(const float* x, const float* weight, int hidden, float eps,
                                        int tokens, u16* out) {
    __shared__ float partial[LAYER_WARPS][LAYER_TOKENS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int quads = hidden / 4;  // hidden is a multiple of 8
    const float4* x4 = (const float4*)x;
    float squares[LAYER_TOKENS];
    float4 first[LAYER_TOKENS];
#pragma unroll
    for (int t = 0; t < LAYER_TOKENS; ++t) squares[t] = 0.0f;
    for (int c = threadIdx.x; c < quads; c += blockDim.x) {
        float4 v[LAYER_TOKENS];
#pragma unroll
        for (int t = 0; t < LAYER_TOKENS; ++t) {
            if (t < tokens) v[t] = __ldcg(x4 + (size_t)t * quads + c);
        }
#pragma unroll
        for (int t = 0; t < LAYER_TOKENS; ++t) {
            if (t < tokens) {
                squares[t] += v[t].x * v[t].x + v[t].y * v[t].y + v[t].z * v[t].z + v[t].w * v[t].w;
                if (c == threadIdx.x) first[t] = v[t];
            }
        }
    }
#pragma unroll
    for (int t = 0; t < LAYER_TOKENS; ++t) {
        for (int o = 16; o > 0; o >>= 1) squares[t] += __shfl_xor_sync(0xffffffffu, squares[t], o);
    }
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < LAYER_TOKENS; ++t) partial[warp][t] = squares[t];
    }
    __syncthreads();
    float inv[LAYER_TOKENS];
#pragma unroll
    for (int t = 0; t < LAYER_TOKENS; ++t) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < LAYER_WARPS; ++w) sum += partial[w][t];
        inv[t] = rsqrtf(sum / hidden + eps);
    }
    for (int c = threadIdx.x; c < quads; c += blockDim.x) {
        const float4 g = *(const float4*)(weight + 4 * c);
#pragma unroll
        for (int t = 0; t < LAYER_TOKENS; ++t) {
            if (t < tokens) {
                const float4 v = c == threadIdx.x ? first[t] : __ldcg(x4 + (size_t)t * quads + c);
                u16* at = out + (size_t)t * hidden + 4 * c;
                at[0] = f32_to_bf16(v.x * inv[t] * g.x);
                at[1] = f32_to_bf16(v.y * inv[t] * g.y);
                at[2] = f32_to_bf16(v.z * inv[t] * g.z);
                at[3] = f32_to_bf16(v.w * inv[t] * g.w);
            }
        }
    }
    __syncthreads();
}

// Copies `n` bf16 values (a multiple of 8) from global memory to shared, 16 bytes a thread
// at a time, past L1 (other CTAs may have written them).
__device__ __forceinline__ void stage_copy(const u16* from, int n, u16* to) {
#pragma unroll 4
    for (int i = threadIdx.x; i < n / 8; i += blockDim.x) ((uint4*)to)[i] = __ldcg((const uint4*)from + i);
    __syncthreads();
}

// x[t] += in[t] w^T for t < tokens: the residual stream's `hidden` rows of w (each `k` wide)
// over the grid's warps, `in` staged in shared memory (o or SwiGLU's output); `held` already
// holds the warp's first row (the grid's warp index `first`).
__device__ __forceinline__ void add_product(float* x, int hidden, const u16* w, int k, int tokens,
                                            const u16* in, int first, Pieces<1, WIDE_PIECES>& held) {
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * LAYER_WARPS;
    for (int r = first; r < hidden; r += warps) {
        if (r != first) held.load({w + (size_t)r * k}, k);
        float sum[1];
        held.dot(in, k, tokens, sum);
        if (lane < tokens) {
            float* at = x + (size_t)lane * hidden + r;
            *at = __ldcg(at) + sum[0];
        }
    }
}

// The rows of the q/k/v product that q/k/v task `task` computes (of `tasks`): a rotated pair
// (a, b), or a row that does not rotate (a q or k head's columns past rope_dim, then v's),
// given as (a, a).
__device__ __forceinline__ void qkv_rows(const LayerParams& args, int task, int& a, int& b) {
    const int half = args.rope_dim / 2, head_size = args.head_size;
    const int pairs = (args.heads + args.kv_heads) * half;
    const int unrotated = head_size - args.rope_dim;  // columns of a q or k head
    if (task < pairs) {
        const int head = task / half, i = task % half;
        a = head * head_size + (args.adjacent ? 2 * i : i);
        b = head * head_size + (args.adjacent ? 2 * i + 1 : i + half);
    } else if (task - pairs < (args.heads + args.kv_heads) * unrotated) {
        const int u = task - pairs;
        a = b = (u / unrotated) * head_size + args.rope_dim + u % unrotated;
    } else {
        a = b = (args.heads + args.kv_heads) * head_size + (task - pairs - (args.heads + args.kv_heads) * unrotated);
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
    const int qkv_tasks = (heads + kv_heads) * (args.rope_dim / 2) +
                          (heads + kv_heads) * (head_size - args.rope_dim) + kw;
    float* x = args.x;
    unsigned target = 0;

    // 1. x += o wo^T (o: the attention's output, written before this kernel).
    Pieces<1, WIDE_PIECES> row;
    if (warp_id < hidden) row.load({args.wo + (size_t)warp_id * qw}, qw);
    // The later phases' weights, on their way to L2 while phase 1 runs.
    prefetch_rows(args.gate_up, 2 * ffn, hidden);
    prefetch_rows(args.down, hidden, ffn);
    if (args.qkv) prefetch_rows(args.qkv, qw + 2 * kw, hidden);
    stage_copy(args.o, tokens * qw, staged);
    add_product(x, hidden, args.wo, qw, tokens, staged, warp_id, row);

    // 2. act = SwiGLU(RMSNorm(x) gate_up^T): a warp computes gate row j and up row ffn + j.
    Pieces<2, HIDDEN_PIECES> rows;
    if (warp_id < ffn) rows.load({args.gate_up + (size_t)warp_id * hidden, args.gate_up + (size_t)(ffn + warp_id) * hidden}, hidden);
    grid_sync(args.barrier, target);
    stage_norm(x, args.ffn_norm, hidden, args.eps, tokens, staged);
    for (int j = warp_id; j < ffn; j += warps) {
        if (j != warp_id) rows.load({args.gate_up + (size_t)j * hidden, args.gate_up + (size_t)(ffn + j) * hidden}, hidden);
        float both[2];
        rows.dot(staged, hidden, tokens, both);
        // As cuBLAS's bf16 output, then `swiglu`.
        const float g = bf16_to_f32(f32_to_bf16(both[0]));
        const float u = bf16_to_f32(f32_to_bf16(both[1]));
        if (lane < tokens) args.act[(size_t)lane * ffn + j] = f32_to_bf16(swiglu_of(g, u));
    }

    // 3. x += act down^T.
    if (warp_id < hidden) row.load({args.down + (size_t)warp_id * ffn}, ffn);
    grid_sync(args.barrier, target);
    stage_copy(args.act, tokens * ffn, staged);
    add_product(x, hidden, args.down, ffn, tokens, staged, warp_id, row);
    if (!args.qkv) {  // the last layer: the host's final norm follows
        grid_release(args.barrier, target);
        return;
    }

    // 4. The next layer's q, k, v = split(RMSNorm(x) qkv^T + bias), q and k rotated: a warp
    // takes a task of qkv_rows.
    int a, b;
    if (warp_id < qkv_tasks) {
        qkv_rows(args, warp_id, a, b);
        rows.load({args.qkv + (size_t)a * hidden, args.qkv + (size_t)b * hidden}, hidden);
    }
    grid_sync(args.barrier, target);
    grid_release(args.barrier, target);  // no barrier follows
    // The next kernel of this kind starts with the next layer's o product.
    if (args.wo_next) prefetch_rows(args.wo_next, hidden, qw);
    stage_norm(x, args.attn_norm, hidden, args.eps, tokens, staged);
    for (int task = warp_id; task < qkv_tasks; task += warps) {
        if (task != warp_id) {
            qkv_rows(args, task, a, b);
            rows.load({args.qkv + (size_t)a * hidden, args.qkv + (size_t)b * hidden}, hidden);
        }
        float both[2];
        rows.dot(staged, hidden, tokens, both);
        if (lane >= tokens) continue;
        // As cuBLAS's bf16 output, then `split_rope`.
        const float* bias = args.bias;
        const float xa = bf16_to_f32(f32_to_bf16(both[0])) + (bias ? bias[a] : 0.0f);
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
        if (a == b) {
            out[a - at] = f32_to_bf16(xa);
            continue;
        }
        const float xb = bf16_to_f32(f32_to_bf16(both[1])) + (bias ? bias[b] : 0.0f);
        const int i = args.adjacent ? (a % head_size) / 2 : a % head_size;
        rotate_pair(xa, xb, (float)args.positions[lane], args.inv_freq[i], &out[a - at],
                    &out[b - at]);
    }
}
