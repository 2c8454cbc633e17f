// Decoding attention on the tensor cores: a few query rows of each sequence against its
// cache of keys and values (flash-decoding: the keys split over thread blocks, each split's
// partial result merged through the log-sum-exps).
//
// One thread block per (split, kv head, sequence). The block computes the R = g·n query
// rows that read its kv head (g query heads of n rows each) together, so each byte of the
// cache is read once for all of them: q's rows padded to ROW_TILES tiles of 16, the scores
// and p·v as mma.sync m16n8k16 with f32 accumulation, as in step 03's kernel. Its WARPS
// warps take turns over the split's keys, KEYS at a time each, every warp with its own
// STAGES-deep cp.async pipeline in shared memory (no barrier between warps in the loop);
// at the end the warps' partial results merge in shared memory, and the block writes the
// output itself (one split) or its split's partial result in f32; the last block of a
// (sequence, kv head) to finish then merges the splits' results.
//
// Compile-time parameters, every one given to NVRTC as a -D option by src/kernel.rs's
// DecodeKernel (a missing one is a compile error; the file holds no defaults):
//   HEAD_DIM    32, 64 or 128
//   IS_BF16     1 for a bf16 cache, 0 for f16
//   ROW_TILES   tiles of 16 query rows a block computes: R = g·n ≤ 16·ROW_TILES
//   WARPS       warps per block
//   KEYS        keys a warp computes per step, a multiple of 16 (4 KB of keys: 32 at
//               head dim 64)
//   STAGES      steps a warp has in flight (its copies run STAGES - 1 steps ahead)
//   KEY_GROUP   keys that lie one after another in memory in any layout (16): a warp
//               asks for each group's address once
//   PAGE_SIZE   0: a contiguous cache [B, KVH, T, HEAD_DIM]; else tokens per page of a
//               paged cache, the pool [pages, KVH, PAGE_SIZE, HEAD_DIM], a multiple of
//               KEY_GROUP
//
// src/kernel.rs prepends step 03's tensor_cores.cuh (u16, the swizzle, cp.async, ldmatrix,
// mma_16816, pack2, fast_exp2, NEG_INF).

static_assert(ROW_TILES == 1 || ROW_TILES == 2, "ROW_TILES: 1 or 2 tiles of 16 rows");
static_assert(KEYS % 16 == 0 && STAGES >= 2 && WARPS >= 1, "KEYS, STAGES, WARPS");
static_assert(KEYS % KEY_GROUP == 0 && PAGE_SIZE % KEY_GROUP == 0,
              "KEYS, PAGE_SIZE: multiples of KEY_GROUP");
#define THREADS (WARPS * 32)
#define ROWS (ROW_TILES * 16)
// rows of a warp's tile one pass of cp.async covers: 32 lanes, CHUNKS 16-byte chunks a row
#define PASS_ROWS (32 / CHUNKS)
static_assert(KEY_GROUP % PASS_ROWS == 0, "a pass of rows lies in one group");

// ANCHOR: load_keys
// A warp copies `valid` rows (at most KEYS) of keys or values into its swizzled tile of
// KEYS rows; the rows past `valid` become zeros. The rows come in groups of KEY_GROUP,
// consecutive rows of HEAD_DIM values in memory, group u from `group(u)` on (in a paged
// cache a page holds whole groups). Consecutive lanes copy consecutive 16-byte
// chunks: each instruction of the warp reads 512 contiguous bytes.
template <typename Group>
__device__ __forceinline__ void load_keys(u16* tile, Group group, int valid, int lane) {
    const int chunk = lane % CHUNKS, r0 = lane / CHUNKS;
    // each group's first row, asked for once; a group wholly past `valid` is not asked
    // for (a page table has no entry there) and copies nothing
    const u16* rows[KEYS / KEY_GROUP];
#pragma unroll
    for (int u = 0; u < KEYS / KEY_GROUP; ++u)
        rows[u] = u == 0 || KEY_GROUP * u < valid ? group(u) : rows[0];
#pragma unroll
    for (int i = 0; i < KEYS / PASS_ROWS; ++i) {
        const int r = r0 + i * PASS_ROWS;
        const int u = i * PASS_ROWS / KEY_GROUP;  // r's group, since r0 < PASS_ROWS
        const bool ok = r < valid;
        const u16* from =
            ok ? rows[u] + (r - KEY_GROUP * u) * HEAD_DIM + chunk * 8 : rows[0];
        cp_async_16(smem_addr(tile + swizzled(r, chunk)), from, ok);
    }
}
// ANCHOR_END: load_keys

