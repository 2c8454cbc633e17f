// The masked forward on step 03's kernel (flash_forward.cu): mma.sync, ldmatrix and
// cp.async, so it runs on any GPU from Ampere (compute capability 8.0). After step 03's
// tensor_cores.cuh, the mask's source and masked.cuh. What changes, as step 06's rungs
// changed in masked_1_wgmma.cu: the blocks of keys come from the block mask's list (an
// empty block is never loaded), the score function applies to every block and the mask
// only to the partial ones, k and v have their own length tk ≥ tq (query row r sits at
// position r + tk − tq), and a row that sees no key ends with an output of 0 and a
// log-sum-exp of −∞.
//
// Compile-time parameters, given to NVRTC as -D options by src/cuda_ampere.rs:
//   HEAD_DIM  64 or 128
//   IS_BF16   1 for bf16 inputs and output, 0 for f16

// Step 03's tile at each head dim: 4 warps of 32 query rows; up to head dim 64, 128 keys a
// block, at 128, 64 keys a block taken 32 at a time. Up to 64 the block's keys go 64 at a
// time, where step 03 takes them all at once: the mask's bounds or bits and the score
// function's temporaries take registers that step 03's 128 scores at once left no room for
// (ptxas spills them).
#define WARPS 4    // warps per block
#define M_TILES 2  // 16-row tiles of queries per warp
// keys per block, copied into shared memory together
#define BLOCK_N (HEAD_DIM <= 64 ? 128 : 64)
// keys per step of the products and the softmax within a block
#define SUB_N (HEAD_DIM <= 64 ? 64 : 32)
#define MIN_BLOCKS 1  // blocks per multiprocessor the register budget must allow
static_assert(BLOCK_N % SUB_N == 0 && SUB_N % 16 == 0,
              "SUB_N keys a step, a multiple of 16 that divides BLOCK_N");
// query rows per warp: M_TILES tiles of 16
#define WARP_ROWS (M_TILES * 16)
#define BLOCK_M (WARPS * WARP_ROWS)
#define THREADS (WARPS * 32)
// The list's blocks: 128 keys (block_mask.cu's TILE_K) for each block of BLOCK_M queries
// (two of its tiles of 64: the lists are made with WGS = 2), taken BLOCK_N keys a step
#define LIST_N 128
#define STEPS (LIST_N / BLOCK_N)
static_assert(BLOCK_M == 128, "a block of queries is the lists' block: two tiles of 64");

// ROWS rows of a [T, HEAD_DIM] matrix from row `row0` into a swizzled tile; rows past T are
// 0 (load_rows in tensor_cores.cuh)
template <int ROWS>
__device__ __forceinline__ void load_tile(u16* tile, const u16* src, int row0, int T) {
    load_rows<ROWS, THREADS>(tile, src, row0, T);
}

