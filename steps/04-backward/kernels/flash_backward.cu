// FlashAttention backward, causal, on the tensor cores (mma.sync m16n8k16, f32
// accumulation).
//
// Three kernels, each program writing only its own rows, so results are deterministic:
//   backward_delta  delta_i = sum_d dO_id * O_id, once per row (FlashAttention-2, Alg. 2
//   line 4) backward_dkdv   one block per BLOCK_ROWS (128) keys of a head: the queries that
//                   see them stream past; dV += P^T dO and dK += dS^T Q accumulate in
//                   registers
//   backward_dq     one block per BLOCK_ROWS queries of a head: the keys they see stream
//                   past; dQ += dS K accumulates in registers
// with P = exp(S - lse) rebuilt from the forward's log-sum-exp and dS = P o (dP - delta).
//
// The shapes are the forward kernel's (chapter 3): up to head dim 64 four warps of 32 rows
// (two 16-row tiles, so each B fragment read from shared memory feeds two mma), the other
// side streamed through shared memory in two stages, the next copy in flight while the
// tensor cores work on the current one. Each warp holds its own rows' two operands (k and v
// in dkdv, q and dO in dq) as A fragments in registers for the whole loop. At head dim 128
// a warp's 32 rows of two operands and two gradients do not fit in its registers: there the
// warps own 16 rows each (M_TILES 1), and eight of them make a block of 128 rows.
//
// Compile-time parameters, every one given to NVRTC as a -D option by src/cuda.rs's
// BackwardKernel (a missing one is a compile error):
//   HEAD_DIM         32, 64 or 128
//   IS_BF16          1 for bf16, 0 for f16
// [step 07]
//   CAUSAL           1: each query sees the keys up to its own position; 0: every key below
//                    T (step 07's ring computes blocks of keys that lie wholly before their
//                    queries)
//   ACCUMULATE       0: dq, dk and dv are written in 16 bits; 1: they are f32 sums that
//                    each block's share is added to (step 07's ring sums every block's
//                    share in f32 and rounds once)
// [/step 07]
// src/cuda.rs prepends step 03's tensor_cores.cuh (types, swizzle, cp.async, ldmatrix,
// mma).

// The thread blocks, the ones measured fastest at each head dim (lab/logs/04-backward/; why
// eight warps of 16 rows at 128: above). src/cuda.rs launches them with the same sizes (a
// test there reads them here). Macros, not constexpr variables, as are the streams and
// steps below: NVRTC would give each a global in the PTX.
// ANCHOR: thread_blocks
#define WARPS (HEAD_DIM <= 64 ? 4 : 8)    // warps per block
#define M_TILES (HEAD_DIM <= 64 ? 2 : 1)  // 16-row tiles per warp
// each kernel's blocks per multiprocessor, the register budget: 255 a thread either way
#define DKDV_MIN_BLOCKS (HEAD_DIM <= 64 ? 2 : 1)
#define DQ_MIN_BLOCKS (HEAD_DIM <= 64 ? 2 : 1)
// ANCHOR_END: thread_blocks

// The streams and steps, the ones measured fastest at every head dim
// (lab/logs/04-backward/): src/cuda.rs sizes the shared memory for the same streams (a test
// there reads them here).
// queries streamed past dkdv's keys per stage (at head dim 128 the tuning log's run 6:
// 220.4 and 236.8 TFLOP/s at 4k and 16k, against 209.6 and 224.3 with 64)
#define DKDV_STREAM 128
#define DQ_STREAM 64     // keys streamed past dq's queries per stage
#define DKDV_SUB 16      // queries per step of dkdv's inner loop
#define DQ_SUB 32        // keys per step of dq's inner loop
static_assert(WARPS >= 1 && M_TILES >= 1, "WARPS warps of M_TILES tiles of 16 rows");
static_assert(DKDV_STREAM % DKDV_SUB == 0 && DQ_STREAM % DQ_SUB == 0,
              "steps that divide the stages");
static_assert(DKDV_MIN_BLOCKS >= 1 && DQ_MIN_BLOCKS >= 1, "blocks a multiprocessor");
#define THREADS (WARPS * 32)
#define WARP_ROWS (M_TILES * 16)           // keys (dkdv) or queries (dq) per warp
#define BLOCK_ROWS (WARPS * WARP_ROWS)     // keys (dkdv) or queries (dq) per thread block
#define ROW_BYTES (HEAD_DIM * 2)
#define LOG2E 1.4426950408889634f
#define POS_INF __int_as_float(0x7f800000)

