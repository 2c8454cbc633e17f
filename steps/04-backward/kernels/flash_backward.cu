// FlashAttention backward, causal, on the tensor cores (mma.sync m16n8k16, f32 accumulation).
//
// Three kernels, each program writing only its own rows, so results are deterministic:
//   backward_delta  delta_i = sum_d dO_id * O_id, once per row (FlashAttention-2, Alg. 2 line 4)
//   backward_dkdv   one block per 64 keys of a head: the queries that see them stream past;
//                   dV += P^T dO and dK += dS^T Q accumulate in registers
//   backward_dq     one block per 64 queries of a head: the keys they see stream past;
//                   dQ += dS K accumulates in registers
// with P = exp(S - lse) rebuilt from the forward's log-sum-exp and dS = P o (dP - delta).
//
// Compile-time parameters (NVRTC -D options): HEAD_DIM (32, 64), IS_BF16 (1 bf16, 0 f16).
// src/cuda.rs prepends step 03's tensor_cores.cuh (types, swizzle, cp.async, ldmatrix, mma).

#define BLOCK 64            // keys (dkdv) or queries (dq) per thread block, 16 per warp
#define WARPS 4
#define THREADS (WARPS * 32)
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ float lo16(u32 x) {
#if IS_BF16
    return __uint_as_float(x << 16);
#else
    float f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }\n" : "=f"(f) : "r"(x));
    return f;
#endif
}
__device__ __forceinline__ float hi16(u32 x) {
#if IS_BF16
    return __uint_as_float(x & 0xffff0000u);
#else
    float f;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }\n" : "=f"(f) : "r"(x));
    return f;
#endif
}

// BLOCK rows of a [T, HEAD_DIM] matrix from row `row0` into a swizzled tile; rows past T are 0
__device__ __forceinline__ void load_tile(u16* tile, const u16* src, int row0, int T) {
    const int chunk = threadIdx.x % CHUNKS;
#pragma unroll
    for (int r = threadIdx.x / CHUNKS; r < BLOCK; r += THREADS / CHUNKS) {
        bool valid = row0 + r < T;
        cp_async_16(smem_addr(tile + swizzled(r, chunk)), src + (valid ? (long long)(row0 + r) * HEAD_DIM + chunk * 8 : 0), valid);
    }
}

// A fragments of this warp's 16 rows of a tile (rows 16·warp ..), one per 16 columns
__device__ __forceinline__ void load_a(const u16* tile, int warp, int lane, u32 (&f)[HEAD_DIM / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
        ldmatrix_x4(smem_addr(tile + swizzled(warp * 16 + (lane & 15), 2 * kk + (lane >> 4))), f[kk][0], f[kk][1], f[kk][2], f[kk][3]);
}

// acc[n] += a · tileᵀ for 64 rows of `tile` as the columns: B fragments straight from the rows
// (the tile is [col][k]), as q·kᵀ in the forward kernel
__device__ __forceinline__ void mma_abt(float (&acc)[BLOCK / 8][4], const u32 (&a)[HEAD_DIM / 16][4], const u16* tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
#pragma unroll
        for (int n = 0; n < BLOCK / 8; n += 2) {
            u32 b[4];
            ldmatrix_x4(smem_addr(tile + swizzled(n * 8 + (lane & 7) + 8 * (lane >> 4), 2 * kk + ((lane >> 3) & 1))), b[0], b[1], b[2], b[3]);
            mma_16816(acc[n], a[kk], b[0], b[1]);
            mma_16816(acc[n + 1], a[kk], b[2], b[3]);
        }
}

// acc[n] += p · tile for p a 16 x 64 accumulator (converted to A fragments in registers) and
// tile [64 rows = k][HEAD_DIM = n]: B fragments by the transposing ldmatrix, as p·v forward
__device__ __forceinline__ void mma_pb(float (&acc)[HEAD_DIM / 8][4], const float (&p)[BLOCK / 8][4], const u16* tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < BLOCK / 16; ++kk) {
        u32 a[4] = {pack2(p[2 * kk][0], p[2 * kk][1]), pack2(p[2 * kk][2], p[2 * kk][3]),
                    pack2(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack2(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; n += 2) {
            u32 b[4];
            ldmatrix_x4_trans(smem_addr(tile + swizzled(kk * 16 + (lane & 15), n + (lane >> 4))), b[0], b[1], b[2], b[3]);
            mma_16816(acc[n], a, b[0], b[1]);
            mma_16816(acc[n + 1], a, b[2], b[3]);
        }
    }
}

__device__ __forceinline__ void store_rows(u16* dst, const float (&acc)[HEAD_DIM / 8][4], float scale, int row0, int g, int t, int T) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int row = row0 + g + 8 * h;
        if (row < T) {
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n)
                *(u32*)(dst + (long long)row * HEAD_DIM + n * 8 + 2 * t) = pack2(acc[n][2 * h] * scale, acc[n][2 * h + 1] * scale);
        }
    }
}

