// FlashAttention forward, causal, on the tensor cores (mma.sync m16n8k16, f32
// accumulation).
//
// One thread block (CTA) per block of BLOCK_M = 128 queries of one head; its 4 warps own 32
// query rows each. The CTA streams the keys and values of its head through shared memory
// BLOCK_N = 128 at a time (cp.async, two stages), and each warp keeps, for each of its
// rows, the running maximum m, the running sum l and the running output o in registers: the
// online softmax of chapter 2, with the products on the tensor cores. Nothing of size T x T
// is ever stored.
//
// Compile-time parameters, every one given to NVRTC as a -D option by src/kernel.rs's
// ForwardKernel (a missing one is a compile error):
//   HEAD_DIM     32, 64 or 128
//   IS_BF16      1 for bf16 inputs and output, 0 for f16
// [step 07]
//   CAUSAL       1: each query sees the keys up to its own position; 0: every key below T
//                (step 07's ring computes blocks of keys that lie wholly before their
//                queries)
// [/step 07]
//
// src/kernel.rs prepends tensor_cores.cuh (the types, the swizzle and the tensor-core
// instructions this file uses) before NVRTC compiles it.

// The tile, the one measured fastest at each head dim (lab/logs/03-cuda-forward/): 4 warps
// of 32 query rows; up to head dim 64, 128 keys a block, all at once (FlashAttention-2's
// tile); at 128, where the output alone takes 128 registers a thread, 64 keys a block taken
// 32 at a time. src/kernel.rs launches it with the same sizes (a test there reads them
// here).
// (Macros, not constexpr variables: NVRTC would give each a global in the PTX.)
#define WARPS 4    // warps per block
#define M_TILES 2  // 16-row tiles of queries per warp
// keys per block, copied into shared memory together
#define BLOCK_N (HEAD_DIM <= 64 ? 128 : 64)
// keys per step of the products and the softmax within a block: fewer scores in registers
// at once, with the copies and barriers of BLOCK_N keys
#define SUB_N (HEAD_DIM <= 64 ? BLOCK_N : 32)
#define MIN_BLOCKS 1  // blocks per multiprocessor the register budget must allow
static_assert(BLOCK_N % SUB_N == 0 && SUB_N % 16 == 0,
              "SUB_N keys a step, a multiple of 16 that divides BLOCK_N");
// query rows per warp: M_TILES tiles of 16
#define WARP_ROWS (M_TILES * 16)
#define BLOCK_M (WARPS * WARP_ROWS)
#define THREADS (WARPS * 32)

// ANCHOR: causal
// The causal mask, as the four questions the kernel's loops ask of it. A query sees the
// keys up to its own position; T, the end of the sequence, needs no test of its own, as
// every key at or past it comes after every row before it. (Macros: as inlined functions
// the comparisons compile to other instructions than the ones measured.)
// [step 07]
static_assert(CAUSAL == 0 || CAUSAL == 1,
              "CAUSAL: 1 for the causal mask, 0 for every key below T");
#if CAUSAL
// [/step 07]
// queries q0 .. q0 + BLOCK_M - 1 see keys 0 .. KEYS_SEEN - 1: the key blocks past the
// diagonal are never loaded
#define KEYS_SEEN(q0, T) min((q0) + BLOCK_M, (T))
// rows row0 .. row0 + WARP_ROWS - 1 see none of the keys from kv on: all come before it
#define ROWS_SEE_NONE(kv, row0, T) ((kv) > (row0) + WARP_ROWS - 1)
// the step of keys kv .. kv + SUB_N - 1 reaches past row row0, the warp's first: some of
// its keys come after some of the warp's rows
#define NEEDS_MASK(kv, row0, T) ((kv) + SUB_N - 1 > (row0))
// row `row` does not see key `key`
#define HIDDEN(key, row, T) ((key) > (row))
// [step 07]
#else
// Every query sees every key below T (step 07's ring computes blocks of keys that lie
// wholly before their queries): only the keys past the end of a partial tile are left out.
#define KEYS_SEEN(q0, T) (T)
#define ROWS_SEE_NONE(kv, row0, T) ((kv) >= (T))
#define NEEDS_MASK(kv, row0, T) ((kv) + SUB_N > (T))
#define HIDDEN(key, row, T) ((key) >= (T))
#endif
// [/step 07]
// ANCHOR_END: causal

// ROWS rows of a [T, HEAD_DIM] matrix from row `row0` into a swizzled tile; rows past T are
// 0 (load_rows in tensor_cores.cuh)
template <int ROWS>
__device__ __forceinline__ void load_tile(u16* tile, const u16* src, int row0, int T) {
    load_rows<ROWS, THREADS>(tile, src, row0, T);
}

// ANCHOR: offsets
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
// ANCHOR_END: offsets

