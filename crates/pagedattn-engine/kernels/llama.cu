// The Llama model's kernels on the GPU, other than its matrix products (cuBLAS) and its
// attention (pagedattn's): embedding, RMSNorm, the q/k/v split with RoPE, SwiGLU, greedy
// argmax, and pick (which joins tensor-parallel ranks' argmaxes). Compiled at run time by
// NVRTC through pagedattn's kernel cache; no CUDA header is included (bf16 conversions are
// bit operations and PTX).
//
// Activations: the residual stream is f32; what feeds a matrix product or the attention is
// bf16. Every kernel computes in f32 and rounds once to nearest even.
//
// Each kernel takes one argument struct (EmbedParams, RmsNormParams, ...), generated before
// this file from src/models/gpu_llama.rs (the host's definitions).

typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ float bf16_to_f32(u16 bits) { return __uint_as_float((u32)bits << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float x) {
    u16 bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(x));
    return bits;
}

// The sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), in every thread.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // `partial` may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x / 32;
    v = lane < warps ? partial[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// x[t, :] = table[tokens[t], :] (bf16 rows into the f32 residual stream). One block per token.
extern "C" __global__ void embed(const EmbedParams args) {
    const u32* tokens = args.tokens;
    const u16* table = args.table;
    float* x = args.x;
    const int hidden = args.hidden;
    const u16* row = table + (size_t)tokens[blockIdx.x] * hidden;
    float* out = x + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = bf16_to_f32(row[i]);
}

// out[r, :] = x[rows[r], :] / rms(x[rows[r], :]) * weight, as bf16 (rows == nullptr: row r).
// One block per output row.
extern "C" __global__ void rms_norm(const RmsNormParams args) {
    const float* x = args.x;
    const u32* rows = args.rows;
    const float* weight = args.weight;
    u16* out = args.out;
    const int hidden = args.hidden;
    const float eps = args.eps;
    const int r = blockIdx.x;
    const float* in = x + (size_t)(rows ? rows[r] : r) * hidden;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) sum += in[i] * in[i];
    const float inv = rsqrtf(block_sum(sum) / hidden + eps);
    u16* o = out + (size_t)r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = f32_to_bf16(in[i] * inv * weight[i]);
}

// Splits the fused projection qkv[t] = [q (heads × D) | k (kv_heads × D) | v (kv_heads × D)]
// into q, k and v, adding the projections' biases (`bias`, f32; nullptr: none), rotating the first `rope_dim` elements of every q and k head by the
// token's position (`inv_freq` has rope_dim / 2 entries; nullptr: no rotation). `adjacent`:
// pairs (2i, 2i + 1) (GGUF's permuted rows); else (i, i + rope_dim / 2) (NeoX). A row of
// blocks per token (blockIdx.y: its part of the token's elements), so that a step of few
// tokens still spreads over the multiprocessors (one block did a token's 40 heads alone).
extern "C" __global__ void split_rope(const SplitRopeParams args) {
    const u16* qkv = args.qkv;
    u16* q = args.q;
    u16* k = args.k;
    u16* v = args.v;
    const u32* positions = args.positions;
    const float* inv_freq = args.inv_freq;
    const float* bias = args.bias;
    const int heads = args.heads, kv_heads = args.kv_heads, head_size = args.head_size;
    const int rope_dim = args.rope_dim, adjacent = args.adjacent;
    const int t = blockIdx.x;
    const int qw = heads * head_size, kw = kv_heads * head_size;
    const u16* in = qkv + (size_t)t * (qw + 2 * kw);
    const float pos = (float)positions[t];
    const int half = rope_dim / 2;
    // Rotated pairs of q and k: (heads + kv_heads) × half of them.
    const int first = blockIdx.y * blockDim.x + threadIdx.x, stride = gridDim.y * blockDim.x;
    for (int p = first; p < (heads + kv_heads) * half; p += stride) {
        const int head = p / half, i = p % half;
        const u16* src = in + head * head_size;
        u16* dst = head < heads ? q + (size_t)t * qw + head * head_size
                                : k + (size_t)t * kw + (head - heads) * head_size;
        const int a = adjacent ? 2 * i : i, b = adjacent ? 2 * i + 1 : i + half;
        const float* hb = bias ? bias + head * head_size : nullptr;
        const float x0 = bf16_to_f32(src[a]) + (hb ? hb[a] : 0.0f);
        const float x1 = bf16_to_f32(src[b]) + (hb ? hb[b] : 0.0f);
        // The angle in f32, its cosine and sine in f64 rounded once: the host's `Rope`.
        double s, c;
        sincos((double)(pos * inv_freq[i]), &s, &c);
        const float cf = (float)c, sf = (float)s;
        dst[a] = f32_to_bf16(x0 * cf - x1 * sf);
        dst[b] = f32_to_bf16(x1 * cf + x0 * sf);
    }
    // Everything not rotated: v, and each head's elements past rope_dim.
    for (int e = first; e < qw + 2 * kw; e += stride) {
        const int head = e / head_size, d = e % head_size;
        if (head < heads + kv_heads && d < rope_dim) continue;
        u16* dst = e < qw        ? q + (size_t)t * qw + e
                   : e < qw + kw ? k + (size_t)t * kw + (e - qw)
                                 : v + (size_t)t * kw + (e - qw - kw);
        *dst = bias ? f32_to_bf16(bf16_to_f32(in[e]) + bias[e]) : in[e];
    }
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, ffn + i] (the fused gate/up product's halves).
extern "C" __global__ void swiglu(const SwigluParams args) {
    const u16* gate_up = args.gate_up;
    u16* out = args.out;
    const int ffn = args.ffn, tokens = args.tokens;
    const size_t n = (size_t)ffn * tokens;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        const size_t t = e / ffn, i = e % ffn;
        const float g = bf16_to_f32(gate_up[t * 2 * ffn + i]);
        const float u = bf16_to_f32(gate_up[t * 2 * ffn + ffn + i]);
        out[e] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
    }
}

