// Every layer of the GPT besides its matrix products (cuBLAS) and its attention (steps 03
// and 04): the embeddings, LayerNorm, GELU, the re-layout of q, k and v, the cross-entropy,
// the column sums that give bias and LayerNorm gradients, the gradients' global norm and
// AdamW. Each kernel is the GPU twin of a function of src/layers.rs, src/model.rs or
// src/optim.rs, and the model-level test (tests/gpu.rs) checks them all against those.
//
// Precision: bf16 values are raw 16-bit patterns (u16), widened to f32 by a shift and
// rounded back to nearest-even by one PTX instruction, so no CUDA header is needed.
// Everything is computed in f32; sums that decide the loss and the gradients' norm in f64.
// Reductions over rows are split into a fixed grid of partial sums and a second pass over
// them, never atomics, so a step gives the same bits on every run. The column sums that
// give the biases' gradients ride along in the kernels that already read the gradient in
// question (the LayerNorm backward, the GELU backward, the re-layout of dq, dk and dv), so
// no pass reads a gradient only to sum it.

typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned int u32;

__device__ __forceinline__ float bf(u16 x) { return __uint_as_float((u32)x << 16); }

__device__ __forceinline__ u16 to_bf(float x) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
    return h;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffff, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    return x;
}

// The index of this thread in a one-dimensional grid, in 64 bits.
__device__ __forceinline__ long long global_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

// ANCHOR: embed_forward
// x[b·T + t] = wte[token] + wpe[t]: the residual stream's start, in f32 (model.rs's
// forward).
extern "C" __global__ void embed_forward(
    const u8* __restrict__ tokens,  // [B·T] input bytes
    const float* __restrict__ wte,  // [V, C] token embedding (f32 master weights)
    const float* __restrict__ wpe,  // [context, C] position embedding
    float* __restrict__ x,          // [B·T, C] out
    int T,                          // tokens per sequence
    int C,                          // width of the residual stream
    long long total                 // B·T·C
) {
    long long i = global_index();
    if (i >= total) return;
    long long row = i / C;
    int c = (int)(i % C);
    int t = (int)(row % T);
    x[i] = wte[(long long)tokens[row] * C + c] + wpe[(long long)t * C + c];
}
// ANCHOR_END: embed_forward

// dwpe[t] = Σ_b dx[b·T + t] for t < T, 0 for the positions this run does not reach; in the
// order of b, as the CPU model adds them. Overwrites dwpe.
extern "C" __global__ void embed_backward_pos(
    const float* __restrict__ dx,  // [B·T, C] gradient of the residual stream's start
    float* __restrict__ dwpe,      // [context, C] out
    int B, int T, int C,
    long long total                // context·C
) {
    long long i = global_index();
    if (i >= total) return;
    int t = (int)(i / C), c = (int)(i % C);
    float s = 0.f;
    if (t < T)
        for (int b = 0; b < B; ++b) s += dx[((long long)b * T + t) * C + c];
    dwpe[i] = s;
}

// dwte[v] += Σ dx[row] over the rows whose input token is v. `order` lists the rows sorted
// by token (the host sorts them with the batch), `offsets[v]..offsets[v+1]` are token v's.
// A block per (32 columns, token): its 8 warps take every 8th row, then add their sums in a
// fixed order. Adds: the output layer's product has written its share of the tied weights'
// gradient first.
extern "C" __global__ void embed_backward_tok(
    const float* __restrict__ dx,       // [B·T, C]
    const int* __restrict__ order,      // [B·T] row numbers, sorted by their token
    const int* __restrict__ offsets,    // [V + 1] where each token's rows start in `order`
    float* __restrict__ dwte,           // [V, C] added into
    int C
) {
    __shared__ float part[8][32];
    const int v = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int c = blockIdx.x * 32 + lane;
    float s = 0.f;
    if (c < C)
        for (int j = offsets[v] + warp; j < offsets[v + 1]; j += 8)
            s += dx[(long long)order[j] * C + c];
    part[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && c < C) {
        float total = 0.f;
        for (int w = 0; w < 8; ++w) total += part[w][lane];
        dwte[(long long)v * C + c] += total;
    }
}

// Four floats at a time (C is a multiple of 8, rows start 16-byte aligned).
__device__ __forceinline__ float4 ld4(const float* p, int j) {
    return reinterpret_cast<const float4*>(p)[j];
}
__device__ __forceinline__ void st4(float* p, int j, float4 v) {
    reinterpret_cast<float4*>(p)[j] = v;
}
__device__ __forceinline__ void add4(float* p, int j, const float* a) {
    float4 v = reinterpret_cast<float4*>(p)[j];
    reinterpret_cast<float4*>(p)[j] =
        make_float4(v.x + a[0], v.y + a[1], v.z + a[2], v.w + a[3]);
}

