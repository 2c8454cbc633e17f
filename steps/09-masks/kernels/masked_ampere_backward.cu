// The masked backward on step 04's kernels (flash_backward.cu): mma.sync, ldmatrix and
// cp.async, so it runs on any GPU from Ampere. After step 03's tensor_cores.cuh, the mask's
// source and masked.cuh. Three kernels, each block writing only its own rows, as step 04's:
//   backward_delta  δ = rowsum(dO ∘ O), once per row
//   masked_dkdv     one block per 128 keys of a query head: the query tiles the backward's
//                   list names stream past (64 a stage: the list's tiles)
//   masked_dq       one block per 128 queries: the key blocks the forward's list names
//                   stream past, 64 keys a stage
// What changes, as in masked_backward.cu: only listed blocks are loaded, P goes through the
// score function and dS through its derivative in every block, the mask applies in partial
// blocks only, k and v have their own length tk ≥ tq (query row r at position r + tk − tq),
// and a row that saw no key (a log-sum-exp of −∞) passes no gradient back.
//
// Compile-time parameters, given to NVRTC as -D options by src/cuda_ampere.rs:
//   HEAD_DIM  64 or 128
//   IS_BF16   1 for bf16, 0 for f16

// Step 04's shape at head dim 128, eight warps of 16 rows, at both head dims: at 64 its
// four warps of 32 rows leave dK/dV's threads no registers for the mask (ptxas spills
// them); each warp's rows' two operands held as A fragments for the whole loop
#define WARPS 8
#define M_TILES 1
// queries streamed past dkdv's keys per stage: one of the backward list's tiles of 64
#define DKDV_STREAM 64
// keys streamed past dq's queries per stage: half a block of the forward list's 128
#define DQ_STREAM 64
#define DKDV_SUB 16  // queries per step of dkdv's inner loop
#define DQ_SUB 32    // keys per step of dq's inner loop
// blocks per multiprocessor the register budget must allow: one, 255 registers a thread
#define DKDV_MIN_BLOCKS 1
#define DQ_MIN_BLOCKS 1
static_assert(DKDV_STREAM % DKDV_SUB == 0 && DQ_STREAM % DQ_SUB == 0,
              "steps that divide the stages");
#define THREADS (WARPS * 32)
#define WARP_ROWS (M_TILES * 16)        // keys (dkdv) or queries (dq) per warp
#define BLOCK_ROWS (WARPS * WARP_ROWS)  // keys (dkdv) or queries (dq) per thread block
#define ROW_BYTES (HEAD_DIM * 2)
#define POS_INF __int_as_float(0x7f800000)
// the forward list's blocks of keys (block_mask.cu's TILE_K), DQ_STREAM a stage
#define LIST_N 128
#define DQ_STEPS (LIST_N / DQ_STREAM)
static_assert(DKDV_STREAM == 64, "a stage of queries is one of the block mask's tiles, "
                                  "visible_bits_t's 64 queries");
static_assert(BLOCK_ROWS == 128,
              "128 keys a block (the backward list's), 128 queries (the forward list's)");

__device__ __forceinline__ float lo16(u32 x) {
    if constexpr (IS_BF16) {
        return __uint_as_float(x << 16);
    } else {
        float f;
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }\n"
            : "=f"(f)
            : "r"(x));
        return f;
    }
}
__device__ __forceinline__ float hi16(u32 x) {
    if constexpr (IS_BF16) {
        return __uint_as_float(x & 0xffff0000u);
    } else {
        float f;
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }\n"
            : "=f"(f)
            : "r"(x));
        return f;
    }
}

// ROWS rows of a [T, HEAD_DIM] matrix from row `row0` into a swizzled tile; rows past T are
// 0 (load_rows in tensor_cores.cuh)
template <int ROWS>
__device__ __forceinline__ void load_tile(u16* tile, const u16* src, int row0, int T) {
    load_rows<ROWS, THREADS>(tile, src, row0, T);
}

// A fragments of this warp's rows of a tile (rows WARP_ROWS·warp ..), per 16-row tile and
// 16 columns
__device__ __forceinline__ void load_a(const u16* tile, int warp, int lane,
                                       u32 (&f)[M_TILES][HEAD_DIM / 16][4]) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            ldmatrix_x4(smem_addr(tile + swizzled(warp * WARP_ROWS + mt * 16 + (lane & 15),
                                                  2 * kk + (lane >> 4))),
                        f[mt][kk][0], f[mt][kk][1], f[mt][kk][2], f[mt][kk][3]);
}