static_assert(ACCUMULATE == 0 || ACCUMULATE == 1, "ACCUMULATE: 1 to add into f32 sums"); // [step 07]

// ANCHOR: causal
// The causal mask, as the questions the two kernels' loops ask of it: a query sees the keys
// up to its own position. T, the end of the sequence, needs no test of its own: every key
// at or past it comes after every query before it. (Macros, as in the forward kernel.)
// [step 07]
static_assert(CAUSAL == 0 || CAUSAL == 1,
              "CAUSAL: 1 for the causal mask, 0 for every key below T");
#if CAUSAL
// [/step 07]
// dkdv: the first block of DKDV_STREAM queries that sees keys kv0 ..; the queries before
// it come before every one of those keys
#define FIRST_QUERY_BLOCK(kv0) ((kv0) / DKDV_STREAM)
// dkdv: queries qs0 .. qs0 + DKDV_SUB - 1 see none of the warp's keys key0 ..: they all
// come before them
#define QUERIES_SEE_NONE(qs0, key0, T) ((qs0) + DKDV_SUB - 1 < (key0))
// dkdv: the step reaches a query before one of the warp's keys key0 .. key0 + WARP_ROWS - 1
#define DKDV_NEEDS_MASK(qs0, key0) ((qs0) < (key0) + WARP_ROWS - 1)
// dq: queries q0 .. q0 + BLOCK_ROWS - 1 see keys 0 .. KEYS_SEEN - 1
#define KEYS_SEEN(q0, T) min((q0) + BLOCK_ROWS, (T))
// dq: rows row0 .. row0 + WARP_ROWS - 1 see none of the keys from ks0 on: they all come
// after them
#define ROWS_SEE_NONE(ks0, row0, T) ((ks0) > (row0) + WARP_ROWS - 1)
// dq: the step of keys ks0 .. ks0 + DQ_SUB - 1 reaches a key after one of the warp's rows
#define DQ_NEEDS_MASK(ks0, row0) ((ks0) + DQ_SUB - 1 > (row0))
// [step 07]
#else
// Every query sees every key below T (step 07's ring computes blocks of keys that lie
// wholly before their queries). No step needs the mask: a query past T has lse = +inf, so
// its p is 0, and a key past T loads as zeros, so it adds nothing to dQ.
#define FIRST_QUERY_BLOCK(kv0) 0
#define QUERIES_SEE_NONE(qs0, key0, T) ((qs0) >= (T))
#define DKDV_NEEDS_MASK(qs0, key0) false
#define KEYS_SEEN(q0, T) (T)
#define ROWS_SEE_NONE(ks0, row0, T) ((ks0) >= (T))
#define DQ_NEEDS_MASK(ks0, row0) false
#endif
// [/step 07]
// ANCHOR_END: causal

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

// ANCHOR: store_rows
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
// [step 07]
#if ACCUMULATE
                {  // the block's share added to the f32 sum; only this block writes them
                    float2* sum =
                        (float2*)((float*)dst + (long long)row * HEAD_DIM + n * 8 + 2 * t);
                    const float2 was = *sum;
                    *sum = make_float2(was.x + acc[mt][n][2 * h] * scale,
                                       was.y + acc[mt][n][2 * h + 1] * scale);
                }
#else
// [/step 07]
                    *(u32*)(dst + (long long)row * HEAD_DIM + n * 8 + 2 * t) =
                        pack2(acc[mt][n][2 * h] * scale, acc[mt][n][2 * h + 1] * scale);
#endif // [step 07]
            }
        }
}
// ANCHOR_END: store_rows

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
    for (int i = lane; i < HEAD_DIM / 2; i += 32)
        sum += lo16(o[i]) * lo16(d[i]) + hi16(o[i]) * hi16(d[i]);
    for (int offset = 16; offset > 0; offset /= 2)
        sum += __shfl_xor_sync(0xffffffff, sum, offset);
    if (lane == 0) delta[row] = sum;
}
// ANCHOR_END: delta