// LayerNorm's arithmetic on 4 values of a row (a lane's chunk), shared by the kernels that
// read the row once per pass and those that hold it in registers, so that both compute the
// same bits in the same order.
// x = res + (y + bias): the residual connection closed
__device__ __forceinline__ float4 residual4(float4 r, float4 p, float4 q) {
    return make_float4(r.x + (p.x + q.x), r.y + (p.y + q.y), r.z + (p.z + q.z),
                       r.w + (p.w + q.w));
}
__device__ __forceinline__ float sum4(float4 v) { return (v.x + v.y) + (v.z + v.w); }
// Σ (v − m)²
__device__ __forceinline__ float sqdev4(float4 v, float m) {
    return (v.x - m) * (v.x - m) + (v.y - m) * (v.y - m) + (v.z - m) * (v.z - m) +
           (v.w - m) * (v.w - m);
}
// Four f32 values rounded to bf16, in 8 bytes
__device__ __forceinline__ uint2 pack_bf4(float a, float b, float c, float d) {
    return make_uint2((u32)to_bf(a) | ((u32)to_bf(b) << 16),
                      (u32)to_bf(c) | ((u32)to_bf(d) << 16));
}
// (v − m)·r·g + o, in bf16
__device__ __forceinline__ uint2 normalize4(float4 v, float m, float r, float4 g,
                                            float4 o) {
    return pack_bf4((v.x - m) * r * g.x + o.x, (v.y - m) * r * g.y + o.y,
                    (v.z - m) * r * g.z + o.z, (v.w - m) * r * g.w + o.w);
}
// The backward's row sums, added into sg and sgx: Σ g and Σ g·x̂ with g = dy ∘ w, x̂ = (x −
// m)·r
__device__ __forceinline__ void row_sums4(float4 xv, float4 d, float4 g, float m, float r,
                                          float& sg, float& sgx) {
    float gs[4] = {d.x * g.x, d.y * g.y, d.z * g.z, d.w * g.w};
    float xs[4] = {xv.x, xv.y, xv.z, xv.w};
    for (int e = 0; e < 4; ++e) {
        sg += gs[e];
        sgx += gs[e] * ((xs[e] - m) * r);
    }
}
// dx = (g − mean(g) − x̂·mean(g ∘ x̂))·r, plus `in` (the residual's gradient) where there
// is one, and dw = dy ∘ x̂; sg and sgx are the row's means
__device__ __forceinline__ void dx4(float4 xv, float4 dv, float4 g, const float4* in,
                                    float m, float r, float sg, float sgx, float (&dx)[4],
                                    float (&dw)[4]) {
    float xs[4] = {xv.x, xv.y, xv.z, xv.w}, ds[4] = {dv.x, dv.y, dv.z, dv.w},
          ws[4] = {g.x, g.y, g.z, g.w};
    float ins[4] = {0.f, 0.f, 0.f, 0.f};
    if (in) {
        ins[0] = in->x;
        ins[1] = in->y;
        ins[2] = in->z;
        ins[3] = in->w;
    }
    for (int e = 0; e < 4; ++e) {
        float xh = (xs[e] - m) * r;
        dx[e] = (ds[e] * ws[e] - sg - xh * sgx) * r;
        if (in) dx[e] = ins[e] + dx[e];
        dw[e] = ds[e] * xh;
    }
}

// ANCHOR: layernorm_forward
// One warp per row, each lane 4 values at a time, in three passes over the row: the kernel
// for rows wider than 1024 (layernorm_forward_K below holds narrower ones in registers).
// With a product's output y, first closes the residual connection, x = res + (y + bias),
// and keeps x (the LayerNorm's input, which its backward needs); then LayerNorm of x,
// statistics in f32, the normalised row rounded to bf16 for the next product.
extern "C" __global__ void layernorm_forward(
    const float* res,                  // [rows, C] the residual stream so far
    const float* y,                    // [rows, C] a product's output to add to it, or null
    const float* __restrict__ y_bias,  // [C] that product's bias (read only with y)
    float* x,                          // [rows, C] res + y + y_bias, written only with y
    const float* __restrict__ w,       // [C] gain
    const float* __restrict__ b,       // [C] bias
    u16* __restrict__ out,             // [rows, C] normalised, bf16
    float* __restrict__ mean,          // [rows]
    float* __restrict__ rstd,          // [rows] 1/sqrt(var + eps)
    int rows, int C
) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32,
              lane = threadIdx.x % 32;
    if (row >= rows) return;
    const long long base = (long long)row * C;
    const float* xr = res + base;
    float sum = 0.f;
    if (y) {
        for (int j = lane; j < C / 4; j += 32) {
            float4 v = residual4(ld4(res + base, j), ld4(y + base, j), ld4(y_bias, j));
            st4(x + base, j, v);
            sum += sum4(v);
        }
        xr = x + base;  // each lane reads back only what it wrote
    } else {
        for (int j = lane; j < C / 4; j += 32) sum += sum4(ld4(xr, j));
    }
    const float m = warp_sum(sum) / C;
    float ss = 0.f;
    for (int j = lane; j < C / 4; j += 32) ss += sqdev4(ld4(xr, j), m);
    const float r = 1.f / sqrtf(warp_sum(ss) / C + 1e-5f);
    for (int j = lane; j < C / 4; j += 32)
        reinterpret_cast<uint2*>(out + base)[j] =
            normalize4(ld4(xr, j), m, r, ld4(w, j), ld4(b, j));
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}
// ANCHOR_END: layernorm_forward