// acc[mt][n] += a[mt] · tileᵀ for the tile's rows r0 .. r0 + COLS - 1 as the columns, with
// a the A fragments of the warp's own rows, held in registers (load_a)
template <int COLS>
__device__ __forceinline__ void mma_abt(float (&acc)[M_TILES][COLS / 8][4],
                                        const u32 (&a)[M_TILES][HEAD_DIM / 16][4], u32 tile,
                                        int r0, const BOffsets& off) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#pragma unroll
        for (int n = 0; n < COLS / 8; n += 2) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(tile + off.abt(kk) + (r0 + n * 8) * ROW_BYTES, b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(acc[mt][n], a[mt][kk], b0, b1);
                mma_16816(acc[mt][n + 1], a[mt][kk], b2, b3);
            }
        }
    }
}

// acc[mt] += p[mt] · tile[r0 .. r0 + K - 1] for p the accumulators of a·bᵀ over K columns,
// turned into A fragments in registers (two neighbouring 16x8 tiles make one 16x16 A tile)
template <int K>
__device__ __forceinline__ void mma_pb(float (&acc)[M_TILES][HEAD_DIM / 8][4],
                                       const float (&p)[M_TILES][K / 8][4], u32 tile,
                                       int r0, const BOffsets& off) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        u32 a[M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
            accumulators_to_a(p[mt][2 * kk], p[mt][2 * kk + 1], a[mt]);
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; n += 2) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4_trans(tile + off.ab(n / 2) + (r0 + kk * 16) * ROW_BYTES, b0, b1, b2,
                              b3);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(acc[mt][n], a[mt], b0, b1);
                mma_16816(acc[mt][n + 1], a[mt], b2, b3);
            }
        }
    }
}

template <int N>
__device__ __forceinline__ void zero(float (&x)[M_TILES][N][4]) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int n = 0; n < N; ++n)
            x[mt][n][0] = x[mt][n][1] = x[mt][n][2] = x[mt][n][3] = 0.f;
}

// this warp's rows row0 .. row0 + WARP_ROWS - 1 of acc · scale, those before T
__device__ __forceinline__ void store_rows(u16* dst,
                                           const float (&acc)[M_TILES][HEAD_DIM / 8][4],
                                           float scale, int row0, int g, int t, int T) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int row = row0 + mt * 16 + g + 8 * h;
            if (row < T) {
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; ++n)
                    *(u32*)(dst + (long long)row * HEAD_DIM + n * 8 + 2 * t) =
                        pack2(acc[mt][n][2 * h] * scale, acc[mt][n][2 * h + 1] * scale);
            }
        }
}

extern "C" __global__ void backward_delta(
    const u16* __restrict__ out,    // [rows, HEAD_DIM] the forward's output
    const u16* __restrict__ dout,   // [rows, HEAD_DIM] its gradient
    float* __restrict__ delta,      // [rows] sum_d dO·O
    long long rows                  // batch · heads · tq
) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const u32* o = (const u32*)(out + row * HEAD_DIM);
    const u32* d = (const u32*)(dout + row * HEAD_DIM);
    float sum = 0.f;
    for (int i = lane; i < HEAD_DIM / 2; i += 32)
        sum += lo16(o[i]) * lo16(d[i]) + hi16(o[i]) * hi16(d[i]);
    for (int offset = 16; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(0xffffffff, sum, offset);
    if (lane == 0) delta[row] = sum;
}

// A row's log-sum-exp in base 2, as the probabilities take it: +∞ for a row past tq or one
// that saw no key (−∞), so that its probabilities are 0
__device__ __forceinline__ float lse_base2(const float* lse, int row, int tq) {
    const float l = row < tq ? lse[row] : POS_INF;
    return l == -INFINITY ? POS_INF : l * LOG2E;
}

// Stage `stage` of the queries' tiles: rows q0 .. q0 + DKDV_STREAM - 1 of q and dO
// (cp.async), and their log-sum-exp in base 2 and δ
__device__ __forceinline__ void load_queries(u16* sq, u16* sdo, float* slse, float* sdelta,
                                             const u16* q, const u16* dout,
                                             const float* lse, const float* delta, int q0,
                                             int tq) {
    load_tile<DKDV_STREAM>(sq, q, q0, tq);
    load_tile<DKDV_STREAM>(sdo, dout, q0, tq);
    for (int i = threadIdx.x; i < DKDV_STREAM; i += THREADS) {
        bool valid = q0 + i < tq;
        slse[i] = lse_base2(lse, q0 + i, tq);
        sdelta[i] = valid ? delta[q0 + i] : 0.f;
    }
}