// ANCHOR: decode_merge
// The splits' partial results of one row merged by one warp: the same algebra as step 07's
// ring_merge, over all the splits at once,
//   lse = M + log Σ_s e^(lse_s - M)   (M the largest lse_s)
//   out = Σ_s e^(lse_s - lse)·out_s
// A split whose keys the row does not see has lse_s = -inf and weighs 0. The other blocks
// wrote the partial results: they are read through L2 (__ldcg), where their writes landed,
// never through this multiprocessor's L1.
#define MERGE_COLS (HEAD_DIM / 32)  // neighbouring columns a lane merges
#define MERGE_CHUNK 8               // splits whose loads are in flight together

// a lane's MERGE_COLS columns of one split's row: one 16-byte load at head dim 128
__device__ __forceinline__ void load_cols(const float* x, float (&y)[MERGE_COLS]) {
    if constexpr (MERGE_COLS == 4) {
        const float4 t = __ldcg((const float4*)x);
        y[0] = t.x, y[1] = t.y, y[2] = t.z, y[3] = t.w;
    } else if constexpr (MERGE_COLS == 2) {
        const float2 t = __ldcg((const float2*)x);
        y[0] = t.x, y[1] = t.y;
    } else {
        y[0] = __ldcg(x);
    }
}

__device__ __forceinline__ void merge_splits(
    const float* __restrict__ part_out,  // [B·KVH, splits, R, HEAD_DIM]
    const float* __restrict__ part_lse,  // [B·KVH, splits, R]
    u16* __restrict__ out,               // [B·KVH, R, HEAD_DIM]
    float* __restrict__ lse,             // [B·KVH, R]
    long long bk,                        // the (sequence, kv head) the row belongs to
    int r,                               // the row among its R
    int R,                               // query rows of each kv head
    int splits,                          // partial results of each row
    int lane                             // this thread's lane in the warp
) {
    const long long row = bk * R + r;
    const float* pl = part_lse + bk * splits * R + r;  // split s at pl[s·R]
    float mx = NEG_INF;
    for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, __ldcg(pl + (long long)s * R));
#pragma unroll
    for (int x = 16; x > 0; x /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, x));
    float sum = 0.f;
    if (mx != NEG_INF)
        for (int s = lane; s < splits; s += 32)
            sum += __expf(__ldcg(pl + (long long)s * R) - mx);