// ANCHOR: layernorm_backward
// One warp per row, 4 warps a block, every (gridDim.x · 4)-th row, each lane 4 values at a
// time, in two passes over the row: the kernel for rows wider than 1024
// (layernorm_backward_K below holds narrower ones, and the column sums, in registers). With
// x̂ = (x − μ)·r and g = dy ∘ w: dx = (g − mean(g) − x̂ · mean(g ∘ x̂))·r, added to the
// gradient reaching x along the residual; the sum is written in f32 and, rounded, in bf16
// for the products before it. Three column sums ride along, per warp in shared memory, then
// per block into `partial` (reduce_partials adds the blocks): dw = Σ dy ∘ x̂, db = Σ dy,
// and Σ of the residual gradient written, which is the gradient of the bias of the product
// whose output joined the residual stream at x (the attention's or the MLP's output
// projection).
extern "C" __global__ void layernorm_backward(
    const float* __restrict__ dy,    // [rows, C] gradient of the normalised output
    const float* __restrict__ x,     // [rows, C] the forward's input
    const float* __restrict__ w,     // [C] gain
    const float* __restrict__ mean,  // [rows]
    const float* __restrict__ rstd,  // [rows]
    const float* dres_in,  // [rows, C] gradient reaching x along the residual, or null
    float* dres_out,       // [rows, C] dres_in + dx (may be dres_in itself)
    u16* __restrict__ dres_out_bf16,  // [rows, C] the same, bf16
    float* __restrict__ partial,  // [gridDim.x, 3C] per block: Σ dy·x̂, Σ dy, Σ dres_out
    int rows, int C) {
    extern __shared__ float acc[];  // [warps][3C]
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* mine = acc + (long long)warp * 3 * C;
    // each lane zeroes the very chunks of 4 columns it adds into below, so no lane reads
    // what another wrote before the block's barrier
    for (int part = 0; part < 3; ++part)
        for (int j = lane; j < C / 4; j += 32)
            st4(mine + part * C, j, make_float4(0.f, 0.f, 0.f, 0.f));
    for (int row = blockIdx.x * warps + warp; row < rows; row += gridDim.x * warps) {
        const long long base = (long long)row * C;
        const float m = mean[row], r = rstd[row];
        float sg = 0.f, sgx = 0.f;
        for (int j = lane; j < C / 4; j += 32)
            row_sums4(ld4(x + base, j), ld4(dy + base, j), ld4(w, j), m, r, sg, sgx);
        sg = warp_sum(sg) / C;
        sgx = warp_sum(sgx) / C;
        for (int j = lane; j < C / 4; j += 32) {
            float4 dv = ld4(dy + base, j),
                   in = dres_in ? ld4(dres_in + base, j) : make_float4(0.f, 0.f, 0.f, 0.f);
            float ds[4] = {dv.x, dv.y, dv.z, dv.w}, dx[4], dw[4];
            dx4(ld4(x + base, j), dv, ld4(w, j), dres_in ? &in : nullptr, m, r, sg, sgx, dx,
                dw);
            // this lane's own 4 columns of each sum, 16 bytes at a time (no bank conflicts)
            add4(mine, j, dw);
            add4(mine + C, j, ds);
            add4(mine + 2 * C, j, dx);
            st4(dres_out + base, j, make_float4(dx[0], dx[1], dx[2], dx[3]));
            reinterpret_cast<uint2*>(dres_out_bf16 + base)[j] =
                pack_bf4(dx[0], dx[1], dx[2], dx[3]);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 3 * C; c += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < warps; ++k) s += acc[(long long)k * 3 * C + c];
        partial[(long long)blockIdx.x * 3 * C + c] = s;
    }
}
// ANCHOR_END: layernorm_backward

// ANCHOR: layernorm_registers
// The same two kernels with the row held in registers, for rows up to 128·K values wide:
// lane `lane` holds the chunks of 4 columns j = lane, lane + 32, ..., K of them (those past
// C/4 are left out), so each row is read from memory once instead of once per pass over it,
// and the backward keeps its three column sums in registers too: a lane adds into the same
// columns on every row, so only the block's last step goes through shared memory. The
// arithmetic, and its order, is the loops' above. K is a compile-time constant so that the
// arrays stay in registers; kernels.rs picks the smallest K that holds C, and the loops
// above past 1024.
template <int K>
__device__ __forceinline__ void layernorm_forward_registers(
    const float* res, const float* y, const float* __restrict__ y_bias, float* x,
    const float* __restrict__ w, const float* __restrict__ b, u16* __restrict__ out,
    float* __restrict__ mean, float* __restrict__ rstd, int rows, int C
) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32,
              lane = threadIdx.x % 32;
    if (row >= rows) return;
    const long long base = (long long)row * C;
    float4 v[K];
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = lane + 32 * k;
        v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (j >= C / 4) continue;
        if (y) {
            v[k] = residual4(ld4(res + base, j), ld4(y + base, j), ld4(y_bias, j));
            st4(x + base, j, v[k]);
        } else {
            v[k] = ld4(res + base, j);
        }
        sum += sum4(v[k]);
    }
    const float m = warp_sum(sum) / C;
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        if (lane + 32 * k < C / 4) ss += sqdev4(v[k], m);
    }
    const float r = 1.f / sqrtf(warp_sum(ss) / C + 1e-5f);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = lane + 32 * k;
        if (j < C / 4)
            reinterpret_cast<uint2*>(out + base)[j] =
                normalize4(v[k], m, r, ld4(w, j), ld4(b, j));
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