// ANCHOR: delta
extern "C" __global__ void backward_delta(
    const u16* __restrict__ out,    // [rows, HEAD_DIM] the forward's output
    const u16* __restrict__ dout,   // [rows, HEAD_DIM] its gradient
    float* __restrict__ delta,      // [rows] sum_d dO·O
    long long rows                  // B*H*T
) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const u32* o = (const u32*)(out + row * HEAD_DIM);
    const u32* d = (const u32*)(dout + row * HEAD_DIM);
    float sum = 0.f;
    for (int i = lane; i < HEAD_DIM / 2; i += 32) sum += lo16(o[i]) * lo16(d[i]) + hi16(o[i]) * hi16(d[i]);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    if (lane == 0) delta[row] = sum;
}
// ANCHOR_END: delta

// ANCHOR: dkdv
extern "C" __global__ void __launch_bounds__(THREADS) backward_dkdv(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,  // [B*H, T, D]
    const u16* __restrict__ dout,    // [B*H, T, D] gradient of the output
    const float* __restrict__ lse,   // [B*H, T] the forward's natural log-sum-exp
    const float* __restrict__ delta, // [B*H, T] from backward_delta
    u16* __restrict__ dk, u16* __restrict__ dv,  // [B*H, T, D] gradients written here
    int T,                           // tokens
    float scale                      // 1/sqrt(HEAD_DIM)
) {
    __shared__ __align__(128) u16 sk[BLOCK * HEAD_DIM], sv[BLOCK * HEAD_DIM], sq[BLOCK * HEAD_DIM], sdo[BLOCK * HEAD_DIM];
    __shared__ float slse[BLOCK], sdelta[BLOCK];
    const int blocks = (T + BLOCK - 1) / BLOCK;
    // the key blocks near the end see the fewest queries: start with the first (most work)
    const int kb = blockIdx.x, bh = blockIdx.y;
    const long long head = (long long)bh * T * HEAD_DIM;
    q += head; k += head; v += head; dout += head; dk += head; dv += head;
    lse += (long long)bh * T;
    delta += (long long)bh * T;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int kv0 = kb * BLOCK, key0 = kv0 + warp * 16;  // this warp's first key

    load_tile(sk, k, kv0, T);
    load_tile(sv, v, kv0, T);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 kf[HEAD_DIM / 16][4], vf[HEAD_DIM / 16][4];
    load_a(sk, warp, lane, kf);
    load_a(sv, warp, lane, vf);

    float dk_acc[HEAD_DIM / 8][4], dv_acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.f;

    // queries kv0 .. T-1 see these keys (a query sees the keys up to itself)
    for (int qb = kb; qb < blocks; ++qb) {
        const int q0 = qb * BLOCK;
        __syncthreads();  // the previous block's tiles are no longer read
        load_tile(sq, q, q0, T);
        load_tile(sdo, dout, q0, T);
        cp_async_commit();
        for (int i = threadIdx.x; i < BLOCK; i += THREADS) {
            bool valid = q0 + i < T;
            slse[i] = valid ? lse[q0 + i] * LOG2E : 0.f;
            sdelta[i] = valid ? delta[q0 + i] : 0.f;
        }
        cp_async_wait<0>();
        __syncthreads();

        // sT = k·qᵀ (16 keys of this warp x 64 queries), then pT = e^(s/√d - lse) of each query
        float p[BLOCK / 8][4], dp[BLOCK / 8][4];
#pragma unroll
        for (int n = 0; n < BLOCK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) p[n][e] = dp[n][e] = 0.f;
        mma_abt(p, kf, sq, lane);
        mma_abt(dp, vf, sdo, lane);  // dpT = v·dOᵀ
#pragma unroll
        for (int n = 0; n < BLOCK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int col = n * 8 + 2 * t + (e & 1);            // query within the block
                int key = key0 + g + 8 * (e >> 1), query = q0 + col;
                float pe = (query < key || query >= T) ? 0.f : fast_exp2(p[n][e] * (scale * LOG2E) - slse[col]);
                p[n][e] = pe;
                dp[n][e] = pe * (dp[n][e] - sdelta[col]);   // dsT = pT o (dpT - delta)
            }
        mma_pb(dv_acc, p, sdo, lane);   // dV += pT · dO
        mma_pb(dk_acc, dp, sq, lane);   // dK += dsT · q   (· scale at the end)
    }
    store_rows(dk, dk_acc, scale, key0, g, t, T);
    store_rows(dv, dv_acc, 1.f, key0, g, t, T);
}
// ANCHOR_END: dkdv