// Stage `stage` of the queries' tiles: rows q0 .. q0 + DKDV_STREAM - 1 of q and dO
// (cp.async), and their log-sum-exp in base 2 and δ. A query past T gets lse = +inf, so its
// p is 0.
__device__ __forceinline__ void load_queries(u16* sq, u16* sdo, float* slse, float* sdelta,
                                             const u16* q, const u16* dout,
                                             const float* lse, const float* delta, int q0,
                                             int T) {
    load_tile<DKDV_STREAM>(sq, q, q0, T);
    load_tile<DKDV_STREAM>(sdo, dout, q0, T);
    for (int i = threadIdx.x; i < DKDV_STREAM; i += THREADS) {
        bool valid = q0 + i < T;
        slse[i] = valid ? lse[q0 + i] * LOG2E : POS_INF;
        sdelta[i] = valid ? delta[q0 + i] : 0.f;
    }
}

// ANCHOR: dkdv_probabilities
// pT = e^(sT/√d - lse) for a warp's keys and DKDV_SUB queries from column c0 of the stage,
// and dsT = pT o (dpT - delta), in place. With MASK, pT is 0 where the query comes before
// the key; `rel` is the stage's first query minus the warp's first key.
template <bool MASK>
__device__ __forceinline__ void
dkdv_probabilities(float (&p)[M_TILES][DKDV_SUB / 8][4],
                   float (&dp)[M_TILES][DKDV_SUB / 8][4], const float* tl, const float* td,
                   int c0, int rel, float scale_log2, int g, int t) {
#pragma unroll
    for (int n = 0; n < DKDV_SUB / 8; ++n) {
        const int col = c0 + n * 8 + 2 * t;  // this thread's two queries: col, col + 1
        const float2 l2 = *(const float2*)(tl + col), d2 = *(const float2*)(td + col);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float pe =
                    fast_exp2(fmaf(p[mt][n][e], scale_log2, -((e & 1) ? l2.y : l2.x)));
                if (MASK && rel + col + (e & 1) < mt * 16 + g + 8 * (e >> 1)) pe = 0.f;
                p[mt][n][e] = pe;
                dp[mt][n][e] = pe * (dp[mt][n][e] - ((e & 1) ? d2.y : d2.x));
            }
    }
}
// ANCHOR_END: dkdv_probabilities