// pT = e^(score_mod(sT/√d) − lse) for a warp's keys and DKDV_SUB queries from column c0 of
// the stage (queries q0 + c0 ..), 0 where the mask's bits say so, and dsT = pT ∘ g ∘ (dpT −
// δ) in place, g the score function's derivative (step 04's dkdv_probabilities, its causal
// test become the bits)
__device__ __forceinline__ void
dkdv_probabilities(float (&p)[M_TILES][DKDV_SUB / 8][4],
                   float (&dp)[M_TILES][DKDV_SUB / 8][4], const float* tl, const float* td,
                   int c0, int q0, int key0, const u32 (&bits)[M_TILES], float scale,
                   float exp_scale, int g, int t, const MaskArgs& a) {
#pragma unroll
    for (int n = 0; n < DKDV_SUB / 8; ++n) {
        const int col = c0 + n * 8 + 2 * t;  // this thread's two queries: col, col + 1
        const float2 l2 = *(const float2*)(tl + col), d2 = *(const float2*)(td + col);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float s = p[mt][n][e], grad = 1.f;
                if constexpr (!SCORE_MOD_IDENTITY) {
                    const int key = key0 + mt * 16 + g + 8 * (e >> 1);
                    const int qp = q0 + col + (e & 1) + a.q_offset;
                    grad = score_mod_grad(s * scale, a.b, a.h, qp, key);
                    s = score_mod(s * scale, a.b, a.h, qp, key);
                }
                float pe = fast_exp2(fmaf(s, exp_scale, -((e & 1) ? l2.y : l2.x)));
                if (!((bits[mt] >> (c0 / 2 + 4 * n + e)) & 1)) pe = 0.f;
                p[mt][n][e] = pe;
                dp[mt][n][e] = pe * grad * (dp[mt][n][e] - ((e & 1) ? d2.y : d2.x));
            }
    }
}