__device__ __forceinline__ void add_into(float4& s, float4 v) {
    s.x += v.x;
    s.y += v.y;
    s.z += v.z;
    s.w += v.w;
}

template <int K>
__device__ __forceinline__ void
layernorm_backward_registers(const float* __restrict__ dy, const float* __restrict__ x,
                             const float* __restrict__ w, const float* __restrict__ mean,
                             const float* __restrict__ rstd, const float* dres_in,
                             float* dres_out, u16* __restrict__ dres_out_bf16,
                             float* __restrict__ partial, int rows, int C) {
    extern __shared__ float acc[];  // [warps][3C], filled once, at the end
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    // this lane's columns of Σ dy·x̂, Σ dy and Σ dres_out over the rows its warp takes
    float4 sdw[K], sdb[K], sdr[K];
#pragma unroll
    for (int k = 0; k < K; ++k) sdw[k] = sdb[k] = sdr[k] = zero;
    for (int row = blockIdx.x * warps + warp; row < rows; row += gridDim.x * warps) {
        const long long base = (long long)row * C;
        const float m = mean[row], r = rstd[row];
        // every load of the row first, so that they are all in flight at once; a lane reads
        // dres_in only where it then writes dres_out, so the two may be one buffer
        float4 xv[K], dv[K], in[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = lane + 32 * k;
            const bool mine = j < C / 4;
            xv[k] = mine ? ld4(x + base, j) : zero;
            dv[k] = mine ? ld4(dy + base, j) : zero;
            in[k] = mine && dres_in ? ld4(dres_in + base, j) : zero;
        }
        float sg = 0.f, sgx = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (lane + 32 * k < C / 4)
                row_sums4(xv[k], dv[k], ld4(w, lane + 32 * k), m, r, sg, sgx);
        }
        sg = warp_sum(sg) / C;
        sgx = warp_sum(sgx) / C;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = lane + 32 * k;
            if (j >= C / 4) continue;
            float dx[4], dw[4];
            dx4(xv[k], dv[k], ld4(w, j), dres_in ? &in[k] : nullptr, m, r, sg, sgx, dx, dw);
            const float4 out = make_float4(dx[0], dx[1], dx[2], dx[3]);
            add_into(sdw[k], make_float4(dw[0], dw[1], dw[2], dw[3]));
            add_into(sdb[k], dv[k]);
            add_into(sdr[k], out);
            st4(dres_out + base, j, out);
            reinterpret_cast<uint2*>(dres_out_bf16 + base)[j] =
                pack_bf4(dx[0], dx[1], dx[2], dx[3]);
        }
    }
    // the warps' sums, added in the order of the loop above; every column of every warp's
    // part is written, by the lane that owns it, rows or none
    float* mine = acc + (long long)warp * 3 * C;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = lane + 32 * k;
        if (j >= C / 4) continue;
        st4(mine, j, sdw[k]);
        st4(mine + C, j, sdb[k]);
        st4(mine + 2 * C, j, sdr[k]);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 3 * C; c += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < warps; ++k) s += acc[(long long)k * 3 * C + c];
        partial[(long long)blockIdx.x * 3 * C + c] = s;
    }
}

// One kernel of each for K = 1, 2, 4, 6 and 8 (rows up to 128, 256, 512, 768 and 1024
// wide), named layernorm_forward_K and layernorm_backward_K, with the arguments of the
// loops' kernels. BLOCKS: the backward's blocks of 4 warps an SM holds at once, which caps
// its registers at 65,536 / (128 · BLOCKS) a thread: 3 (168) hold K up to 6 without
// spilling, K = 8 needs 2. LN_BACKWARD_WARPS comes from kernels.rs (-D), which launches the
// backward's blocks
static_assert(LN_BACKWARD_WARPS >= 1,
              "LN_BACKWARD_WARPS is set by the host, which launches the blocks");