// ANCHOR: kernel_signature
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) flash_forward(
    const u16* __restrict__ q,   // [B*H, T, HEAD_DIM] queries
    const u16* __restrict__ k,   // [B*H, T, HEAD_DIM] keys
    const u16* __restrict__ v,   // [B*H, T, HEAD_DIM] values
    u16* __restrict__ out,       // [B*H, T, HEAD_DIM] output
    float* __restrict__ lse,     // [B*H, T] natural log-sum-exp of each row's scaled scores
    int T,                       // tokens per sequence
    int heads,                   // B*H
    int q_per_kv,                // query heads per head of k, v (B*H/q_per_kv) // [step 08]
    float scale_log2             // log2(e)/sqrt(HEAD_DIM): scores in base-2 units
) {
    // ANCHOR_END: kernel_signature
    extern __shared__ __align__(128) u16 smem[];
    u16* sq = smem;                                     // [BLOCK_M][HEAD_DIM]
    u16* sk = sq + BLOCK_M * HEAD_DIM;  // [2][BLOCK_N][HEAD_DIM], two stages
    u16* sv = sk + 2 * BLOCK_N * HEAD_DIM;              // [2][BLOCK_N][HEAD_DIM]

    // ANCHOR: block_order
    // Which (head, query block) this block computes. The grid is one-dimensional and blocks
    // start roughly in index order, so the order is a choice: the longest query blocks (the
    // most keys to see) of every head come first, the shortest last, so the short ones fill
    // the tail of the grid.
    const int q_blocks = (T + BLOCK_M - 1) / BLOCK_M;
    const int bh = blockIdx.x % heads;
    const int q_block = q_blocks - 1 - blockIdx.x / heads;
    // ANCHOR_END: block_order
    const int q0 = q_block * BLOCK_M;
    const long long head = (long long)bh * T * HEAD_DIM;
    // [step 08]
    // ANCHOR: grouped_heads
    // grouped-query attention: k and v hold one head for every q_per_kv query heads, and
    // query head bh reads head bh / q_per_kv of them; k and v are moved back by the heads
    // between the two, so that `head` lands on it
    k -= (long long)(bh - bh / q_per_kv) * T * HEAD_DIM;
    v -= (long long)(bh - bh / q_per_kv) * T * HEAD_DIM;
    // ANCHOR_END: grouped_heads
    // [/step 08]
    // (q, k, v, out and lse are moved on to this head where they are used: one 64-bit
    // offset held through the loop rather than a pointer for each; with a pointer each,
    // head dim 64's tile spills 8 bytes)

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;    // fragment row and column pair (see mma_16816)
    const int row0 = q0 + warp * WARP_ROWS;   // this warp's first query row

    // ANCHOR: causal_blocks
    // the blocks of the keys this block's rows may see, and no more
    const int n_blocks = (KEYS_SEEN(q0, T) + BLOCK_N - 1) / BLOCK_N;
    // ANCHOR_END: causal_blocks

    // ANCHOR: pipeline_start
    // two groups of copies in flight before the loop: q, then the first block of keys and
    // values
    load_tile<BLOCK_M>(sq, q + head, q0, T);
    cp_async_commit();
    load_tile<BLOCK_N>(sk, k + head, 0, T);
    load_tile<BLOCK_N>(sv, v + head, 0, T);
    cp_async_commit();
    // ANCHOR_END: pipeline_start

    // ANCHOR: fragment_addresses
    // Each lane's ldmatrix addresses, in bytes, computed once: for q's A fragments
    //   row warp·WARP_ROWS + lane % 16, chunk 2kk + lane / 16           (+ 16 rows per
    //   m-tile)
    // and for the B fragments of k and v the offsets of BOffsets or XorBOffsets
    // (tensor_cores.cuh).
    const Offsets<HEAD_DIM == 128>::A q_at(sq, warp * WARP_ROWS, lane);
    const Offsets<HEAD_DIM == 128>::B off(lane);
    const u32 sk_addr = smem_addr(sk), sv_addr = smem_addr(sv);
    // ANCHOR_END: fragment_addresses

    // ANCHOR: running_state
    // Per thread, for each 16-row tile mt of the warp: rows g and g+8 (index h = 0, 1).
    //   m[mt][h]: the largest raw score seen so far in the row
    //   l[mt][h]: this thread's part of the row's sum of e^(s - m) (the 4 threads of a quad
    //             hold the row's columns between them; their parts are added up at the end)
    //   o[mt][n][..]: the row's unnormalised output, columns 8n + 2t and 8n + 2t + 1
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
    // ANCHOR_END: running_state

    // ANCHOR: main_loop
    for (int j = 0; j < n_blocks; ++j) {
        const int stage = j & 1;
        const int kv0 = j * BLOCK_N;
        // start copying the next block into the other stage while this one is computed on
        if (j + 1 < n_blocks) {
            load_tile<BLOCK_N>(sk + (stage ^ 1) * BLOCK_N * HEAD_DIM, k + head,
                               kv0 + BLOCK_N, T);
            load_tile<BLOCK_N>(sv + (stage ^ 1) * BLOCK_N * HEAD_DIM, v + head,
                               kv0 + BLOCK_N, T);
        }
        cp_async_commit();
        // everything but the copy just issued has landed: q (on the first pass) and this
        // block
        cp_async_wait<1>();
        __syncthreads();

        // the block's keys SUB_N at a time (all at once by default)
#pragma unroll
        for (int sub = 0; sub < BLOCK_N / SUB_N; ++sub) {
            const int kv = kv0 + sub * SUB_N;  // this step's first key
            // a warp whose rows all come before this step's first key has nothing to add
            if (ROWS_SEE_NONE(kv, row0, T)) continue;
            const u32 ks =
                sk_addr + stage * (BLOCK_N * HEAD_DIM * 2) + sub * (SUB_N * HEAD_DIM * 2);
            const u32 vs =
                sv_addr + stage * (BLOCK_N * HEAD_DIM * 2) + sub * (SUB_N * HEAD_DIM * 2);

            // ANCHOR: scores_mma
            // s = q·kᵀ for the warp's rows x SUB_N keys, in 16x8 tiles. K is stored
            // [key][dim], which is exactly the column-major B operand, so plain ldmatrix
            // gives its fragments, and each one serves all M_TILES row tiles. q's A
            // fragments are read again for each step, 16 head dims at a time, rather than
            // held across the loop: registers go to the output and the scores.
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
                    // keys 8n..8n+15, columns 16kk..16kk+15: the B fragments of two n-tiles
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4(ks + off.abt(kk) + n * (8 * HEAD_DIM * 2), b0, b1, b2, b3);
#pragma unroll
                    for (int mt = 0; mt < M_TILES; ++mt) {
                        mma_16816(s[mt][n], qf[mt], b0, b1);
                        mma_16816(s[mt][n + 1], qf[mt], b2, b3);
                    }
                }
            }
            // ANCHOR_END: scores_mma

            // ANCHOR: diagonal_mask
            // only blocks that reach past this warp's first row need the mask; there, keys
            // after the row (and so every key at or past T) get -inf
            if (NEEDS_MASK(kv, row0, T)) {
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                    for (int n = 0; n < SUB_N / 8; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            int key = kv + n * 8 + 2 * t + (e & 1);
                            int row = row0 + mt * 16 + g + (e >> 1) * 8;
                            if (HIDDEN(key, row, T)) s[mt][n][e] = NEG_INF;
                        }
            }
            // ANCHOR_END: diagonal_mask

            // ANCHOR: online_softmax
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float mx = m[mt][h];
#pragma unroll
                    for (int n = 0; n < SUB_N / 8; ++n)
                        mx = fmaxf(mx, fmaxf(s[mt][n][2 * h], s[mt][n][2 * h + 1]));
                    // the row's maximum over the 4 threads of the quad that hold it
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                    // a new maximum shrinks what was summed so far by 2^((m_old -
                    // m_new)·scale_log2); a row still all -inf (only rows past T can be)
                    // keeps its zeros
                    float m_scaled = mx == NEG_INF ? 0.f : mx * scale_log2;
                    float correction = fast_exp2(m[mt][h] * scale_log2 - m_scaled);
                    m[mt][h] = mx;
                    l[mt][h] *= correction;
#pragma unroll
                    for (int n = 0; n < HEAD_DIM / 8; ++n) {
                        o[mt][n][2 * h] *= correction;
                        o[mt][n][2 * h + 1] *= correction;
                    }
                    // p = 2^(s·scale_log2 - m·scale_log2) = e^((s - m)/sqrt(d)): one FMA
                    // and one ex2
#pragma unroll
                    for (int n = 0; n < SUB_N / 8; ++n) {
                        s[mt][n][2 * h] =
                            fast_exp2(fmaf(s[mt][n][2 * h], scale_log2, -m_scaled));
                        s[mt][n][2 * h + 1] =
                            fast_exp2(fmaf(s[mt][n][2 * h + 1], scale_log2, -m_scaled));
                        l[mt][h] += s[mt][n][2 * h] + s[mt][n][2 * h + 1];
                    }
                }
            // ANCHOR_END: online_softmax

            // ANCHOR: pv_mma
            // o += p·v. The accumulator layout of two neighbouring 16x8 tiles of p is the A
            // fragment of one 16x16 tile, so p goes from registers to the tensor cores
            // without touching shared memory. V is stored [key][dim]: its B fragments need
            // the transposing ldmatrix, and each serves all M_TILES row tiles.
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
            // ANCHOR_END: pv_mma
        }
        // every warp is done with this stage before the next iteration's copy overwrites it
        __syncthreads();
    }
    // ANCHOR_END: main_loop

    // ANCHOR: finalise
    // o / l, and the log-sum-exp m/sqrt(d) + ln l, for the rows inside the sequence
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[mt][h];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            int row = row0 + mt * 16 + g + h * 8;
            if (row < T) {
                float inv = 1.f / sum;
                u16* dst = out + head + (long long)row * HEAD_DIM + 2 * t;
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; ++n)
                    *(u32*)(dst + n * 8) =
                        pack2(o[mt][n][2 * h] * inv, o[mt][n][2 * h + 1] * inv);
                // ln(sum e^(s/sqrt(d))) = (m·scale_log2 + log2 l) · ln 2
                if (t == 0)
                    lse[(long long)bh * T + row] =
                        (m[mt][h] * scale_log2 + __log2f(sum)) * 0.6931471805599453f;
            }
        }
    // ANCHOR_END: finalise
}