// dK and dV for keys BLOCK_ROWS·blockIdx.y .. of query head blockIdx.x, written for that
// query head (the host adds up each group's with step 04's backward_group_sum)
extern "C" __global__ void __launch_bounds__(THREADS, DKDV_MIN_BLOCKS) masked_dkdv(
    const u16* __restrict__ q,        // [batch · heads, tq, D]
    const u16* __restrict__ k,        // [batch · heads / q_per_kv, tk, D]
    const u16* __restrict__ v,        // [batch · heads / q_per_kv, tk, D]
    const u16* __restrict__ dout,     // [batch · heads, tq, D] gradient of the output
    const float* __restrict__ lse,    // [batch · heads, tq] the forward's log-sum-exps
    const float* __restrict__ delta,  // [batch · heads, tq] from backward_delta
    u16* __restrict__ dk,             // [batch · heads, tk, D] for each query head
    u16* __restrict__ dv,             // [batch · heads, tk, D] likewise
    int tq,                           // q's length
    int tk,                           // k's and v's length, tq or more
    int heads,                        // query heads a sequence
    int q_per_kv,                     // query heads per head of k and v
    const BlockList list,             // the query tiles each block of keys meets
    const int* __restrict__ mask_data,  // the mask's data (document ids), or null
    float scale                       // 1/√d
) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sk = smem;  // [BLOCK_ROWS][HEAD_DIM], read into registers once
    u16* sv = sk + BLOCK_ROWS * HEAD_DIM;
    u16* sq = sv + BLOCK_ROWS * HEAD_DIM;       // [2][DKDV_STREAM][HEAD_DIM], two stages
    u16* sdo = sq + 2 * DKDV_STREAM * HEAD_DIM;      // [2][DKDV_STREAM][HEAD_DIM]
    float* slse = (float*)(sdo + 2 * DKDV_STREAM * HEAD_DIM);  // [2][DKDV_STREAM]
    float* sdelta = slse + 2 * DKDV_STREAM;                    // [2][DKDV_STREAM]

    const int bh = blockIdx.x, kb = blockIdx.y;
    const int seq = bh / heads, qh = bh % heads;  // the sequence, its query head
    q += (long long)bh * tq * HEAD_DIM;
    dout += (long long)bh * tq * HEAD_DIM;
    // grouped-query attention: query head bh reads head bh / q_per_kv of k and v
    k += (long long)(bh / q_per_kv) * tk * HEAD_DIM;
    v += (long long)(bh / q_per_kv) * tk * HEAD_DIM;
    dk += (long long)bh * tk * HEAD_DIM;
    dv += (long long)bh * tk * HEAD_DIM;
    lse += (long long)bh * tq;
    delta += (long long)bh * tq;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int kv0 = kb * BLOCK_ROWS,
              key0 = kv0 + warp * WARP_ROWS;  // this warp's first key
    const float exp_scale = SCORE_MOD_IDENTITY ? scale * LOG2E : LOG2E;
    const BOffsets off(lane);
    const MaskArgs args{mask_data, seq, qh, tk - tq, tk};
    const int row = list.row(seq, qh), n_tiles = list.n(row, kb);

    float dk_acc[M_TILES][HEAD_DIM / 8][4], dv_acc[M_TILES][HEAD_DIM / 8][4];
    zero(dk_acc);
    zero(dv_acc);

    // keys no query sees are never loaded: their gradients are zeros
    if (n_tiles > 0) {
        int entry = list.at(row, kb, 0);  // a query tile's number · 2, + 1 when full
        load_tile<BLOCK_ROWS>(sk, k, kv0, tk);
        load_tile<BLOCK_ROWS>(sv, v, kv0, tk);
        cp_async_commit();
        load_queries(sq, sdo, slse, sdelta, q, dout, lse, delta, (entry >> 1) * DKDV_STREAM,
                     tq);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        u32 kf[M_TILES][HEAD_DIM / 16][4], vf[M_TILES][HEAD_DIM / 16][4];
        load_a(sk, warp, lane, kf);
        load_a(sv, warp, lane, vf);

        for (int j = 0; j < n_tiles; ++j) {
            const int stage = j & 1, q0 = (entry >> 1) * DKDV_STREAM;
            // the next listed tile's copy runs while this one is computed on
            int next = entry;
            if (j + 1 < n_tiles) {
                next = list.at(row, kb, j + 1);
                load_queries(sq + (stage ^ 1) * DKDV_STREAM * HEAD_DIM,
                             sdo + (stage ^ 1) * DKDV_STREAM * HEAD_DIM,
                             slse + (stage ^ 1) * DKDV_STREAM,
                             sdelta + (stage ^ 1) * DKDV_STREAM, q, dout, lse, delta,
                             (next >> 1) * DKDV_STREAM, tq);
            }
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            const u32 tile_q = smem_addr(sq + stage * DKDV_STREAM * HEAD_DIM),
                      tile_do = smem_addr(sdo + stage * DKDV_STREAM * HEAD_DIM);
            const float* tl = slse + stage * DKDV_STREAM;
            const float* td = sdelta + stage * DKDV_STREAM;
            // a full tile lets every score through
            u32 bits[M_TILES];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
                bits[mt] = entry & 1 ? 0xffffffffu
                                     : visible_bits_t(q0, key0 + mt * 16 + g, lane, args);

            // one step at a time, where step 04 unrolls them: unrolled, their addresses
            // held at once leave a score function's temporaries at head dim 128 two
            // registers short (ptxas spills 8 bytes)
#pragma unroll 1
            for (int sub = 0; sub < DKDV_STREAM / DKDV_SUB; ++sub) {
                const int c0 = sub * DKDV_SUB, qs0 = q0 + c0;
                if (qs0 >= tq) continue;  // queries past tq
                // sT = k·qᵀ (this warp's keys x DKDV_SUB queries) and dpT = v·dOᵀ
                float p[M_TILES][DKDV_SUB / 8][4], dp[M_TILES][DKDV_SUB / 8][4];
                zero(p);
                zero(dp);
                mma_abt<DKDV_SUB>(p, kf, tile_q, c0, off);
                mma_abt<DKDV_SUB>(dp, vf, tile_do, c0, off);
                dkdv_probabilities(p, dp, tl, td, c0, q0, key0, bits, scale, exp_scale, g,
                                   t, args);
                mma_pb<DKDV_SUB>(dv_acc, p, tile_do, c0, off);  // dV += pT · dO
                mma_pb<DKDV_SUB>(dk_acc, dp, tile_q, c0,
                                 off);  // dK += dsT · q   (· scale at the end)
            }
            // every warp is done with this stage before the next iteration's copy
            // overwrites it
            __syncthreads();
            entry = next;
        }
    }
    store_rows(dk, dk_acc, scale, key0, g, t, tk);
    store_rows(dv, dv_acc, 1.f, key0, g, t, tk);
}

