// Rung 3 of the ladder: the products on the tensor cores.
//
// The tiles of the final kernel (flash_forward.cu): one thread block per BLOCK_M queries of
// a head, WARPS warps of WARP_ROWS rows each, keys and values BLOCK_N at a time in shared
// memory, q·kᵀ and p·v as mma.sync m16n8k16 (mma_16816 in tensor_cores.cuh), the online
// softmax on the accumulators in registers. Each thread builds its own fragments with plain
// loads from tiles stored row by row, as the PTX ISA lays the fragments out. What this rung
// does not do yet: read its fragments in fewer instructions and without bank conflicts
// (rung 4, ldmatrix from swizzled tiles), and overlap the copies with the products (rung 5,
// flash_forward.cu). Each step copies its block of keys and values into shared memory,
// waits at a barrier for the whole block to arrive, computes, and waits again before the
// next copy, so the tensor cores idle while the copies are in flight. And blocks run in
// grid order, each head's shortest query block first.
//
// Compile-time parameters, every one given to NVRTC as a -D option by src/ladder.rs (the
// final kernel's tile as src/kernel.rs gives it for the head dim, rung 4 and 5's):
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

// ANCHOR: sync_load_tile
// Copies ROWS rows of a [T, HEAD_DIM] matrix starting at row `row0` into a tile, row by
// row, through registers: a 16-byte load from global memory, then a 16-byte store to shared
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
        *(uint4*)(tile + r * HEAD_DIM + chunk * 8) = x;
    }
}
// ANCHOR_END: sync_load_tile

// ANCHOR: fragment_loads
// The fragments of mma_16816 (tensor_cores.cuh), each thread reading its own from a tile
// stored row by row, HEAD_DIM values a row, with g = lane / 4 and t = lane % 4. A register
// holds two 16-bit values of neighbouring columns of one row of the operand.
__device__ __forceinline__ u32 load_pair(const u16* p) { return *(const u32*)p; }

// A, 16 rows of a tile (q in q·kᵀ): a0 and a2 are columns 2t, 2t + 1 and 2t + 8, 2t + 9 of
// row g, a1 and a3 the same of row g + 8. The pairs sit side by side in the tile: one
// 32-bit load each. `p` is &tile[first row + g][first column + 2t].
__device__ __forceinline__ void load_a(const u16* p, u32 (&a)[4]) {
    a[0] = load_pair(p);
    a[1] = load_pair(p + 8 * HEAD_DIM);
    a[2] = load_pair(p + 8);
    a[3] = load_pair(p + 8 * HEAD_DIM + 8);
}

// B of a·tileᵀ, 8 rows of the tile as its 8 columns (k in q·kᵀ, b[i][j] = k[j][i]): b0 is
// rows 2t, 2t + 1 of b's column g, that is columns 2t, 2t + 1 of the tile's row g, side by
// side; b1 the same 8 columns further. `p` is &tile[first key + g][first column + 2t].
__device__ __forceinline__ void load_b_rows(const u16* p, u32& b0, u32& b1) {
    b0 = load_pair(p);
    b1 = load_pair(p + 8);
}

// B of a·tile, 16 rows of the tile as its 16 rows (v in p·v, b = v): b0 is rows 2t and 2t +
// 1 of column g, two values a whole row apart in the tile, so two 16-bit loads packed into
// one register, the lower row in the low half; b1 the same 8 rows further. `p` is
// &tile[first key + 2t][first column + g].
__device__ __forceinline__ void load_b_cols(const u16* p, u32& b0, u32& b1) {
    b0 = p[0] | (u32)p[HEAD_DIM] << 16;
    b1 = p[8 * HEAD_DIM] | (u32)p[9 * HEAD_DIM] << 16;
}
// ANCHOR_END: fragment_loads

// ANCHOR: plain_scores
// s = q·kᵀ for the warp's rows and the block's BLOCK_N keys, in 16x8 tiles; each B fragment
// of k serves all M_TILES row tiles. qa is this lane's &sq[first row of the warp + g][2t],
// kb its &sk[g][2t]: every other fragment is at a constant offset from them.
__device__ __forceinline__ void scores(float (&s)[M_TILES][BLOCK_N / 8][4], const u16* qa,
                                       const u16* kb) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n)
            s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
    // (a loop, not unrolled: unrolled, the compiler starts the loads of the next 16
    // columns early, and next to the 128 scores and 64 outputs of head dim 64 that spills)
#pragma unroll 1
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        u32 qf[M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            load_a(qa + mt * 16 * HEAD_DIM + kk * 16, qf[mt]);
#pragma unroll
        for (int n = 0; n < BLOCK_N / 8; ++n) {
            u32 b0, b1;
            load_b_rows(kb + n * 8 * HEAD_DIM + kk * 16, b0, b1);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) mma_16816(s[mt][n], qf[mt], b0, b1);
        }
    }
}
// ANCHOR_END: plain_scores

// o += p·v: p goes from the accumulators to A fragments in registers (accumulators_to_a);
// each B fragment of v serves all M_TILES row tiles. vb is this lane's &sv[2t][g].
__device__ __forceinline__ void
accumulate_pv(Rows& rows, const float (&p)[M_TILES][BLOCK_N / 8][4], const u16* vb) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        u32 pa[M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            accumulators_to_a(p[mt][2 * kk], p[mt][2 * kk + 1], pa[mt]);
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n) {
            u32 b0, b1;
            load_b_cols(vb + kk * 16 * HEAD_DIM + n * 8, b0, b1);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) mma_16816(rows.o[mt][n], pa[mt], b0, b1);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) ladder_mma(
    const u16* __restrict__ q,  // [B*H, T, HEAD_DIM] queries, bf16 or f16 bits
    const u16* __restrict__ k,  // [B*H, T, HEAD_DIM] keys
    const u16* __restrict__ v,  // [B*H, T, HEAD_DIM] values
    u16* __restrict__ out,      // [B*H, T, HEAD_DIM] output
    float* __restrict__ lse,    // [B*H, T] natural log-sum-exp of each row's scaled scores
    int T,            // tokens per sequence; the grid has ceil(T / BLOCK_M) blocks a head
    float scale_log2  // log2(e)/sqrt(HEAD_DIM): scores in base-2 units, for ex2
) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sq = smem;                     // [BLOCK_M][HEAD_DIM], row by row
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

    // each lane's first element of each operand's fragments
    const u16* qa = sq + (warp * WARP_ROWS + g) * HEAD_DIM + 2 * t;
    const u16* kb = sk + g * HEAD_DIM + 2 * t;
    const u16* vb = sv + 2 * t * HEAD_DIM + g;

    Rows rows;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        rows.m[mt][0] = rows.m[mt][1] = NEG_INF;
        rows.l[mt][0] = rows.l[mt][1] = 0.f;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            rows.o[mt][n][0] = rows.o[mt][n][1] = rows.o[mt][n][2] = rows.o[mt][n][3] = 0.f;
    }

    // ANCHOR: sync_loop
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
            scores(s, qa, kb);
            mask(s, kv0, row0, g, t);
            online_softmax(s, rows, scale_log2);
            accumulate_pv(rows, s, vb);
        }
    }
    // ANCHOR_END: sync_loop

    store_rows(rows, out, lse, row0, T, g, t, scale_log2);
}