// Whether (va, a) ranks before (vb, b) in greedy argmax's order, that of the host's
// `ops::argmax` and `torch.argmax`: NaN above everything, then larger values, then lower
// indices; index NONE (no element) last.
#define NONE 0xffffffffu
__device__ __forceinline__ bool ranks_before(float va, u32 a, float vb, u32 b) {
    if (a == NONE || b == NONE) return b == NONE && a != NONE;
    const bool na = va != va, nb = vb != vb;
    if (na || nb) return na && (!nb || a < b);
    return va > vb || (va == vb && a < b);
}

// The winner of (v, at) over the warp, in every lane.
__device__ __forceinline__ void warp_best(float& v, u32& at) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const u32 oa = __shfl_xor_sync(0xffffffffu, at, o);
        if (ranks_before(ov, oa, v, at)) { v = ov; at = oa; }
    }
}

// The greedy token of a row: 0 for an empty row; 0xffffffff, the host's NON_FINITE_TOKEN,
// where the winner is a NaN or an infinity (a NaN ranks first and +inf above every finite
// logit, so the row is not finite).
__device__ __forceinline__ u32 greedy_token(float v, u32 at) {
    // (A NaN fails the comparison too.)
    const bool finite = fabsf(v) <= 3.40282347e38f;
    return at == NONE ? 0 : finite ? at : 0xffffffffu;
}

// A row's winner packed for the ranks' all-gather: its index above, its value's bits below.
__device__ __forceinline__ unsigned long long pack(float v, u32 at) {
    return ((unsigned long long)at << 32) | __float_as_uint(v);
}

// best[r] = the greedy token of logits[r, :width] (rows `stride` apart), or, where
// `candidates` is given, candidates[r] = the row's winner (value, offset + index) packed, for
// `pick` to compare with the other ranks' (a tensor-parallel rank's slice of the
// vocabulary). One block per row; each thread loads 8 elements before comparing them (the
// order is total: any order of visits gives the same winner), so that a row costs a few
// memory round trips, not one an element.
extern "C" __global__ void argmax(const ArgmaxParams args) {
    const float* logits = args.logits;
    u32* best = args.best;
    const int width = args.width;
    const float* row = logits + (size_t)blockIdx.x * args.stride;
    float v = 0.0f;
    u32 at = NONE;
    for (u32 base = threadIdx.x; base < (u32)width; base += 8 * blockDim.x) {
        float got[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 i = base + j * blockDim.x;
            got[j] = i < (u32)width ? row[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 i = base + j * blockDim.x;
            if (i < (u32)width && ranks_before(got[j], i, v, at)) { v = got[j]; at = i; }
        }
    }
    warp_best(v, at);
    __shared__ float vs[32];
    __shared__ u32 ats[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { vs[warp] = v; ats[warp] = at; }
    __syncthreads();
    if (warp == 0) {
        const bool mine = lane < (int)(blockDim.x / 32);
        v = mine ? vs[lane] : 0.0f;
        at = mine ? ats[lane] : NONE;
        warp_best(v, at);
        if (lane == 0) {
            if (args.candidates)
                args.candidates[blockIdx.x] = pack(v, at == NONE ? NONE : at + (u32)args.offset);
            else
                best[blockIdx.x] = greedy_token(v, at);
        }
    }
}

// best[r] = the greedy token of the winners candidates[k * rows + r] of the `ranks` slices
// of row r (what `argmax` packed on each rank, gathered): the order is total, so the winner
// of the winners is the row's. One thread per row.
extern "C" __global__ void pick(const PickParams args) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= args.rows) return;
    float v = 0.0f;
    u32 at = NONE;
    for (int k = 0; k < args.ranks; ++k) {
        const unsigned long long c = args.candidates[(size_t)k * args.rows + r];
        const float cv = __uint_as_float((u32)c);
        const u32 ca = (u32)(c >> 32);
        if (ranks_before(cv, ca, v, at)) { v = cv; at = ca; }
    }
    args.best[r] = greedy_token(v, at);
}