#pragma unroll
    for (int x = 16; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffff, sum, x);
    const float row_lse = mx == NEG_INF ? NEG_INF : mx + __logf(sum);
    float acc[MERGE_COLS] = {};
    const float* po = part_out + (bk * splits * R + r) * HEAD_DIM + lane * MERGE_COLS;
    // MERGE_CHUNK splits at a time, every load issued before the first is used: a loop
    // that used each split's load at once would wait for the memory once per split
    for (int s0 = 0; mx != NEG_INF && s0 < splits; s0 += MERGE_CHUNK) {
        float w[MERGE_CHUNK], y[MERGE_CHUNK][MERGE_COLS];
#pragma unroll
        for (int c = 0; c < MERGE_CHUNK; ++c) {
            const long long s = s0 + c;
            w[c] = s < splits ? __ldcg(pl + s * R) : NEG_INF;
#pragma unroll
            for (int i = 0; i < MERGE_COLS; ++i) y[c][i] = 0.f;
            if (s < splits) load_cols(po + s * R * HEAD_DIM, y[c]);
        }
#pragma unroll
        for (int c = 0; c < MERGE_CHUNK; ++c) {
            const float share = __expf(w[c] - row_lse);  // e^-inf = 0
#pragma unroll
            for (int i = 0; i < MERGE_COLS; ++i) acc[i] += share * y[c][i];
        }
    }
    u16* dst = out + row * HEAD_DIM + lane * MERGE_COLS;
    if constexpr (MERGE_COLS == 1) {
        dst[0] = from_f32(acc[0]);
    } else {
#pragma unroll
        for (int i = 0; i < MERGE_COLS; i += 2)
            *(u32*)(dst + i) = pack2(acc[i], acc[i + 1]);
    }
    if (lane == 0) lse[row] = row_lse;
}
// ANCHOR_END: decode_merge

// ANCHOR: decode_signature
extern "C" __global__ void __launch_bounds__(THREADS) flash_decode(
    const u16* __restrict__ q,         // [B, KVH, R, HEAD_DIM]: each kv head's R query rows
    const u16* __restrict__ k,         // the keys: [B, KVH, T, HEAD_DIM], or a pool
    const u16* __restrict__ v,         // the values, laid out as k
    const int* __restrict__ table,     // PAGE_SIZE > 0: [B, max_pages], each page's place
    u16* __restrict__ out,             // [B, KVH, R, HEAD_DIM], the output
    float* __restrict__ lse,           // [B, KVH, R], each row's natural log-sum-exp
    float* __restrict__ part_out,      // splits: [B, KVH, splits, R, HEAD_DIM], f32
    float* __restrict__ part_lse,      // splits: [B, KVH, splits, R]
    unsigned* __restrict__ done,       // splits: [B, KVH] blocks finished, 0 at launch
    const int* __restrict__ lens,      // [B] tokens in each sequence's cache now, the query
                                       // rows' own included (read as at most T)
    int T,                             // tokens a sequence's cache has room for: the
                                       // contiguous cache's rows, the page table's reach
    int n,                             // query rows a head: row i sees keys ≤ len - n + i
    int R,                             // query rows of each kv head, g·n ≤ ROWS
    int max_pages,                     // PAGE_SIZE > 0: the page table's row length
    int split_keys,                    // keys of each split, a multiple of WARPS·KEYS
    float scale_log2                   // log2(e)/sqrt(HEAD_DIM): scores in base-2 units
) {
    // ANCHOR_END: decode_signature
    extern __shared__ __align__(128) u16 smem[];
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int splits = gridDim.x, KVH = gridDim.y;
    const long long bk = (long long)b * KVH + kvh;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // fragment row and column pair (see mma_16816)

    u16* sq = smem;                                  // [ROWS][HEAD_DIM]
    u16* sk = sq + ROWS * HEAD_DIM + warp * (2 * STAGES * KEYS * HEAD_DIM);
    u16* sv = sk + STAGES * KEYS * HEAD_DIM;         // this warp's [STAGES][KEYS][HEAD_DIM]

    // ANCHOR: seq_len
    // Each sequence's length is read from memory: the sequences of a batch may end at
    // different tokens. The block's keys are s0 .. s1 - 1 (none when the split starts
    // past the sequence's end); at its step j warp w takes the KEYS keys from
    // s0 + (j·WARPS + w)·KEYS.
    const int len = min(lens[b], T);
    const int s0 = split * split_keys, s1 = min(s0 + split_keys, len);
    const int steps = (s1 - s0 + WARPS * KEYS - 1) / (WARPS * KEYS);
    // ANCHOR_END: seq_len

    // ANCHOR: key_rows
    // Where the KEY_GROUP keys from key `kv` start in memory: one row after another in a
    // contiguous cache, and in a paged cache in the page the table names (KEY_GROUP
    // divides PAGE_SIZE and kv is a multiple of it, so they lie in one page).
    auto key_rows = [&](const u16* base, int kv) -> const u16* {
#if PAGE_SIZE
        const long long page = table[(long long)b * max_pages + kv / PAGE_SIZE];
        return base + ((page * KVH + kvh) * PAGE_SIZE + kv % PAGE_SIZE) * HEAD_DIM;
#else
        return base + (bk * T + kv) * HEAD_DIM;
#endif
    };
    auto load_step = [&](int j) {
        const int kv = s0 + (j * WARPS + warp) * KEYS;
        if (kv >= s1) return;  // past the split: this warp has no keys at step j
        const int stage = j % STAGES, valid = min(KEYS, s1 - kv);
        load_keys(sk + stage * KEYS * HEAD_DIM,
                  [&](int u) { return key_rows(k, kv + KEY_GROUP * u); }, valid, lane);
        load_keys(sv + stage * KEYS * HEAD_DIM,
                  [&](int u) { return key_rows(v, kv + KEY_GROUP * u); }, valid, lane);
    };
    // ANCHOR_END: key_rows

    // q's rows (rows past R are zeros), then the first STAGES - 1 steps of keys and values
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, chunk = c % CHUNKS;
        const bool ok = r < R;
        const u16* from = ok ? q + (bk * R + r) * HEAD_DIM + chunk * 8 : q;
        cp_async_16(smem_addr(sq + swizzled(r, chunk)), from, ok);
    }
    cp_async_commit();