// ANCHOR: dkdv
// dK and dV for keys BLOCK_ROWS·kb .. of head bh (one thread block)
__device__ __forceinline__ void
dkdv_block(int bh, int kb, const u16* __restrict__ q, const u16* __restrict__ k,
           const u16* __restrict__ v,        // [B*H, T, D]
           const u16* __restrict__ dout,     // [B*H, T, D] gradient of the output
           const float* __restrict__ lse,    // [B*H, T] the forward's natural log-sum-exp
           const float* __restrict__ delta,  // [B*H, T] from backward_delta
           u16* __restrict__ dk,
           u16* __restrict__ dv,  // [B*H, T, D] gradients written here
           int T,                 // tokens
           float scale            // 1/sqrt(HEAD_DIM)
) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sk = smem;  // [BLOCK_ROWS][HEAD_DIM], read into registers once
    u16* sv = sk + BLOCK_ROWS * HEAD_DIM;
    u16* sq = sv + BLOCK_ROWS * HEAD_DIM;       // [2][DKDV_STREAM][HEAD_DIM], two stages
    u16* sdo = sq + 2 * DKDV_STREAM * HEAD_DIM;      // [2][DKDV_STREAM][HEAD_DIM]
    float* slse = (float*)(sdo + 2 * DKDV_STREAM * HEAD_DIM);  // [2][DKDV_STREAM]
    float* sdelta = slse + 2 * DKDV_STREAM;                    // [2][DKDV_STREAM]

    const long long head = (long long)bh * T * HEAD_DIM;
    q += head; k += head; v += head; dout += head; dk += head; dv += head;
    // [step 07]
    // f32 sums: twice a 16-bit value's bytes each
    if constexpr (ACCUMULATE) { dk += head; dv += head; }
    // [/step 07]
    lse += (long long)bh * T;
    delta += (long long)bh * T;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int kv0 = kb * BLOCK_ROWS,
              key0 = kv0 + warp * WARP_ROWS;  // this warp's first key
    const float scale_log2 = scale * LOG2E;
    const BOffsets off(lane);

    // queries kv0 .. T-1 see these keys (a query sees the keys up to itself)
    const int first = FIRST_QUERY_BLOCK(kv0),
              q_blocks = (T + DKDV_STREAM - 1) / DKDV_STREAM;
    load_tile<BLOCK_ROWS>(sk, k, kv0, T);
    load_tile<BLOCK_ROWS>(sv, v, kv0, T);
    cp_async_commit();
    load_queries(sq, sdo, slse, sdelta, q, dout, lse, delta, first * DKDV_STREAM, T);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    u32 kf[M_TILES][HEAD_DIM / 16][4], vf[M_TILES][HEAD_DIM / 16][4];
    load_a(sk, warp, lane, kf);
    load_a(sv, warp, lane, vf);

    float dk_acc[M_TILES][HEAD_DIM / 8][4], dv_acc[M_TILES][HEAD_DIM / 8][4];
    zero(dk_acc);
    zero(dv_acc);

    for (int j = first; j < q_blocks; ++j) {
        const int stage = (j - first) & 1, q0 = j * DKDV_STREAM;
        // the next queries' copy runs while this block is computed on
        if (j + 1 < q_blocks)
            load_queries(sq + (stage ^ 1) * DKDV_STREAM * HEAD_DIM,
                         sdo + (stage ^ 1) * DKDV_STREAM * HEAD_DIM,
                         slse + (stage ^ 1) * DKDV_STREAM,
                         sdelta + (stage ^ 1) * DKDV_STREAM, q, dout, lse, delta,
                         q0 + DKDV_STREAM, T);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const u32 tq = smem_addr(sq + stage * DKDV_STREAM * HEAD_DIM),
                  tdo = smem_addr(sdo + stage * DKDV_STREAM * HEAD_DIM);
        const float* tl = slse + stage * DKDV_STREAM;
        const float* td = sdelta + stage * DKDV_STREAM;

#pragma unroll
        for (int sub = 0; sub < DKDV_STREAM / DKDV_SUB; ++sub) {
            const int c0 = sub * DKDV_SUB, qs0 = q0 + c0;
            if (QUERIES_SEE_NONE(qs0, key0, T))
                continue;  // these queries all come before this warp's keys
            // sT = k·qᵀ (this warp's keys x DKDV_SUB queries) and dpT = v·dOᵀ
            float p[M_TILES][DKDV_SUB / 8][4], dp[M_TILES][DKDV_SUB / 8][4];
            zero(p);
            zero(dp);
            mma_abt<DKDV_SUB>(p, kf, tq, c0, off);
            mma_abt<DKDV_SUB>(dp, vf, tdo, c0, off);
            // only steps that reach a query before one of this warp's keys need the mask
            if (DKDV_NEEDS_MASK(qs0, key0))
                dkdv_probabilities<true>(p, dp, tl, td, c0, q0 - key0, scale_log2, g, t);
            else
                dkdv_probabilities<false>(p, dp, tl, td, c0, q0 - key0, scale_log2, g, t);
            mma_pb<DKDV_SUB>(dv_acc, p, tdo, c0, off);  // dV += pT · dO
            mma_pb<DKDV_SUB>(dk_acc, dp, tq, c0,
                             off);  // dK += dsT · q   (· scale at the end)
        }
        // every warp is done with this stage before the next iteration's copy overwrites it
        __syncthreads();
    }
    store_rows(dk, dk_acc, scale, key0, g, t, T);
    store_rows(dv, dv_acc, 1.f, key0, g, t, T);
}
// ANCHOR_END: dkdv

// One thread block per BLOCK_ROWS keys of a head. blockIdx.x is the head, so every head's
// first key blocks, which the most queries see, start first and the short ones fill the end
// of the grid.
extern "C" __global__ void __launch_bounds__(THREADS, DKDV_MIN_BLOCKS)
    backward_dkdv(const u16* __restrict__ q, const u16* __restrict__ k,
                  const u16* __restrict__ v, const u16* __restrict__ dout,
                  const float* __restrict__ lse, const float* __restrict__ delta,
                  u16* __restrict__ dk, u16* __restrict__ dv,
                  int q_per_kv,  // query heads per head of k and v // [step 08]
                  int T, float scale) {
    // [step 08]
    // ANCHOR: grouped_dkdv
    // grouped-query attention: query head bh reads head bh / q_per_kv of k and v; dK and
    // dV are written at bh, one for each query head, and backward_group_sum adds up the
    // q_per_kv of each group
    const long long back = (long long)(blockIdx.x - blockIdx.x / q_per_kv) * T * HEAD_DIM;
    k -= back;
    v -= back;
    // ANCHOR_END: grouped_dkdv
    // [/step 08]
    dkdv_block(blockIdx.x, blockIdx.y, q, k, v, dout, lse, delta, dk, dv, T, scale);
}