#define LAYERNORM_REGISTERS(K, BLOCKS)                                                     \
    extern "C" __global__ void layernorm_forward_##K(                                      \
        const float* res, const float* y, const float* __restrict__ y_bias, float* x,      \
        const float* __restrict__ w, const float* __restrict__ b, u16* __restrict__ out,   \
        float* __restrict__ mean, float* __restrict__ rstd, int rows, int C) {             \
        layernorm_forward_registers<K>(res, y, y_bias, x, w, b, out, mean, rstd, rows, C); \
    }                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * LN_BACKWARD_WARPS, BLOCKS)           \
        layernorm_backward_##K(const float* __restrict__ dy, const float* __restrict__ x,  \
                               const float* __restrict__ w,                                \
                               const float* __restrict__ mean,                             \
                               const float* __restrict__ rstd, const float* dres_in,       \
                               float* dres_out, u16* __restrict__ dres_out_bf16,           \
                               float* __restrict__ partial, int rows, int C) {             \
        layernorm_backward_registers<K>(dy, x, w, mean, rstd, dres_in, dres_out,           \
                                        dres_out_bf16, partial, rows, C);                  \
    }
LAYERNORM_REGISTERS(1, 3)
LAYERNORM_REGISTERS(2, 3)
LAYERNORM_REGISTERS(4, 3)
LAYERNORM_REGISTERS(6, 3)
LAYERNORM_REGISTERS(8, 2)
// ANCHOR_END: layernorm_registers

// Column sums, second pass: out[c] = Σ_p partial[p, c], the K columns cut into runs of
// `width`, each to its own output (a LayerNorm's partials hold dw, db and the residual's
// sum; the fused projection's, its bias's three thirds side by side). A null output is
// skipped. Overwrites. A block of 32 × 16 threads per 32 columns: thread (x, y) sums the
// parts y, y + 16, ..., then the 16 sums are added in order; many short loops rather than
// one long one per column, which would wait on memory at every step.
extern "C" __global__ void
reduce_partials(const float* __restrict__ partial,  // [parts, K]
                int parts, int K, int width, float* out0, float* out1,
                float* out2  // [width] each, for columns 0.., width.., 2·width..
) {
    __shared__ float sums[16][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (c < K)
        for (int p = threadIdx.y; p < parts; p += 16) s += partial[(long long)p * K + c];
    sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < K) {
        float total = 0.f;
        for (int g = 0; g < 16; ++g) total += sums[g][threadIdx.x];
        float* out = c < width ? out0 : c < 2 * width ? out1 : out2;
        if (out) out[c % width] = total;
    }
}

// ANCHOR: gelu
// GELU in GPT-2's tanh form (layers.rs's gelu): 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
// The tanh is one function of x, so that the forward's GELU and the backward's, which also
// needs its derivative, compute it alike and give the same bits.
__device__ __forceinline__ float gelu_tanh(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return tanhf(u);
}

// GELU at x, given t = gelu_tanh(x).
__device__ __forceinline__ float gelu_from(float x, float t) {
    return 0.5f * x * (1.f + t);
}

__device__ __forceinline__ float gelu(float x) { return gelu_from(x, gelu_tanh(x)); }

// GELU's derivative at x, given t = gelu_tanh(x).
__device__ __forceinline__ float gelu_grad(float x, float t) {
    float du = 0.7978845608028654f * (1.f + 3.f * 0.044715f * x * x);
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du;
}

