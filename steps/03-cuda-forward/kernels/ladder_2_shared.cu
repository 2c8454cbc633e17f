// Rung 2 of the ladder: keys and values staged through shared memory.
//
// Still one thread per query row, in f32, with the same update as rung 1. What changes is
// where the keys and values come from: the BLOCK_M threads of a block copy BLOCK_N keys and
// values at a time from global memory into shared memory, together, each element once,
// widened to f32 once, and then every thread of the block reads them from there. A key
// travels from global memory once per block of BLOCK_M rows instead of once per warp of 32,
// and the copy is coalesced: consecutive threads read consecutive 16-byte pieces of a row.
//
// Compile-time parameters, every one given to NVRTC as a -D option by src/ladder.rs:
//   HEAD_DIM  32 or 64 (as rung 1: a row of q and one of o live in one thread's registers)
//   IS_BF16   1 for bf16 inputs and output, 0 for f16
//   BLOCK_M   threads (= query rows) per thread block
//   BLOCK_N   keys (and values) staged in shared memory at a time
//
// src/kernel.rs prepends tensor_cores.cuh (the 16-bit conversions and ex2) before NVRTC
// compiles it.

#define LN2 0.6931471805599453f
// 16-byte pieces (8 values) per row of keys or values
#define PIECES (HEAD_DIM / 8)

// 8 packed 16-bit values widened to f32
__device__ __forceinline__ void widen8(uint4 x, float* dst) {
    const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        dst[2 * i] = to_f32((u16)(w[i] & 0xffff));
        dst[2 * i + 1] = to_f32((u16)(w[i] >> 16));
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK_M) ladder_shared(
    const u16* __restrict__ q,  // [B*H, T, HEAD_DIM] queries, bf16 or f16 bits
    const u16* __restrict__ k,  // [B*H, T, HEAD_DIM] keys
    const u16* __restrict__ v,  // [B*H, T, HEAD_DIM] values
    u16* __restrict__ out,      // [B*H, T, HEAD_DIM] output
    float* __restrict__ lse,    // [B*H, T] natural log-sum-exp of each row's scaled scores
    int T,            // tokens per sequence; the grid has ceil(T / BLOCK_M) blocks a head
    float scale_log2  // log2(e)/sqrt(HEAD_DIM): scores in base-2 units, for ex2
) {
    // ANCHOR: shared_tiles
    // BLOCK_N keys and values, widened to f32: 2·64·64·4 bytes = 32 KiB at head dim 64
    __shared__ __align__(16) float sk[BLOCK_N][HEAD_DIM];
    __shared__ __align__(16) float sv[BLOCK_N][HEAD_DIM];
    // ANCHOR_END: shared_tiles

    const int q_blocks = (T + BLOCK_M - 1) / BLOCK_M;
    const int bh = blockIdx.x / q_blocks;
    const int q0 = (blockIdx.x % q_blocks) * BLOCK_M;
    const int row = q0 + threadIdx.x;
    const long long head = (long long)bh * T * HEAD_DIM;
    k += head;
    v += head;

    // a thread whose row is past T has no row, but still copies its share and meets every
    // barrier: only its reading of keys is skipped (last = -1)
    const int last = row < T ? row : -1;
    float qr[HEAD_DIM], o[HEAD_DIM];
#pragma unroll
    for (int c = 0; c < HEAD_DIM; ++c) {
        qr[c] = row < T ? to_f32(q[head + (long long)row * HEAD_DIM + c]) : 0.f;
        o[c] = 0.f;
    }
    float m = NEG_INF, l = 0.f;

    // keys past the block's last row are never needed
    const int n_keys = min(q0 + BLOCK_M, T);
    for (int kv0 = 0; kv0 < n_keys; kv0 += BLOCK_N) {
        // ANCHOR: stage
        // every thread is done reading the previous block before it is overwritten
        __syncthreads();
        // piece i of the block (row i / PIECES, 8 values) goes to thread i % BLOCK_M: a
        // warp reads 32 consecutive 16-byte pieces, 512 contiguous bytes, in one go
        for (int i = threadIdx.x; i < BLOCK_N * PIECES; i += BLOCK_M) {
            const int r = i / PIECES, c = (i % PIECES) * 8;
            uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
            if (kv0 + r < T) {
                kx = *(const uint4*)(k + (long long)(kv0 + r) * HEAD_DIM + c);
                vx = *(const uint4*)(v + (long long)(kv0 + r) * HEAD_DIM + c);
            }
            widen8(kx, &sk[r][c]);
            widen8(vx, &sv[r][c]);
        }
        // the whole block is in shared memory before any thread reads it
        __syncthreads();
        // ANCHOR_END: stage

        // ANCHOR: shared_loop
        // this row sees keys kv0 .. min(kv0 + BLOCK_N, row + 1) - 1 of the block. sk[j][c]
        // is one address for the whole warp: a broadcast, no bank conflict.
        const int n = min(BLOCK_N, last + 1 - kv0);
        for (int j = 0; j < n; ++j) {
            float s = 0.f;
#pragma unroll
            for (int c = 0; c < HEAD_DIM; ++c) s = fmaf(qr[c], sk[j][c], s);
            const float m_new = fmaxf(m, s);
            const float correction = fast_exp2((m - m_new) * scale_log2);
            const float p = fast_exp2((s - m_new) * scale_log2);
            l = l * correction + p;
#pragma unroll
            for (int c = 0; c < HEAD_DIM; ++c) o[c] = fmaf(o[c], correction, p * sv[j][c]);
            m = m_new;
        }
        // ANCHOR_END: shared_loop
    }

    if (row < T) {
        const float inv = 1.f / l;
        u16* dst = out + head + (long long)row * HEAD_DIM;
#pragma unroll
        for (int c = 0; c < HEAD_DIM; ++c) dst[c] = from_f32(o[c] * inv);
        lse[(long long)bh * T + row] = (m * scale_log2 + __log2f(l)) * LN2;
    }
}
