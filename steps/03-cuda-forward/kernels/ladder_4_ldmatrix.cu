// Rung 4 of the ladder: rung 3 with its fragments read by ldmatrix from swizzled tiles.
//
// Rung 3 (ladder_3_mma.cu) builds each fragment of q, k and v with plain loads from tiles
// stored row by row, and the lanes of a warp that read one column of 8 rows land in the
// same banks of shared memory and take turns. Here ldmatrix reads four 8x8 matrices for a
// warp in one instruction, each lane receiving the pieces of its fragments (the transposing
// form gives v's), and the tiles are swizzled (`swizzled` in tensor_cores.cuh) so that
// those reads are free of bank conflicts. Everything else is rung 3's: the tiles of the
// final kernel (flash_forward.cu), the online softmax on the accumulators in registers, and
// copies through registers that the products wait for. Each step copies its block of keys
// and values into shared memory, waits at a barrier for the whole block to arrive,
// computes, and waits again before the next copy, so the tensor cores idle while the copies
// are in flight; and blocks run in grid order, each head's shortest query block first. Rung
// 5 (flash_forward.cu) changes both.
//
// Compile-time parameters, every one given to NVRTC as a -D option by src/ladder.rs (the
// final kernel's tile as src/kernel.rs gives it for the head dim, as rung 3's):
//   HEAD_DIM  32, 64 or 128
//   IS_BF16   1 for bf16 inputs and output, 0 for f16
//   WARPS     warps per block
//   M_TILES   16-row tiles of queries per warp
//   BLOCK_N   keys per step (the final kernel's keys per step of its products, SUB_N there)
//
// src/ladder.rs prepends tensor_cores.cuh (the types, the swizzle and the tensor-core
// instructions) and ladder_mma.cuh (what rungs 3 and 4 share: the tile's sizes, the rows'
// running state, the mask, the online softmax and the final store) before NVRTC compiles
// it.

// Copies ROWS rows of a [T, HEAD_DIM] matrix starting at row `row0` into a swizzled tile,
// through registers: a 16-byte load from global memory, then a 16-byte store to shared
// memory, which waits for the load. Rows at or past T become zeros. Consecutive threads
// read consecutive 16-byte chunks.
template <int ROWS>
__device__ __forceinline__ void load_tile(u16* tile, const u16* src, int row0, int T) {
    const int chunk = threadIdx.x % CHUNKS;
#pragma unroll
    for (int r = threadIdx.x / CHUNKS; r < ROWS; r += THREADS / CHUNKS) {
        uint4 x = make_uint4(0, 0, 0, 0);
        if (row0 + r < T)
            x = *(const uint4*)(src + (long long)(row0 + r) * HEAD_DIM + chunk * 8);
        *(uint4*)(tile + swizzled(r, chunk)) = x;
    }
}

// ANCHOR: ldmatrix_scores
// s = q·kᵀ for the warp's rows and the block's BLOCK_N keys, in 16x8 tiles: one ldmatrix_x4
// gives the A fragment of 16 rows of q, another the B fragments of 16 keys (two n-tiles),
// each serving all M_TILES row tiles; q_frag holds each lane's addresses into q's tile, off
// its offsets into k's (BOffsets in tensor_cores.cuh)
__device__ __forceinline__ void scores(float (&s)[M_TILES][BLOCK_N / 8][4],
                                       const u32 (&q_frag)[HEAD_DIM / 16], u32 ks,
                                       const BOffsets& off) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n)
            s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        u32 qf[M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            ldmatrix_x4(q_frag[kk] + mt * (16 * HEAD_DIM * 2), qf[mt][0], qf[mt][1],
                        qf[mt][2], qf[mt][3]);
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; n += 2) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(ks + off.abt(kk) + n * (8 * HEAD_DIM * 2), b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(s[mt][n], qf[mt], b0, b1);
                mma_16816(s[mt][n + 1], qf[mt], b2, b3);
            }
        }
    }
}
// ANCHOR_END: ldmatrix_scores