// Eight bf16 values in 16 bytes, as four pairs.
__device__ __forceinline__ void unpack8(uint4 x, float* f) {
    u32 w[4] = {x.x, x.y, x.z, x.w};
    for (int e = 0; e < 4; ++e) {
        f[2 * e] = bf((u16)(w[e] & 0xffff));
        f[2 * e + 1] = bf((u16)(w[e] >> 16));
    }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    u32 w[4];
    for (int e = 0; e < 4; ++e)
        w[e] = (u32)to_bf(f[2 * e]) | ((u32)to_bf(f[2 * e + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// The MLP's first product's bias, then GELU: out = gelu(fc + bias), in bf16. fc stays as
// the product wrote it; the backward adds the bias again. A block per row, 8 values (16
// bytes) a thread at a time.
extern "C" __global__ void bias_gelu(
    const u16* __restrict__ fc,      // [rows, K] the product, without its bias
    const float* __restrict__ bias,  // [K]
    u16* __restrict__ out,           // [rows, K] gelu(fc + bias)
    int K                            // a multiple of 8
) {
    const long long base = (long long)blockIdx.x * K;
    const uint4* src = reinterpret_cast<const uint4*>(fc + base);
    uint4* dst = reinterpret_cast<uint4*>(out + base);
    for (int j = threadIdx.x; j < K / 8; j += blockDim.x) {
        float f[8];
        unpack8(src[j], f);
        for (int e = 0; e < 8; ++e) f[e] = gelu(f[e] + bias[8 * j + e]);
        dst[j] = pack8(f);
    }
}

// The GELU backward, in one pass over the layer's fc and the gradient of GELU's output:
// d ← d ∘ gelu'(fc + bias) in place (the gradient through GELU), out = gelu(fc + bias)
// (GELU's output again, which the forward does not keep, for the output projection's weight
// gradient), and the column sums of the new d (the bias's gradient) per chunk of rows.
// Block (x, y): 32 × GELU_LANES threads over 256 columns and rows y·chunk .. (y+1)·chunk;
// thread (tx, ty) takes 8 columns (16 bytes of each tensor) on rows ty, ty + GELU_LANES,
// ... of the chunk, so a warp moves 512-byte runs of a row. A column's GELU_LANES sums meet
// in shared memory and are added in the order of ty, so the partial sums are the same on
// every run. GELU_LANES comes from kernels.rs (-D), which launches blocks of 32 ×
// GELU_LANES threads
static_assert(32 * GELU_LANES == 256,
              "the column sums take one thread per column of a block");
extern "C" __global__ void gelu_backward(
    u16* __restrict__ d,         // [rows, K] gradient of GELU's output in, of its input out
    const u16* __restrict__ fc,  // [rows, K] the product, without its bias
    const float* __restrict__ bias,  // [K]
    u16* __restrict__ out,           // [rows, K] gelu(fc + bias) out
    float* __restrict__ partial,     // [gridDim.y, K] column sums of the gradient out
    int rows, int K,                 // K a multiple of 8
    int chunk                        // rows per block row of the grid
) {
    __shared__ float sums[GELU_LANES][256];
    const int c = 256 * blockIdx.x + 8 * threadIdx.x;  // this thread's first column
    const int r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
    float s[8];
    for (int e = 0; e < 8; ++e) s[e] = 0.f;
    if (c < K) {
        float b[8];
        for (int e = 0; e < 8; ++e) b[e] = bias[c + e];
        for (int r = r0 + threadIdx.y; r < r1; r += GELU_LANES) {
            const long long i = ((long long)r * K + c) / 8;
            float g[8], x[8];
            unpack8(reinterpret_cast<const uint4*>(d)[i], g);
            unpack8(reinterpret_cast<const uint4*>(fc)[i], x);
            for (int e = 0; e < 8; ++e) {
                const float v = x[e] + b[e], t = gelu_tanh(v);
                x[e] = gelu_from(v, t);
                g[e] *= gelu_grad(v, t);
                s[e] += g[e];
            }
            reinterpret_cast<uint4*>(d)[i] = pack8(g);
            reinterpret_cast<uint4*>(out)[i] = pack8(x);
        }
    }
    for (int e = 0; e < 8; ++e) sums[threadIdx.y][8 * threadIdx.x + e] = s[e];
    __syncthreads();
    // a thread per column of the block adds that column's GELU_LANES sums
    const int col = 32 * threadIdx.y + threadIdx.x;
    if (256 * blockIdx.x + col >= K) return;
    float total = 0.f;
    for (int y = 0; y < GELU_LANES; ++y) total += sums[y][col];
    partial[(long long)blockIdx.y * K + 256 * blockIdx.x + col] = total;
}
// ANCHOR_END: gelu

// ANCHOR: heads
// The fused projection's output, one row per token: q's heads side by side, then k's, then
// v's, [B·T, W]: q's C = H·D columns, then k's KC and v's KC (W = C + 2·KC; KC = C,
// unless k and v have fewer heads than q). Our attention kernels take each of q, k and v
// as [B, heads, T, D]: q[b, h, t, d] = qkv[b·T + t, h·D + d] + bias[h·D + d], k from
// column C on, v from C + KC on. A block per token; a thread moves 8 values (16 bytes) at
// a time, so a head's row of 64 is 8 threads' reads of one 128-byte run and their writes
// of another.
extern "C" __global__ void qkv_to_heads(
    const u16* __restrict__ qkv,     // [B·T, W]
    const float* __restrict__ bias,  // [W]
    u16* __restrict__ q,             // [B, H, T, D]
    u16* __restrict__ k,             // [B, KV, T, D], KV = KC / D
    u16* __restrict__ v,             // [B, KV, T, D]
    int T, int H, int D, int W       // D a multiple of 8
) {
    const int C = H * D, KC = (W - C) / 2, KV = KC / D;
    const int row = blockIdx.x, b = row / T, t = row % T;
    const uint4* src = reinterpret_cast<const uint4*>(qkv + (long long)row * W);
    for (int j = threadIdx.x; j < W / 8; j += blockDim.x) {
        const int col = 8 * j;
        // which of q, k and v the column is of, that tensor's heads, the column in its row
        const int part = col < C ? 0 : col < C + KC ? 1 : 2;
        const int heads = part == 0 ? H : KV, c = part == 0 ? col : (col - C) % KC;
        const int h = c / D, d = c % D;
        float f[8];
        unpack8(src[j], f);
        for (int e = 0; e < 8; ++e) f[e] += bias[col + e];
        u16* out = part == 0 ? q : part == 1 ? k : v;
        *reinterpret_cast<uint4*>(out + (((long long)b * heads + h) * T + t) * D + d) =
            pack8(f);
    }
}

// One tensor between the two layouts: [B, H, T, D] to one row per token, [B·T, C] (the
// attention's output into the projection), or back (the output's gradient into the
// backward). A block per token, 16 bytes a thread at a time.
extern "C" __global__ void heads_rows(
    const u16* __restrict__ src,
    u16* __restrict__ dst,
    int to_rows,                     // 1: src is heads, dst rows; 0: the other way
    int T, int H, int D
) {
    const int C = H * D, row = blockIdx.x, b = row / T, t = row % T;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* o = reinterpret_cast<uint4*>(dst);
    for (int j = threadIdx.x; j < C / 8; j += blockDim.x) {
        const int c = 8 * j, h = c / D, d = c % D;
        const long long heads = ((((long long)b * H + h) * T + t) * D + d) / 8;
        const long long rows = ((long long)row * C + c) / 8;
        if (to_rows) o[rows] = s[heads];
        else o[heads] = s[rows];
    }
}

// The inverse of qkv_to_heads for the gradients: dq, dk, dv back to the fused projection's
// columns, [B·T, W], and the column sums of the result (the bias's gradient) per chunk of
// rows. Block (x, y): 128 threads, each a pair of columns, over rows y·chunk ..
// (y+1)·chunk.
extern "C" __global__ void heads_to_qkv(
    const u16* __restrict__ dq,      // [B, H, T, D]
    const u16* __restrict__ dk,      // [B, KV, T, D], KV = (W − H·D) / 2D
    const u16* __restrict__ dv,      // [B, KV, T, D]
    u16* __restrict__ dqkv,          // [B·T, W]
    float* __restrict__ partial,     // [gridDim.y, W]
    int T, int H, int D, int W, int rows, int chunk
) {
    const int C = H * D, KC = (W - C) / 2, KV = KC / D;
    const int p = blockIdx.x * blockDim.x + threadIdx.x;  // column pair of the W
    if (2 * p >= W) return;
    const int col = 2 * p, part = col < C ? 0 : col < C + KC ? 1 : 2;
    const int heads = part == 0 ? H : KV, c = part == 0 ? col : (col - C) % KC;
    const int h = c / D, d = c % D;
    const u16* src = part == 0 ? dq : part == 1 ? dk : dv;
    const int r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
    float s0 = 0.f, s1 = 0.f;
    for (int r = r0; r < r1; ++r) {
        long long b = r / T, t = r % T;
        u32 x = *reinterpret_cast<const u32*>(src + ((b * heads + h) * T + t) * D + d);
        s0 += bf((u16)(x & 0xffff));
        s1 += bf((u16)(x >> 16));
        *reinterpret_cast<u32*>(dqkv + (long long)r * W + col) = x;
    }
    partial[(long long)blockIdx.y * W + col] = s0;
    partial[(long long)blockIdx.y * W + col + 1] = s1;
}
// ANCHOR_END: heads

// [step 06]
// Column sums of a bf16 [rows, K] matrix per chunk of rows: the bias's gradient of the
// fused projection when the attention's backward wrote its gradient in place (step 06's
// kernels write dq, dk and dv straight into the [B·T, 3C] rows, so heads_to_qkv has nothing
// to move). Block (x, y): 128 threads, each 8 columns (16 bytes of a row), over rows
// y·chunk .. (y+1)·chunk, added in row order as heads_to_qkv adds them.
extern "C" __global__ void column_sums(
    const u16* __restrict__ d,       // [rows, K], K a multiple of 8
    float* __restrict__ partial,     // [gridDim.y, K]
    int rows, int K, int chunk
) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;  // 8-column group
    if (8 * p >= K) return;
    const int r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int r = r0; r < r1; ++r) {
        float f[8];
        unpack8(reinterpret_cast<const uint4*>(d + (long long)r * K)[p], f);
        for (int e = 0; e < 8; ++e) s[e] += f[e];
    }
    for (int e = 0; e < 8; ++e) partial[(long long)blockIdx.y * K + 8 * p + e] = s[e];
}
// [/step 06]

// [step 08]
// ANCHOR: sum_kv_groups
// Grouped heads through step 06's kernels, which write dk and dv for every query head, as
// if k and v had been repeated: from that gradient, [B·T, 3C] (q's, k's and v's H heads
// each), to the fused projection's, [B·T, C + 2·KV·D], q's columns as they are and each kv
// head's dk and dv the sum over the G = H / KV query heads of its group (query head h
// reads kv head h / G). A block per token; a thread 8 columns of the output at a time.
extern "C" __global__ void sum_kv_groups(
    const u16* __restrict__ full,    // [B·T, 3C]
    u16* __restrict__ dqkv,          // [B·T, C + 2·KV·D]
    int H, int KV, int D             // D a multiple of 8
) {
    const int C = H * D, KC = KV * D, W = C + 2 * KC, G = H / KV, row = blockIdx.x;
    const uint4* src = reinterpret_cast<const uint4*>(full + (long long)row * 3 * C);
    uint4* dst = reinterpret_cast<uint4*>(dqkv + (long long)row * W);
    for (int j = threadIdx.x; j < W / 8; j += blockDim.x) {
        const int col = 8 * j;
        if (col < C) {
            dst[j] = src[j];
            continue;
        }
        const int part = col < C + KC ? 1 : 2, c = (col - C) % KC, kh = c / D, d = c % D;
        float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int g = 0; g < G; ++g) {
            float f[8];
            unpack8(src[(part * C + (kh * G + g) * D + d) / 8], f);
            for (int e = 0; e < 8; ++e) sum[e] += f[e];
        }
        dst[j] = pack8(sum);
    }
}
// ANCHOR_END: sum_kv_groups
// [/step 08]

// ANCHOR: cross_entropy
// Softmax and cross-entropy of each row of logits together, one warp per row (V ≤ 256
// values, 8 a lane): losses[row] = lse − logit[target] and, when dlogits is given, the
// gradient (softmax − onehot(target))·scale in bf16, scale = 1/(B·T) for the mean over
// tokens.
extern "C" __global__ void cross_entropy(
    const float* __restrict__ logits,  // [rows, V] f32
    const u8* __restrict__ targets,    // [rows]
    float* __restrict__ losses,        // [rows] out
    u16* __restrict__ dlogits,         // [rows, V] out, or null (held-out loss only)
    int rows, int V, float scale
) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32,
              lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float* l = logits + (long long)row * V;
    float m = -__int_as_float(0x7f800000);
    for (int c = lane; c < V; c += 32) m = fmaxf(m, l[c]);
    m = warp_max(m);
    float s = 0.f;
    for (int c = lane; c < V; c += 32) s += expf(l[c] - m);
    const float lse = m + logf(warp_sum(s));
    const int target = targets[row];
    if (lane == 0) losses[row] = lse - l[target];
    if (dlogits) {
        u16* d = dlogits + (long long)row * V;
        for (int c = lane; c < V; c += 32)
            d[c] = to_bf((expf(l[c] - lse) - (c == target ? 1.f : 0.f)) * scale);
    }
}
// ANCHOR_END: cross_entropy