// ANCHOR: dq
extern "C" __global__ void __launch_bounds__(THREADS) backward_dq(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,  // [B*H, T, D]
    const u16* __restrict__ dout,    // [B*H, T, D]
    const float* __restrict__ lse,   // [B*H, T]
    const float* __restrict__ delta, // [B*H, T]
    u16* __restrict__ dq,            // [B*H, T, D]
    int T,
    float scale
) {
    __shared__ __align__(128) u16 sq[BLOCK * HEAD_DIM], sdo[BLOCK * HEAD_DIM], sk[BLOCK * HEAD_DIM], sv[BLOCK * HEAD_DIM];
    const int blocks = (T + BLOCK - 1) / BLOCK;
    const int qb = blocks - 1 - blockIdx.x, bh = blockIdx.y;  // longest first
    const long long head = (long long)bh * T * HEAD_DIM;
    q += head; k += head; v += head; dout += head; dq += head;
    lse += (long long)bh * T;
    delta += (long long)bh * T;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int q0 = qb * BLOCK, row0 = q0 + warp * 16;

    load_tile(sq, q, q0, T);
    load_tile(sdo, dout, q0, T);
    cp_async_commit();
    // this thread's two rows: lse in base 2, and delta
    float lse2[2], dl[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int row = row0 + g + 8 * h;
        lse2[h] = row < T ? lse[row] * LOG2E : 0.f;
        dl[h] = row < T ? delta[row] : 0.f;
    }
    cp_async_wait<0>();
    __syncthreads();
    u32 qf[HEAD_DIM / 16][4], dof[HEAD_DIM / 16][4];
    load_a(sq, warp, lane, qf);
    load_a(sdo, warp, lane, dof);

    float dq_acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) dq_acc[n][0] = dq_acc[n][1] = dq_acc[n][2] = dq_acc[n][3] = 0.f;

    for (int kb = 0; kb <= qb; ++kb) {
        const int kv0 = kb * BLOCK;
        __syncthreads();
        load_tile(sk, k, kv0, T);
        load_tile(sv, v, kv0, T);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        if (kv0 > row0 + 15) continue;  // every key of this block comes after this warp's rows

        float s[BLOCK / 8][4], dp[BLOCK / 8][4];
#pragma unroll
        for (int n = 0; n < BLOCK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
        mma_abt(s, qf, sk, lane);    // s = q·kᵀ
        mma_abt(dp, dof, sv, lane);  // dp = dO·vᵀ
#pragma unroll
        for (int n = 0; n < BLOCK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int h = e >> 1, key = kv0 + n * 8 + 2 * t + (e & 1), row = row0 + g + 8 * h;
                float pe = key > row ? 0.f : fast_exp2(s[n][e] * (scale * LOG2E) - lse2[h]);
                s[n][e] = pe * (dp[n][e] - dl[h]);  // ds = p o (dp - delta)
            }
        mma_pb(dq_acc, s, sk, lane);  // dQ += ds · k   (· scale at the end)
    }
    store_rows(dq, dq_acc, scale, row0, g, t, T);
}
// ANCHOR_END: dq