// o += p·v: p goes from the accumulators to A fragments in registers (accumulators_to_a);
// the B fragments of v come from the transposing ldmatrix, each serving all M_TILES row
// tiles
__device__ __forceinline__ void accumulate_pv(Rows& rows,
                                              const float (&p)[M_TILES][BLOCK_N / 8][4],
                                              u32 vs, const BOffsets& off) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        u32 pa[M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            accumulators_to_a(p[mt][2 * kk], p[mt][2 * kk + 1], pa[mt]);
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; n += 2) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4_trans(vs + off.ab(n / 2) + kk * (16 * HEAD_DIM * 2), b0, b1, b2,
                              b3);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(rows.o[mt][n], pa[mt], b0, b1);
                mma_16816(rows.o[mt][n + 1], pa[mt], b2, b3);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) ladder_ldmatrix(
    const u16* __restrict__ q,  // [B*H, T, HEAD_DIM] queries, bf16 or f16 bits
    const u16* __restrict__ k,  // [B*H, T, HEAD_DIM] keys
    const u16* __restrict__ v,  // [B*H, T, HEAD_DIM] values
    u16* __restrict__ out,      // [B*H, T, HEAD_DIM] output
    float* __restrict__ lse,    // [B*H, T] natural log-sum-exp of each row's scaled scores
    int T,            // tokens per sequence; the grid has ceil(T / BLOCK_M) blocks a head
    float scale_log2  // log2(e)/sqrt(HEAD_DIM): scores in base-2 units, for ex2
) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sq = smem;                     // [BLOCK_M][HEAD_DIM], swizzled
    u16* sk = sq + BLOCK_M * HEAD_DIM;  // [BLOCK_N][HEAD_DIM], one stage
    u16* sv = sk + BLOCK_N * HEAD_DIM;  // [BLOCK_N][HEAD_DIM]

    // grid order: head after head, and within a head the first (shortest) query block first
    const int q_blocks = (T + BLOCK_M - 1) / BLOCK_M;
    const int bh = blockIdx.x / q_blocks;
    const int q0 = (blockIdx.x % q_blocks) * BLOCK_M;
    const long long head = (long long)bh * T * HEAD_DIM;
    q += head;
    k += head;
    v += head;
    out += head;
    lse += (long long)bh * T;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int row0 = q0 + warp * WARP_ROWS;
    const int n_blocks = (min(q0 + BLOCK_M, T) + BLOCK_N - 1) / BLOCK_N;

    u32 q_frag[HEAD_DIM / 16];
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
        q_frag[kk] =
            smem_addr(sq + swizzled(warp * WARP_ROWS + (lane & 15), 2 * kk + (lane >> 4)));
    const BOffsets off(lane);
    const u32 ks = smem_addr(sk), vs = smem_addr(sv);

    Rows rows;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        rows.m[mt][0] = rows.m[mt][1] = NEG_INF;
        rows.l[mt][0] = rows.l[mt][1] = 0.f;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            rows.o[mt][n][0] = rows.o[mt][n][1] = rows.o[mt][n][2] = rows.o[mt][n][3] = 0.f;
    }

    load_tile<BLOCK_M>(sq, q, q0, T);
    for (int j = 0; j < n_blocks; ++j) {
        const int kv0 = j * BLOCK_N;
        // every warp is done with the previous block before it is overwritten
        __syncthreads();
        load_tile<BLOCK_N>(sk, k, kv0, T);
        load_tile<BLOCK_N>(sv, v, kv0, T);
        // the block (and, the first time, q) is in shared memory for every warp; until then
        // the tensor cores have nothing to do
        __syncthreads();
        // a warp whose rows all come before this block's first key has nothing to add
        if (kv0 <= row0 + WARP_ROWS - 1) {
            float s[M_TILES][BLOCK_N / 8][4];
            scores(s, q_frag, ks, off);
            mask(s, kv0, row0, g, t);
            online_softmax(s, rows, scale_log2);
            accumulate_pv(rows, s, vs, off);
        }
    }

    store_rows(rows, out, lse, row0, T, g, t, scale_log2);
}