// ds = p o (dp - delta) in place, p = e^(s/√d - lse), for a warp's rows and DQ_SUB keys.
// With MASK, p is 0 where the key comes after the row; `rel` is the first key minus the
// warp's first row.
template <bool MASK>
__device__ __forceinline__ void
dq_probabilities(float (&s)[M_TILES][DQ_SUB / 8][4],
                 const float (&dp)[M_TILES][DQ_SUB / 8][4], const float (&lse2)[M_TILES][2],
                 const float (&dl)[M_TILES][2], int rel, float scale_log2, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int n = 0; n < DQ_SUB / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e >> 1;
                float pe = fast_exp2(fmaf(s[mt][n][e], scale_log2, -lse2[mt][h]));
                if (MASK && rel + n * 8 + 2 * t + (e & 1) > mt * 16 + g + 8 * h) pe = 0.f;
                s[mt][n][e] = pe * (dp[mt][n][e] - dl[mt][h]);
            }
}

// ANCHOR: dq
// dQ for queries BLOCK_ROWS·qb .. of head bh (one thread block)
__device__ __forceinline__ void dq_block(int bh, int qb, const u16* __restrict__ q,
                                         const u16* __restrict__ k,
                                         const u16* __restrict__ v,        // [B*H, T, D]
                                         const u16* __restrict__ dout,     // [B*H, T, D]
                                         const float* __restrict__ lse,    // [B*H, T]
                                         const float* __restrict__ delta,  // [B*H, T]
                                         u16* __restrict__ dq,             // [B*H, T, D]
                                         int T, float scale) {
    extern __shared__ __align__(128) u16 smem[];
    u16* sq = smem;  // [BLOCK_ROWS][HEAD_DIM], read into registers once
    u16* sdo = sq + BLOCK_ROWS * HEAD_DIM;
    u16* sk = sdo + BLOCK_ROWS * HEAD_DIM;      // [2][DQ_STREAM][HEAD_DIM], two stages
    u16* sv = sk + 2 * DQ_STREAM * HEAD_DIM;       // [2][DQ_STREAM][HEAD_DIM]

    const long long head = (long long)bh * T * HEAD_DIM;
    q += head; k += head; v += head; dout += head; dq += head;
    // [step 07]
    if constexpr (ACCUMULATE) dq += head;  // f32 sums: twice a 16-bit value's bytes each
    // [/step 07]
    lse += (long long)bh * T;
    delta += (long long)bh * T;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int q0 = qb * BLOCK_ROWS, row0 = q0 + warp * WARP_ROWS;
    const float scale_log2 = scale * LOG2E;
    const BOffsets off(lane);
    // the blocks of the keys this block's rows may see, and no more
    const int kv_blocks = (KEYS_SEEN(q0, T) + DQ_STREAM - 1) / DQ_STREAM;

    load_tile<BLOCK_ROWS>(sq, q, q0, T);
    load_tile<BLOCK_ROWS>(sdo, dout, q0, T);
    cp_async_commit();
    load_tile<DQ_STREAM>(sk, k, 0, T);
    load_tile<DQ_STREAM>(sv, v, 0, T);
    cp_async_commit();
    // this thread's rows: lse in base 2, and delta
    float lse2[M_TILES][2], dl[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int row = row0 + mt * 16 + g + 8 * h;
            lse2[mt][h] = row < T ? lse[row] * LOG2E : POS_INF;
            dl[mt][h] = row < T ? delta[row] : 0.f;
        }
    cp_async_wait<1>();
    __syncthreads();
    u32 qf[M_TILES][HEAD_DIM / 16][4], dof[M_TILES][HEAD_DIM / 16][4];
    load_a(sq, warp, lane, qf);
    load_a(sdo, warp, lane, dof);

    float dq_acc[M_TILES][HEAD_DIM / 8][4];
    zero(dq_acc);

    for (int j = 0; j < kv_blocks; ++j) {
        const int stage = j & 1, kv0 = j * DQ_STREAM;
        if (j + 1 < kv_blocks) {
            load_tile<DQ_STREAM>(sk + (stage ^ 1) * DQ_STREAM * HEAD_DIM, k,
                                 kv0 + DQ_STREAM, T);
            load_tile<DQ_STREAM>(sv + (stage ^ 1) * DQ_STREAM * HEAD_DIM, v,
                                 kv0 + DQ_STREAM, T);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const u32 tk = smem_addr(sk + stage * DQ_STREAM * HEAD_DIM),
                  tv = smem_addr(sv + stage * DQ_STREAM * HEAD_DIM);

#pragma unroll
        for (int sub = 0; sub < DQ_STREAM / DQ_SUB; ++sub) {
            const int c0 = sub * DQ_SUB, ks0 = kv0 + c0;
            if (ROWS_SEE_NONE(ks0, row0, T))
                continue;  // these keys all come after this warp's rows
            float s[M_TILES][DQ_SUB / 8][4], dp[M_TILES][DQ_SUB / 8][4];
            zero(s);
            zero(dp);
            mma_abt<DQ_SUB>(s, qf, tk, c0, off);    // s = q·kᵀ
            mma_abt<DQ_SUB>(dp, dof, tv, c0, off);  // dp = dO·vᵀ
            // only steps that reach a key after one of this warp's rows need the mask
            if (DQ_NEEDS_MASK(ks0, row0))
                dq_probabilities<true>(s, dp, lse2, dl, ks0 - row0, scale_log2, g, t);
            else
                dq_probabilities<false>(s, dp, lse2, dl, ks0 - row0, scale_log2, g, t);
            mma_pb<DQ_SUB>(dq_acc, s, tk, c0, off);  // dQ += ds · k   (· scale at the end)
        }
        __syncthreads();
    }
    store_rows(dq, dq_acc, scale, row0, g, t, T);
}
// ANCHOR_END: dq

// One thread block per BLOCK_ROWS queries of a head: the last query blocks see the most
// keys, so they go first, every head's together.
extern "C" __global__ void __launch_bounds__(THREADS, DQ_MIN_BLOCKS)
    backward_dq(const u16* __restrict__ q, const u16* __restrict__ k,
                const u16* __restrict__ v, const u16* __restrict__ dout,
                const float* __restrict__ lse, const float* __restrict__ delta,
                u16* __restrict__ dq,
                int q_per_kv,  // query heads per head of k and v // [step 08]
                int T, float scale) {
    // [step 08]
    // query head bh reads head bh / q_per_kv of k and v
    const long long back = (long long)(blockIdx.x - blockIdx.x / q_per_kv) * T * HEAD_DIM;
    k -= back;
    v -= back;
    // [/step 08]
    dq_block(blockIdx.x, gridDim.y - 1 - blockIdx.y, q, k, v, dout, lse, delta, dq, T,
             scale);
}

// [step 08]
// ANCHOR: group_sum
// Grouped-query attention's dK and dV: backward_dkdv writes one for each query head; the
// q_per_kv heads of a group add up into their shared head, in f32, rounded once
// (FlashAttention-2 does the same: flash_api.cpp's dk_expanded, summed by at::sum_out).
extern "C" __global__ void backward_group_sum(
    const u16* __restrict__ per_q,  // [B*H, T, HEAD_DIM] a gradient for each query head
    u16* __restrict__ sum,          // [B*H / q_per_kv, T, HEAD_DIM] each group's sum
    long long head_pairs,           // T * HEAD_DIM / 2: pairs of values in a head
    long long pairs,                // B*H / q_per_kv * head_pairs
    int q_per_kv                    // query heads in a group
) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pairs;
         i += (long long)gridDim.x * blockDim.x) {
        const long long kv = i / head_pairs;
        const u32* src = (const u32*)per_q + (kv * (q_per_kv - 1)) * head_pairs + i;
        float lo = 0.f, hi = 0.f;
        for (int j = 0; j < q_per_kv; ++j) {
            const u32 x = src[j * head_pairs];
            lo += lo16(x);
            hi += hi16(x);
        }
        ((u32*)sum)[i] = pack2(lo, hi);
    }
}
// ANCHOR_END: group_sum
// [/step 08]