// A lane's ldmatrix addresses of the A fragments of 16 rows of a tile, rows row0 + lane %
// 16, chunk 2kk + lane / 16 for the columns 16kk..16kk+15: one register for each 16 columns
struct AAddresses {
    u32 at_[HEAD_DIM / 16];
    __device__ __forceinline__ AAddresses(const u16* tile, int row0, int lane) {
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            at_[kk] = smem_addr(tile + swizzled(row0 + (lane & 15), 2 * kk + (lane >> 4)));
    }
    __device__ __forceinline__ u32 operator()(int kk) const { return at_[kk]; }
};
// The same with one offset, stepped by xor_step, and the tile's address
struct XorAAddresses {
    u32 off_, tile_;
    __device__ __forceinline__ XorAAddresses(const u16* tile, int row0, int lane)
        : off_(2 * swizzled(row0 + (lane & 15), lane >> 4)), tile_(smem_addr(tile)) {}
    __device__ __forceinline__ u32 operator()(int kk) const {
        return tile_ + xor_step(off_, kk);
    }
};
// The addresses and offsets a lane holds: one register for each 16 columns, or, at head dim
// 128 (where the output alone takes 128 registers a thread), one for each operand
template <bool XOR> struct Offsets {
    typedef AAddresses A;
    typedef BOffsets B;
};
template <> struct Offsets<true> {
    typedef XorAAddresses A;
    typedef XorBOffsets B;
};

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) masked_forward(
    const u16* __restrict__ q,   // [batch · heads, tq, HEAD_DIM] queries
    const u16* __restrict__ k,   // [batch · heads / q_per_kv, tk, HEAD_DIM] keys
    const u16* __restrict__ v,   // [batch · heads / q_per_kv, tk, HEAD_DIM] values
    u16* __restrict__ out,       // [batch · heads, tq, HEAD_DIM] output
    float* __restrict__ lse,     // [batch · heads, tq] natural log-sum-exps (−∞: no key)
    int tq,                      // q's length
    int tk,                      // k's and v's length, tq or more
    int heads,                   // query heads a sequence
    int batch_heads,             // batch · heads
    int q_per_kv,                // query heads per head of k and v
    const BlockList list,        // the blocks of keys each block of queries sees
    const int* __restrict__ mask_data,  // the mask's data (document ids), or null
    float scale,                 // 1/√d: the scores the score function sees
    float scale_log2             // log2(e)/√d: scores in base-2 units
) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sq = smem;                         // [BLOCK_M][HEAD_DIM]
    u16* sk = sq + BLOCK_M * HEAD_DIM;      // [2][BLOCK_N][HEAD_DIM], two stages
    u16* sv = sk + 2 * BLOCK_N * HEAD_DIM;  // [2][BLOCK_N][HEAD_DIM]

    // step 03's order with every head in one group: the last query blocks of every head
    // first
    const int q_blocks = (tq + BLOCK_M - 1) / BLOCK_M;
    const int bh = blockIdx.x % batch_heads;
    const int q_block = q_blocks - 1 - blockIdx.x / batch_heads;
    const int q0 = q_block * BLOCK_M;
    const int seq = bh / heads, qh = bh % heads;  // the sequence, its query head
    const long long head = (long long)bh * tq * HEAD_DIM;
    // grouped-query attention: query head bh reads head bh / q_per_kv of k and v
    const long long kv_head = (long long)(bh / q_per_kv) * tk * HEAD_DIM;
    const int row = list.row(seq, qh), n_blocks = list.n(row, q_block);
    const int steps = n_blocks * STEPS;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;    // fragment row and column pair (see mma_16816)
    const int row0 = q0 + warp * WARP_ROWS;   // this warp's first query row

    // two groups of copies in flight before the loop: q, then the first listed block's
    // first keys and values; a block of queries that sees no key loads nothing
    int entry = 0;  // the list's entry of this step's block: its number · 2, + 1 when full
    if (steps > 0) {
        entry = list.at(row, q_block, 0);
        load_tile<BLOCK_M>(sq, q + head, q0, tq);
        cp_async_commit();
        load_tile<BLOCK_N>(sk, k + kv_head, (entry >> 1) * LIST_N, tk);
        load_tile<BLOCK_N>(sv, v + kv_head, (entry >> 1) * LIST_N, tk);
        cp_async_commit();
    }

    const Offsets<HEAD_DIM == 128>::A q_at(sq, warp * WARP_ROWS, lane);
    const Offsets<HEAD_DIM == 128>::B off(lane);
    const u32 sk_addr = smem_addr(sk), sv_addr = smem_addr(sv);

    float m[M_TILES][2], l[M_TILES][2];
    float o[M_TILES][HEAD_DIM / 8][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        m[mt][0] = m[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n)
            o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    }

    // the mask: each 16-row tile's interval of keys (an interval mask), found once, or the
    // bits of its partial block's visible scores (any other), asked once a block
    const MaskArgs args{mask_data, seq, qh, tk - tq, tk};
    RowKeys keys[M_TILES];
    u64 bits[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        keys[mt] = row_keys(row0 + mt * 16 + g, args);
        bits[mt] = ~0ull;
    }
    // with a score function the scores are in natural units (scaled by 1/√d), else raw
    const float exp_scale = SCORE_MOD_IDENTITY ? scale_log2 : LOG2E;

    for (int j = 0; j < steps; ++j) {
        const int stage = j & 1;
        const int kv0 = (entry >> 1) * LIST_N + (j % STEPS) * BLOCK_N;
        const bool partial = (entry & 1) == 0;
        // start copying the next step's keys into the other stage while this one is
        // computed on: the block's next BLOCK_N, or the list's next block
        int next = entry;
        if (j + 1 < steps) {
            if ((j + 1) % STEPS == 0) next = list.at(row, q_block, (j + 1) / STEPS);
            const int next0 = (next >> 1) * LIST_N + ((j + 1) % STEPS) * BLOCK_N;
            load_tile<BLOCK_N>(sk + (stage ^ 1) * BLOCK_N * HEAD_DIM, k + kv_head, next0,
                               tk);
            load_tile<BLOCK_N>(sv + (stage ^ 1) * BLOCK_N * HEAD_DIM, v + kv_head, next0,
                               tk);
        }
        cp_async_commit();
        // everything but the copy just issued has landed: q (on the first pass) and this
        // block
        cp_async_wait<1>();
        __syncthreads();
        // a mask asked score by score is asked before the block's products, while their
        // registers are free (masked.cuh's visible_bits)
        if (!MASK_INTERVAL && partial && j % STEPS == 0) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                bits[mt] = visible_bits((entry >> 1) * LIST_N, row0 + mt * 16 + g, lane,
                                        args);
        }