// ds = p ∘ g ∘ (dp − δ) in place, p = e^(score_mod(s/√d) − lse), for a warp's rows and
// DQ_SUB keys from ks0; in a partial block 0 where the mask says so: the rows' intervals,
// or the bits (masked.cuh's visible_bits of the block, from this step's first key)
__device__ __forceinline__ void
dq_probabilities(float (&s)[M_TILES][DQ_SUB / 8][4],
                 const float (&dp)[M_TILES][DQ_SUB / 8][4], const float (&lse2)[M_TILES][2],
                 const float (&dl)[M_TILES][2], bool partial, const u64 (&bits)[M_TILES],
                 int shift, const RowKeys (&keys)[M_TILES], int ks0, int row0, float scale,
                 float exp_scale, int g, int t, const MaskArgs& a) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int n = 0; n < DQ_SUB / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e >> 1;
                const int key = ks0 + n * 8 + 2 * t + (e & 1);
                float x = s[mt][n][e], grad = 1.f;
                if constexpr (!SCORE_MOD_IDENTITY) {
                    const int qp = row0 + mt * 16 + g + 8 * h + a.q_offset;
                    grad = score_mod_grad(x * scale, a.b, a.h, qp, key);
                    x = score_mod(x * scale, a.b, a.h, qp, key);
                }
                float pe = fast_exp2(fmaf(x, exp_scale, -lse2[mt][h]));
                if (partial) {
                    const bool seen = MASK_INTERVAL
                                          ? key >= keys[mt].lo[h] && key <= keys[mt].hi[h]
                                          : (bits[mt] >> (shift + 4 * n + e)) & 1;
                    if (!seen) pe = 0.f;
                }
                s[mt][n][e] = pe * grad * (dp[mt][n][e] - dl[mt][h]);
            }
}