#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) {
        if (j < steps) load_step(j);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();
    __syncthreads();  // q, copied by every thread, is in shared memory

    const BOffsets off(lane);
    u32 q_at[HEAD_DIM / 16];  // q's A fragments: row lane % 16, chunk 2kk + lane / 16
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
        q_at[kk] = smem_addr(sq + swizzled(lane & 15, 2 * kk + (lane >> 4)));

    // the causal diagonal, aligned to the cache's end: a thread's rows mt·16 + g + 8h see
    // keys up to last[mt][h] = len - n + (row mod n)
    int last[ROW_TILES][2];
#pragma unroll
    for (int mt = 0; mt < ROW_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) last[mt][h] = len - n + (mt * 16 + g + 8 * h) % n;
    // keys from here on are masked for some row: past the split, or after a row's last key
    const int mask_from = min(s1, len - n + 1);

    // the online softmax's running state, as in step 03's kernel: m the largest raw score,
    // l this thread's part of the sum of e^(s - m), o the unnormalised output
    float m[ROW_TILES][2], l[ROW_TILES][2];
    float o[ROW_TILES][HEAD_DIM / 8][4];
#pragma unroll
    for (int mt = 0; mt < ROW_TILES; ++mt) {
        m[mt][0] = m[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
        for (int nn = 0; nn < HEAD_DIM / 8; ++nn)
            o[mt][nn][0] = o[mt][nn][1] = o[mt][nn][2] = o[mt][nn][3] = 0.f;
    }

    // ANCHOR: decode_loop
    for (int j = 0; j < steps; ++j) {
        // the copies of step j + STAGES - 1 start before step j is computed on
        if (j + STAGES - 1 < steps) load_step(j + STAGES - 1);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();  // this lane's copies of step j have landed ...
        __syncwarp();                 // ... and so have the other lanes'
        const int kv = s0 + (j * WARPS + warp) * KEYS;
        if (kv < s1) {
            const int stage = j % STAGES;
            const u32 ks = smem_addr(sk + stage * KEYS * HEAD_DIM);
            const u32 vs = smem_addr(sv + stage * KEYS * HEAD_DIM);

            // s = q·kᵀ for the ROWS rows x KEYS keys
            float s[ROW_TILES][KEYS / 8][4];
#pragma unroll
            for (int mt = 0; mt < ROW_TILES; ++mt)
#pragma unroll
                for (int nn = 0; nn < KEYS / 8; ++nn)
                    s[mt][nn][0] = s[mt][nn][1] = s[mt][nn][2] = s[mt][nn][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
                u32 qf[ROW_TILES][4];
#pragma unroll
                for (int mt = 0; mt < ROW_TILES; ++mt)
                    ldmatrix_x4(q_at[kk] + mt * (16 * HEAD_DIM * 2), qf[mt][0], qf[mt][1],
                                qf[mt][2], qf[mt][3]);
#pragma unroll
                for (int nn = 0; nn < KEYS / 8; nn += 2) {
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4(ks + off.abt(kk) + nn * (8 * HEAD_DIM * 2), b0, b1, b2, b3);
#pragma unroll
                    for (int mt = 0; mt < ROW_TILES; ++mt) {
                        mma_16816(s[mt][nn], qf[mt], b0, b1);
                        mma_16816(s[mt][nn + 1], qf[mt], b2, b3);
                    }
                }
            }

            // -inf for keys past the split (zeros in shared memory) or after a row's last
            if (kv + KEYS > mask_from) {
#pragma unroll
                for (int mt = 0; mt < ROW_TILES; ++mt)
#pragma unroll
                    for (int nn = 0; nn < KEYS / 8; ++nn)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = kv + nn * 8 + 2 * t + (e & 1);
                            if (key >= s1 || key > last[mt][e >> 1]) s[mt][nn][e] = NEG_INF;
                        }
            }

            // the online softmax of step 03's kernel
#pragma unroll
            for (int mt = 0; mt < ROW_TILES; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float mx = m[mt][h];
#pragma unroll
                    for (int nn = 0; nn < KEYS / 8; ++nn)
                        mx = fmaxf(mx, fmaxf(s[mt][nn][2 * h], s[mt][nn][2 * h + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                    // a row that has seen no key yet keeps its zeros
                    const float m_scaled = mx == NEG_INF ? 0.f : mx * scale_log2;
                    const float correction = fast_exp2(m[mt][h] * scale_log2 - m_scaled);
                    m[mt][h] = mx;
                    l[mt][h] *= correction;
#pragma unroll
                    for (int nn = 0; nn < HEAD_DIM / 8; ++nn) {
                        o[mt][nn][2 * h] *= correction;
                        o[mt][nn][2 * h + 1] *= correction;
                    }
#pragma unroll
                    for (int nn = 0; nn < KEYS / 8; ++nn) {
#pragma unroll
                        for (int e = 2 * h; e < 2 * h + 2; ++e) {
                            const float x = fmaf(s[mt][nn][e], scale_log2, -m_scaled);
                            s[mt][nn][e] = fast_exp2(x);
                            l[mt][h] += s[mt][nn][e];
                        }
                    }
                }

            // o += p·v, p from registers (accumulators_to_a), v by the transposing ldmatrix
#pragma unroll
            for (int kk = 0; kk < KEYS / 16; ++kk) {
                u32 pa[ROW_TILES][4];
#pragma unroll
                for (int mt = 0; mt < ROW_TILES; ++mt)
                    accumulators_to_a(s[mt][2 * kk], s[mt][2 * kk + 1], pa[mt]);
#pragma unroll
                for (int nn = 0; nn < HEAD_DIM / 8; nn += 2) {
                    u32 b0, b1, b2, b3;
                    const u32 at = vs + off.ab(nn / 2) + kk * (16 * HEAD_DIM * 2);
                    ldmatrix_x4_trans(at, b0, b1, b2, b3);
#pragma unroll
                    for (int mt = 0; mt < ROW_TILES; ++mt) {
                        mma_16816(o[mt][nn], pa[mt], b0, b1);
                        mma_16816(o[mt][nn + 1], pa[mt], b2, b3);
                    }
                }
            }
        }
        __syncwarp();  // every lane is done with this stage before a later copy refills it
    }
    // ANCHOR_END: decode_loop

    // ANCHOR: warps_merge
    // The warps' partial results, each over its own keys, merge in shared memory (the
    // pipelines' space, now idle): unnormalised outputs o_w, maxima m_w in base-2 units
    // and sums l_w, then for each row M = max m_w, L = Σ l_w·2^(m_w - M),
    // O = Σ o_w·2^(m_w - M) / L: chapter 2's rescaling once more.
    cp_async_wait<0>();
    __syncthreads();
    float* red_o = (float*)(sq + ROWS * HEAD_DIM);   // [WARPS][ROWS][HEAD_DIM]
    float* red_m = red_o + WARPS * ROWS * HEAD_DIM;  // [WARPS][ROWS]
    float* red_l = red_m + WARPS * ROWS;             // [WARPS][ROWS]
#pragma unroll
    for (int mt = 0; mt < ROW_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = mt * 16 + g + 8 * h;
            float* dst = red_o + (warp * ROWS + row) * HEAD_DIM + 2 * t;
#pragma unroll
            for (int nn = 0; nn < HEAD_DIM / 8; ++nn)
                *(float2*)(dst + 8 * nn) =
                    make_float2(o[mt][nn][2 * h], o[mt][nn][2 * h + 1]);
            float sum = l[mt][h];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            if (t == 0) {
                red_m[warp * ROWS + row] = m[mt][h] == NEG_INF ? NEG_INF
                                                               : m[mt][h] * scale_log2;
                red_l[warp * ROWS + row] = sum;
            }
        }
    __syncthreads();
    for (int c = threadIdx.x; c < R * (HEAD_DIM / 4); c += THREADS) {
        const int row = c / (HEAD_DIM / 4), col = c % (HEAD_DIM / 4) * 4;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, red_m[w * ROWS + row]);
        float sum = 0.f;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (mx != NEG_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float share = fast_exp2(red_m[w * ROWS + row] - mx);  // 2^-inf = 0
                const float4 x =
                    *(const float4*)(red_o + (w * ROWS + row) * HEAD_DIM + col);
                sum += share * red_l[w * ROWS + row];
                acc.x += share * x.x;
                acc.y += share * x.y;
                acc.z += share * x.z;
                acc.w += share * x.w;
            }
        }
        // a split none of whose keys this row sees: output 0, log-sum-exp -inf
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const float row_lse =
            sum > 0.f ? (mx + __log2f(sum)) * 0.6931471805599453f : NEG_INF;
        const long long r = bk * R + row;
        if (splits == 1) {
            const uint2 packed = make_uint2(pack2(acc.x * inv, acc.y * inv),
                                            pack2(acc.z * inv, acc.w * inv));
            *(uint2*)(out + r * HEAD_DIM + col) = packed;
            if (col == 0) lse[r] = row_lse;
        } else {
            const long long p = (bk * splits + split) * R + row;
            *(float4*)(part_out + p * HEAD_DIM + col) =
                make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
            if (col == 0) part_lse[p] = row_lse;
        }
    }
    // ANCHOR_END: warps_merge

    // ANCHOR: last_block
    // The last block of a (sequence, kv head) to finish merges its splits. Each thread's
    // writes are made visible to the whole GPU (__threadfence) before thread 0 counts the
    // block done; the block that counts splits - 1 sees every other block's writes, merges,
    // and leaves the counter at zero for the next launch.
    if (splits > 1) {
        __shared__ bool is_last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) is_last = atomicAdd(done + bk, 1u) == (unsigned)splits - 1;
        __syncthreads();
        if (is_last) {
            for (int row = warp; row < R; row += WARPS)
                merge_splits(part_out, part_lse, out, lse, bk, row, R, splits, lane);
            if (threadIdx.x == 0) done[bk] = 0;
        }
    }
    // ANCHOR_END: last_block
}