#pragma unroll
        for (int sub = 0; sub < BLOCK_N / SUB_N; ++sub) {
            const int kv = kv0 + sub * SUB_N;  // this step's first key
            if (kv >= tk) continue;  // keys past tk (the last block's end at head dim 128)
            const u32 ks =
                sk_addr + stage * (BLOCK_N * HEAD_DIM * 2) + sub * (SUB_N * HEAD_DIM * 2);
            const u32 vs =
                sv_addr + stage * (BLOCK_N * HEAD_DIM * 2) + sub * (SUB_N * HEAD_DIM * 2);

            // s = q·kᵀ for the warp's rows x SUB_N keys, in 16x8 tiles (step 03's)
            float s[M_TILES][SUB_N / 8][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int n = 0; n < SUB_N / 8; ++n)
                    s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
                u32 qf[M_TILES][4];
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
                    ldmatrix_x4(q_at(kk) + mt * (16 * HEAD_DIM * 2), qf[mt][0], qf[mt][1],
                                qf[mt][2], qf[mt][3]);
#pragma unroll
                for (int n = 0; n < SUB_N / 8; n += 2) {
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4(ks + off.abt(kk) + n * (8 * HEAD_DIM * 2), b0, b1, b2, b3);
#pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) {
                        mma_16816(s[mt][n], qf[mt], b0, b1);
                        mma_16816(s[mt][n + 1], qf[mt], b2, b3);
                    }
                }
            }

            // ANCHOR: ampere_mods
            // the score function on every block, the mask on the partial ones only (where
            // step 03 masked the diagonal); the step's bits start (kv − the block's first
            // key) / 8 tiles of 4 into its block's
            const int shift = ((j % STEPS) * BLOCK_N + sub * SUB_N) / 2;
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                apply_mods_mma<SUB_N / 8>(s[mt], partial, bits[mt] >> shift, keys[mt], kv,
                                          row0 + mt * 16 + g, lane, scale, args);
            // ANCHOR_END: ampere_mods

#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float mx = m[mt][h];
#pragma unroll
                    for (int n = 0; n < SUB_N / 8; ++n)
                        mx = fmaxf(mx, fmaxf(s[mt][n][2 * h], s[mt][n][2 * h + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                    // a row still all −∞ (masked so far, or past tq) keeps its zeros
                    float m_scaled = mx == NEG_INF ? 0.f : mx * exp_scale;
                    float correction = fast_exp2(m[mt][h] * exp_scale - m_scaled);
                    m[mt][h] = mx;
                    l[mt][h] *= correction;
#pragma unroll
                    for (int n = 0; n < HEAD_DIM / 8; ++n) {
                        o[mt][n][2 * h] *= correction;
                        o[mt][n][2 * h + 1] *= correction;
                    }
#pragma unroll
                    for (int n = 0; n < SUB_N / 8; ++n) {
                        s[mt][n][2 * h] =
                            fast_exp2(fmaf(s[mt][n][2 * h], exp_scale, -m_scaled));
                        s[mt][n][2 * h + 1] =
                            fast_exp2(fmaf(s[mt][n][2 * h + 1], exp_scale, -m_scaled));
                        l[mt][h] += s[mt][n][2 * h] + s[mt][n][2 * h + 1];
                    }
                }

            // o += p·v (step 03's)
#pragma unroll
            for (int kk = 0; kk < SUB_N / 16; ++kk) {
                u32 pa[M_TILES][4];
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
                    accumulators_to_a(s[mt][2 * kk], s[mt][2 * kk + 1], pa[mt]);
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; n += 2) {
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4_trans(vs + off.ab(n / 2) + kk * (16 * HEAD_DIM * 2), b0, b1,
                                      b2, b3);
#pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) {
                        mma_16816(o[mt][n], pa[mt], b0, b1);
                        mma_16816(o[mt][n + 1], pa[mt], b2, b3);
                    }
                }
            }
        }
        // every warp is done with this stage before the next iteration's copy overwrites it
        __syncthreads();
        entry = next;
    }

    // o / l, and the log-sum-exp, for the rows inside the sequence; a row that saw no key
    // (a sum of 0) is written as 0 with a log-sum-exp of −∞, as masked.cuh's end
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[mt][h];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            int r = row0 + mt * 16 + g + h * 8;
            if (r < tq) {
                float inv = sum > 0.f ? 1.f / sum : 0.f;
                u16* dst = out + head + (long long)r * HEAD_DIM + 2 * t;
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; ++n)
                    *(u32*)(dst + n * 8) =
                        pack2(o[mt][n][2 * h] * inv, o[mt][n][2 * h + 1] * inv);
                // ln(sum e^s') = (m·exp_scale + log2 l) · ln 2
                if (t == 0)
                    lse[(long long)bh * tq + r] =
                        sum > 0.f ? (m[mt][h] * exp_scale + __log2f(sum)) * 0.6931471805599453f
                                  : -INFINITY;
            }
        }
}