// out[0] = scale · Σ x, one block of 1024 threads, summed in f64 in a fixed order.
extern "C" __global__ void sum_scaled(
    const float* __restrict__ x, int n, float scale, float* __restrict__ out
) {
    __shared__ double s[1024];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = (float)(s[0] * scale);
}

// ANCHOR: grad_norm
// The gradients' global norm, first pass: each block's Σ g² over a grid-stride share of the
// flat gradient buffer, in f64 (as optim.rs's clip_grad_norm sums).
extern "C" __global__ void sumsq_partial(
    const float* __restrict__ g, long long n, double* __restrict__ partial  // [gridDim.x]
) {
    __shared__ double s[256];
    double acc = 0.0;
    for (long long i = global_index(); i < n; i += (long long)gridDim.x * blockDim.x) {
        double v = g[i];
        acc += v * v;
    }
    s[threadIdx.x] = acc;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

// Second pass, one block of 256 threads: out[0] = √(Σ partial).
extern "C" __global__ void norm_finish(
    const double* __restrict__ partial, int n, float* __restrict__ out
) {
    __shared__ double s[256];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = (float)sqrt(s[0]);
}
// ANCHOR_END: grad_norm

// ANCHOR: adamw
// One AdamW step of every weight (optim.rs's AdamW::step after clip_grad_norm), over the
// flat buffers: the gradient scaled by max_norm/norm when the norm (read from device
// memory, where norm_finish left it: no trip to the host) is above max_norm; weight decay
// on the elements below decay_end, where the layout puts every matrix. Writes the f32
// master weight and its bf16 copy for the products.
extern "C" __global__ void adamw(
    float* __restrict__ p,            // [n] master weights
    const float* __restrict__ g,      // [n] gradients
    float* __restrict__ m,            // [n] running mean of the gradients
    float* __restrict__ v,            // [n] running mean of their squares
    u16* __restrict__ p16,            // [n] bf16 copy of the weights
    long long n, long long decay_end,
    const float* __restrict__ norm,   // [1] the gradients' global norm
    float max_norm, float lr, float beta1, float beta2, float eps, float weight_decay,
    float c1, float c2                // bias corrections 1 − β₁ᵗ, 1 − β₂ᵗ
) {
    const float nrm = norm[0];
    const bool clip = nrm > max_norm;
    const float scale = max_norm / nrm;
    for (long long i = global_index(); i < n; i += (long long)gridDim.x * blockDim.x) {
        float gi = clip ? g[i] * scale : g[i];
        float mi = beta1 * m[i] + (1.f - beta1) * gi;
        float vi = beta2 * v[i] + (1.f - beta2) * gi * gi;
        float decay = i < decay_end ? weight_decay : 0.f;
        float w = p[i];
        w -= lr * ((mi / c1) / (sqrtf(vi / c2) + eps) + decay * w);
        m[i] = mi;
        v[i] = vi;
        p[i] = w;
        p16[i] = to_bf(w);
    }
}
// ANCHOR_END: adamw

// y = bf16(x): the weights' first bf16 copy, after they are uploaded.
extern "C" __global__ void to_bf16(const float* __restrict__ x, u16* __restrict__ y,
                                   long long n) {
    long long i = global_index();
    if (i < n) y[i] = to_bf(x[i]);
}