// dQ for queries BLOCK_ROWS·qb .. of head blockIdx.x; the last query blocks go first,
// every head's together
extern "C" __global__ void __launch_bounds__(THREADS, DQ_MIN_BLOCKS) masked_dq(
    const u16* __restrict__ q,        // [batch · heads, tq, D]
    const u16* __restrict__ k,        // [batch · heads / q_per_kv, tk, D]
    const u16* __restrict__ v,        // [batch · heads / q_per_kv, tk, D]
    const u16* __restrict__ dout,     // [batch · heads, tq, D]
    const float* __restrict__ lse,    // [batch · heads, tq]
    const float* __restrict__ delta,  // [batch · heads, tq]
    u16* __restrict__ dq,             // [batch · heads, tq, D]
    int tq,                           // q's length
    int tk,                           // k's and v's length, tq or more
    int heads,                        // query heads a sequence
    int q_per_kv,                     // query heads per head of k and v
    const BlockList list,             // the blocks of keys each block of queries sees
    const int* __restrict__ mask_data,  // the mask's data (document ids), or null
    float scale                       // 1/√d
) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sq = smem;  // [BLOCK_ROWS][HEAD_DIM], read into registers once
    u16* sdo = sq + BLOCK_ROWS * HEAD_DIM;
    u16* sk = sdo + BLOCK_ROWS * HEAD_DIM;    // [2][DQ_STREAM][HEAD_DIM], two stages
    u16* sv = sk + 2 * DQ_STREAM * HEAD_DIM;  // [2][DQ_STREAM][HEAD_DIM]

    const int bh = blockIdx.x, qb = gridDim.y - 1 - blockIdx.y;
    const int seq = bh / heads, qh = bh % heads;  // the sequence, its query head
    q += (long long)bh * tq * HEAD_DIM;
    dout += (long long)bh * tq * HEAD_DIM;
    dq += (long long)bh * tq * HEAD_DIM;
    k += (long long)(bh / q_per_kv) * tk * HEAD_DIM;
    v += (long long)(bh / q_per_kv) * tk * HEAD_DIM;
    lse += (long long)bh * tq;
    delta += (long long)bh * tq;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int q0 = qb * BLOCK_ROWS, row0 = q0 + warp * WARP_ROWS;
    const float exp_scale = SCORE_MOD_IDENTITY ? scale * LOG2E : LOG2E;
    const BOffsets off(lane);
    const MaskArgs args{mask_data, seq, qh, tk - tq, tk};
    const int row = list.row(seq, qh), steps = list.n(row, qb) * DQ_STEPS;

    float dq_acc[M_TILES][HEAD_DIM / 8][4];
    zero(dq_acc);

    // a block of queries that sees no key loads nothing: its dQ is 0
    if (steps > 0) {
        int entry = list.at(row, qb, 0);  // a block of keys' number · 2, + 1 when full
        load_tile<BLOCK_ROWS>(sq, q, q0, tq);
        load_tile<BLOCK_ROWS>(sdo, dout, q0, tq);
        cp_async_commit();
        load_tile<DQ_STREAM>(sk, k, (entry >> 1) * LIST_N, tk);
        load_tile<DQ_STREAM>(sv, v, (entry >> 1) * LIST_N, tk);
        cp_async_commit();
        // this thread's rows: lse in base 2, δ, and the mask's interval (an interval mask)
        float lse2[M_TILES][2], dl[M_TILES][2];
        RowKeys keys[M_TILES];
        u64 bits[M_TILES];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int r = row0 + mt * 16 + g + 8 * h;
                lse2[mt][h] = lse_base2(lse, r, tq);
                dl[mt][h] = r < tq ? delta[r] : 0.f;
            }
            keys[mt] = row_keys(row0 + mt * 16 + g, args);
            bits[mt] = ~0ull;
        }
        cp_async_wait<1>();
        __syncthreads();
        u32 qf[M_TILES][HEAD_DIM / 16][4], dof[M_TILES][HEAD_DIM / 16][4];
        load_a(sq, warp, lane, qf);
        load_a(sdo, warp, lane, dof);

        for (int j = 0; j < steps; ++j) {
            const int stage = j & 1;
            const int kv0 = (entry >> 1) * LIST_N + (j % DQ_STEPS) * DQ_STREAM;
            const bool partial = (entry & 1) == 0;
            // the block's next DQ_STREAM keys, or the list's next block
            int next = entry;
            if (j + 1 < steps) {
                if ((j + 1) % DQ_STEPS == 0) next = list.at(row, qb, (j + 1) / DQ_STEPS);
                const int next0 = (next >> 1) * LIST_N + ((j + 1) % DQ_STEPS) * DQ_STREAM;
                load_tile<DQ_STREAM>(sk + (stage ^ 1) * DQ_STREAM * HEAD_DIM, k, next0, tk);
                load_tile<DQ_STREAM>(sv + (stage ^ 1) * DQ_STREAM * HEAD_DIM, v, next0, tk);
            }
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            if (!MASK_INTERVAL && partial && j % DQ_STEPS == 0) {
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
                    bits[mt] = visible_bits((entry >> 1) * LIST_N, row0 + mt * 16 + g, lane,
                                            args);
            }
            const u32 tile_k = smem_addr(sk + stage * DQ_STREAM * HEAD_DIM),
                      tile_v = smem_addr(sv + stage * DQ_STREAM * HEAD_DIM);

#pragma unroll
            for (int sub = 0; sub < DQ_STREAM / DQ_SUB; ++sub) {
                const int c0 = sub * DQ_SUB, ks0 = kv0 + c0;
                if (ks0 >= tk) continue;  // keys past tk
                float s[M_TILES][DQ_SUB / 8][4], dp[M_TILES][DQ_SUB / 8][4];
                zero(s);
                zero(dp);
                mma_abt<DQ_SUB>(s, qf, tile_k, c0, off);    // s = q·kᵀ
                mma_abt<DQ_SUB>(dp, dof, tile_v, c0, off);  // dp = dO·vᵀ
                // the step's bits start (ks0 − the block's first key) / 8 tiles of 4 in
                const int shift = ((j % DQ_STEPS) * DQ_STREAM + c0) / 2;
                dq_probabilities(s, dp, lse2, dl, partial, bits, shift, keys, ks0, row0,
                                 scale, exp_scale, g, t, args);
                mma_pb<DQ_SUB>(dq_acc, s, tile_k, c0, off);  // dQ += ds · k (· scale at the end)
            }
            __syncthreads();
            entry = next;
        }
    }
    store_rows(dq, dq_acc, scale, row0, g, t, tq);
}
