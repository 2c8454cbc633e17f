// The backward, rung 2: one pass, as FlashAttention-2 and -3 take it: the dK and dV pass of
// rung 1 gives dQ too, and no dQ pass runs. After hopper.cuh and backward.cuh (and, in this
// module, hopper_delta runs first).
//
// A block of keys meets every query block that sees it, so it holds a part of those
// queries' dQ = dS·k: the sum over the key blocks of each one's part. Here two consumer
// warpgroups own 64 keys each; each stores its dSᵀ into shared memory (stmatrix,
// transposed, in the 128-byte swizzle), and the two take turns at the block's dQ: warpgroup
// n % 2 takes block n's, over both warpgroups' 128 keys, while the other goes on to the
// next block. The dQ goes through a buffer in shared memory to the producer warpgroup's
// second warp, which adds it into f32 sums in global memory with one bulk reduction
// (cp.reduce.async.bulk) a half; hopper_dq_convert then scales and rounds the sums. The
// sums' order, and so dQ's last bits, depend on which blocks finish first; dK and dV are
// rung 1's, bit for bit.

static_assert(WGS == 2, "two consumer warpgroups take turns at dQ");
static_assert(STREAM == 64, "64 queries a block: one dS tile of 64 × 64 a warpgroup");

// dV += Pᵀ·dO is issued as soon as Pᵀ is made and runs while dSᵀ is made, where Pᵀ's
// fragments can stay in registers meanwhile: at head dim 64. At 128 the producer keeps 32
// registers for the adding warp, and the consumers cannot spare them
#define EARLY_DV (HEAD_DIM == 64)
// A block's dQ. At head dim 64 it is taken transposed, dQᵀ = kᵀ·dSᵀ: an m64n64 product (the
// head dim by 64 queries) reading k M-major, as v is read. At 128, as dQ = dS·k: one
// m64n128 product the head dim across, whose k-steps read 6 KB of shared memory for 64
// cycles of the tensor cores (96 bytes a cycle, where m64n64 products take all 128 it
// gives); the warpgroup first waits for its dV and dK, whose fragments' registers then hold
// dQ's 64 accumulators
#define DQ_ROWS (HEAD_DIM == 128)
#define DQ_REGS (HEAD_DIM / 2)
// DQ_BUFS buffers of dQ, 64 queries of HEAD_DIM f32 each: with one, a warpgroup stores a
// block's dQ only once the adding warp has read the last block's (the shared memory of a
// third stage at head dim 128)
static_assert(DQ_BUFS == 2 || (DQ_BUFS == 1 && HEAD_DIM == 128),
              "two dQ buffers (one at head dim 128)");

// Named barriers (0 is __syncthreads'). A block's dS written by both warpgroups, read by
// the one that takes its dQ (256 threads), one for each parity of blocks, so that the
// arrival of a warpgroup that has run a block ahead is not counted as the other's; dQ
// buffer b written (the warpgroup that wrote it and the adding warp, 160), and read by the
// bulk reductions
#define BAR_DS(n) ((n) % 2 ? 10 : 1)
#define BAR_DQ_WRITTEN(wg, b) (2 + 2 * (wg) + (b))
#define BAR_DQ_READ(wg, b) (DQ_ROWS ? 6 + (b) : 6 + 2 * (wg) + (b))
#define BAR_DQ_COUNT (128 + 32)

// dSᵀ's fragments into a warpgroup's tile at `tile`: dsf[2j + h] is an 8×8 fragment (keys
// warp·16 + 8h.., queries 8j..); stmatrix stores four at a time transposed, a query a row,
// in the 128-byte swizzle (chunk c of row r at c ^ (r % 8)), lanes 8m..8m+7 naming the rows
// of fragment m; then made visible to the tensor cores' reads
__device__ __forceinline__ void store_ds_t(u32 tile, const u32 (&dsf)[STREAM / 4], int warp,
                                           int lane) {
#pragma unroll
  for (int j = 0; j < STREAM / 8; j += 2) {
    const u32 row = 8 * (j + lane / 16) + lane % 8, chunk = 2 * warp + (lane / 8) % 2;
    asm volatile(
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
            tile + row * 128 + ((chunk ^ (row % 8)) * 16)),
        "r"(dsf[2 * j]), "r"(dsf[2 * j + 1]), "r"(dsf[2 * j + 2]), "r"(dsf[2 * j + 3])
        : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ANCHOR: issue_dq
// The block's dQ over its 128 keys, 16 a k-step, from the two warpgroups' dS tiles at ads
// (dS K-major: a query a row) and k at sk: dQᵀ = kᵀ·dSᵀ at head dim 64, dQ = dS·k at 128 (k
// MN-major over the whole head dim, its two 64-column halves BLOCK_ROWS·128 bytes apart:
// the descriptor's leading offset)
template <int REGS>
__device__ __forceinline__ void issue_dq(float (&dq)[REGS], u32 sk, u32 ads) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const u64 ds = descriptor(ads + (kk / 4) * 64 * 128 + (kk % 4) * 32, QK_LBO, QK_SBO);
    if constexpr (REGS == 64) {
      wgmma_m64n128_ss<1>(dq, ds, descriptor(sk + kk * 16 * 128, BLOCK_ROWS * 128, V_SBO),
                          kk > 0);
    } else {
      wgmma_m64n64_ss<0, 1>(dq, descriptor(sk + kk * 16 * 128, V_LBO, V_SBO), ds, kk > 0);
    }
  }
}
// ANCHOR_END: issue_dq

// dQ's registers into buffer b for the adding warp, once it has read what was last in it:
// dq[4i..4i+3] of thread t at float 4·(128·i + t); then the warp is told. `reused`: the
// buffer held an earlier block's dQ
__device__ __forceinline__ void store_dq(unsigned char* sdq, const float (&dq)[DQ_REGS],
                                         int b, bool reused, int wg, int tid) {
  if (reused)
    asm volatile("bar.sync %0, %1;\n" ::"r"(BAR_DQ_READ(wg, b)), "n"(BAR_DQ_COUNT)
                 : "memory");
  const u32 adq = smem_u32(sdq) + b * 64 * HEAD_DIM * 4 + (tid % 128) * 16;
#pragma unroll
  for (int i = 0; i < DQ_REGS / 4; ++i) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(adq + i * 128 * 16),
                 "f"(dq[4 * i]), "f"(dq[4 * i + 1]), "f"(dq[4 * i + 2]), "f"(dq[4 * i + 3])
                 : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  asm volatile("bar.arrive %0, %1;\n" ::"r"(BAR_DQ_WRITTEN(wg, b)), "n"(BAR_DQ_COUNT)
               : "memory");
}

// ANCHOR: add_dq
// The adding warp: each block's dQ buffer (DQ_BUFS in turn at sdq), written by warpgroup n
// % 2, into the f32 sums of its block of queries, first + n, with a bulk reduction a half;
// the warpgroup is told when it has been read. Not inlined: the producer's registers would
// otherwise have to hold what it computes
__device__ __noinline__ void add_dq(float* dq_accum, unsigned char* sdq, int head,
                                    int first, int n_blocks, int tokens, int lane) {
  float* dst = dq_accum + ((u64)head * ((tokens + 63) / 64) + first) * 64 * HEAD_DIM;
  const auto reduce_half = [&](int b, int half) {
    if (lane == 0) {
      asm volatile(
          "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::
              "l"(dst + half * 32 * HEAD_DIM),
          "r"(smem_u32(sdq + b * 64 * HEAD_DIM * 4 + half * 32 * HEAD_DIM * 4)),
          "n"(32 * HEAD_DIM * 4)
          : "memory");
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
  };
#pragma unroll 1
  for (int n = 0; n < n_blocks; ++n, dst += 64 * HEAD_DIM) {
    const int b = n % DQ_BUFS, w = n % 2;
    asm volatile("bar.sync %0, %1;\n" ::"r"(BAR_DQ_WRITTEN(w, b)), "n"(BAR_DQ_COUNT)
                 : "memory");
    reduce_half(b, 0);
    reduce_half(b, 1);
    // the buffer has been read: the consumers may write it again
    if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    __syncwarp();
    if (n + DQ_BUFS < n_blocks)
      asm volatile("bar.arrive %0, %1;\n" ::"r"(BAR_DQ_READ(w, b)), "n"(BAR_DQ_COUNT)
                   : "memory");
  }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// ANCHOR_END: add_dq

// ANCHOR: one_pass
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    hopper_dkdv(const __grid_constant__ TensorMap map_q,  // q, read in boxes of STREAM rows
                const __grid_constant__ TensorMap map_k,  // k, in boxes of BLOCK_ROWS rows
                const __grid_constant__ TensorMap map_v,  // v, in boxes of BLOCK_ROWS rows
                const __grid_constant__ TensorMap map_do,  // dO, in boxes of STREAM rows
                const float* __restrict__ lse,    // the forward's [batch · heads, tokens]
                const float* __restrict__ delta,  // δ, [batch · heads, tokens]
                u16* __restrict__ dk_out,         // dK, where `layout` says
                u16* __restrict__ dv_out,         // dV, where `layout` says
                const Layout layout,              // the gradients' strides
                float* __restrict__ dq_accum,     // dQ's f32 sums, zeros at the start
                int q_per_kv,  // query heads per head of k and v // [step 08]
                int tokens,                       // the sequence's length
                float scale_log2,                 // 1/√d · log2(e)
                float scale) {                    // 1/√d, dK's factor
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* sk = smem;
  unsigned char* sv = sk + BLOCK_ROWS * ROW_BYTES;
  unsigned char* sq = sv + BLOCK_ROWS * ROW_BYTES;
  unsigned char* sdo = sq + STAGES * STREAM * ROW_BYTES;
  // two buffers of dS, each both warpgroups' tiles ([64 queries][64 keys] each, K-major for
  // dQ = dS·k), then DQ_BUFS of dQ in f32
  unsigned char* sds = sdo + STAGES * STREAM * ROW_BYTES;
  unsigned char* sdq = sds + 2 * WGS * 64 * 128;
  __shared__ float slse[STAGES][STREAM], sdelta[STAGES][STREAM];
  __shared__ __align__(8) u64 full[STAGES], empty[STAGES], kvbar;

  // the first key blocks are seen by the most queries: they start first
  const BlockPlace place = block_place(tokens, false);
  const int head = place.head, k0 = place.block * BLOCK_ROWS;
  // the queries from the block holding key k0 to the end see these keys
  const int first = k0 / STREAM, n_blocks = (tokens + STREAM - 1) / STREAM - first;
  const int tid = threadIdx.x, wg = tid / 128;
  init_barriers(&kvbar, full, empty, 128 * WGS);

  if (wg == WGS) {
    release_registers<PRODUCER_REGS>();
    if (tid < 128 * WGS + 32) {
      produce<true>(&map_k, &map_v, &map_q, &map_do, sk, sv, sq, sdo, slse, sdelta, &kvbar,
                    full, empty, lse, delta, k0, first * STREAM, n_blocks, head,
                    layout.heads,
                    q_per_kv, 1,  // k, v grouped; q, dO not // [step 08]
                    tokens, tid % 32);
    } else if (tid < 128 * WGS + 64) {
      add_dq(dq_accum, sdq, head, first, n_blocks, tokens, tid % 32);
    }
    return;
  }

  take_registers<CONSUMER_REGS>();
  // a consumer warpgroup: 64 keys, 16 per warp; each thread holds two keys, kr0 and kr0 + 8
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int kw0 = k0 + wg * 64, kr0 = kw0 + warp * 16 + lane / 4;
  float dk[HALVES][32], dv[HALVES][32];
#pragma unroll
  for (int h = 0; h < HALVES; ++h) {
#pragma unroll
    for (int i = 0; i < 32; ++i) dk[h][i] = dv[h][i] = 0.f;
  }
  float st[STREAM / 2], dpt[STREAM / 2];
  u32 pf[STREAM / 4], dsf[STREAM / 4];
  const u32 ak = smem_u32(sk) + wg * 64 * 128, av = smem_u32(sv) + wg * 64 * 128,
            kv_half = BLOCK_ROWS * 128;
  mbar_wait(smem_u32(&kvbar), 0);

  for (int n = 0; n < n_blocks; ++n) {
    const int s = n % STAGES, q0 = (first + n) * STREAM;
    mbar_wait(smem_u32(&full[s]), (n / STAGES) & 1);
    // every block, even one whose queries all come before this warpgroup's keys: its dS
    // tile (zeros then) is read by the block's dQ product
    const u32 aq = smem_u32(sq + s * STREAM * ROW_BYTES),
              ado = smem_u32(sdo + s * STREAM * ROW_BYTES);
    // two groups of products: Pᵀ is made from Sᵀ while dPᵀ is still being computed
    wgmma_fence();
    issue_abt<STREAM>(st, ak, kv_half, aq, STREAM * 128);    // Sᵀ = k·qᵀ
    wgmma_commit();
    issue_abt<STREAM>(dpt, av, kv_half, ado, STREAM * 128);  // dPᵀ = v·dOᵀ
    wgmma_commit();
    wgmma_wait1();
    fence_operands(st);
    probabilities_t(st, slse[s], q0, kw0, kr0, lane, scale_log2);
    pack_fragments<STREAM>(pf, st);
    if constexpr (EARLY_DV) {
      wgmma_fence();
      issue_pb<STREAM>(dv, pf, ado, STREAM);  // dV += Pᵀ·dO
      wgmma_commit();
      wgmma_wait1();  // dPᵀ has landed (dV may not have)
    } else {
      wgmma_wait0();
    }
    fence_operands(dpt);
    scores_grad_t(dpt, st, sdelta[s], lane);
    pack_fragments<STREAM>(dsf, dpt);
    const u32 ads = smem_u32(sds) + (n % 2) * WGS * 64 * 128;
    store_ds_t(ads + wg * 64 * 128, dsf, warp, lane);
    wgmma_fence();
    if constexpr (!EARLY_DV) issue_pb<STREAM>(dv, pf, ado, STREAM);  // dV += Pᵀ·dO
    issue_pb<STREAM>(dk, dsf, aq, STREAM);  // dK += dSᵀ·q  (· scale at the end)
    wgmma_commit();
    // this warpgroup takes block n's dQ if n % 2 is its index (read through a shuffle:
    // ptxas then sees the branch taken by whole warps and does not serialise the products
    // in it); it waits for the other's dS, which goes on
    const bool dq_here = __shfl_sync(0xffffffff, wg, 0) == n % 2;
    if constexpr (DQ_ROWS) {
      // both warpgroups wait for their dV and dK first, outside any branch, so that ptxas
      // sees Pᵀ's and dSᵀ's fragments free wherever dQ's 64 accumulators are live; the
      // other warpgroup says its dS is written before it waits
      if (!dq_here)
        asm volatile("bar.arrive %0, %1;\n" ::"r"(BAR_DS(n)), "n"(128 * WGS) : "memory");
      wgmma_wait0();
      fence_operands(dv);
      fence_operands(dk);
      if (dq_here) {
        float dq[DQ_REGS];
        asm volatile("bar.sync %0, %1;\n" ::"r"(BAR_DS(n)), "n"(128 * WGS) : "memory");
        wgmma_fence();
        issue_dq(dq, smem_u32(sk), ads);
        wgmma_commit();
        wgmma_wait0();
        fence_operands(dq);
        store_dq(sdq, dq, n % DQ_BUFS, n >= DQ_BUFS, wg, tid);
      }
    } else {
      // dQᵀ's product runs beside dK's
      float dq[DQ_REGS];
      if (dq_here) {
        asm volatile("bar.sync %0, %1;\n" ::"r"(BAR_DS(n)), "n"(128 * WGS) : "memory");
        wgmma_fence();
        issue_dq(dq, smem_u32(sk), ads);
      } else {
        asm volatile("bar.arrive %0, %1;\n" ::"r"(BAR_DS(n)), "n"(128 * WGS) : "memory");
      }
      wgmma_commit();
      wgmma_wait0();
      fence_operands(dv);
      fence_operands(dk);
      if (dq_here) {
        fence_operands(dq);
        store_dq(sdq, dq, n % DQ_BUFS, n >= DQ_BUFS, wg, tid);
      }
    }
    // this thread is done with the buffer
    release_stage(empty, s);
  }
  const long long start = layout.start(head);
  store_rows(dk_out + start, layout.token, dk, scale, kr0, tokens, lane);
  store_rows(dv_out + start, layout.token, dv, 1.f, kr0, tokens, lane);
}
// ANCHOR_END: one_pass

// dq = 16-bit(acc · scale) where `layout` puts it, from the f32 sums in the order the
// adding warp wrote: [heads, blocks of 64 queries, 64 · HEAD_DIM], where the float4 at
// 128·j + t (t = 32·warp + lane) holds register 4j + e (e = 0..3) of thread t of the
// warpgroup that took the block's dQ. A thread takes an eighth of a block's sums (`items`:
// an eighth of them all).
extern "C" __global__ void
hopper_dq_convert(const float* __restrict__ acc,  // dQ's f32 sums
                  u16* __restrict__ dq,           // dQ, where `layout` says
                  const Layout layout,            // its strides
                  int tokens,                     // the sequence's length
                  long long items,                // threads' worth of work
                  float scale) {                  // 1/√d
  const int blocks = (tokens + 63) / 64;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < items;
       i += (long long)gridDim.x * blockDim.x) {
    const long long blk = i / (8 * HEAD_DIM);
    const int bh = (int)(blk / blocks);
    if constexpr (DQ_ROWS) {
      // dQ: register 4j + e is query 16·warp + lane/4 + 8·(e/2), column 8j + 2·(lane%4) +
      // e%2; a thread reads the float4s of j and j + 1 (j even) and writes two pairs of
      // columns in each of two rows
      const int r = (int)(i % (8 * HEAD_DIM)), j = 2 * (r / 128), t = r % 128;
      const int warp = t / 32, lane = t % 32;
      const float4* at =
          reinterpret_cast<const float4*>(acc + blk * 64 * HEAD_DIM) + 128 * j + t;
      const float4 a = at[0], b = at[128];
      const int q = (int)(blk % blocks) * 64 + 16 * warp + lane / 4;
      u16* row =
          dq + layout.start(bh) + (long long)q * layout.token + 8 * j + 2 * (lane % 4);
      if (q < tokens) {
        *reinterpret_cast<u32*>(row) = pack(a.x * scale, a.y * scale);
        *reinterpret_cast<u32*>(row + 8) = pack(b.x * scale, b.y * scale);
      }
      if (q + 8 < tokens) {
        *reinterpret_cast<u32*>(row + 8 * layout.token) = pack(a.z * scale, a.w * scale);
        *reinterpret_cast<u32*>(row + 8 * layout.token + 8) =
            pack(b.z * scale, b.w * scale);
      }
    } else {
      // dQᵀ: register 4j + e is column 16·warp + L/4 + 8·(e/2), query 8j + 2·(L%4) + e%2
      // (L: the lane); lanes L and L + 4 hold neighbouring columns, so a thread reads both
      // float4s (L/4 even) and writes four pairs of columns
      const int r = (int)(i % (8 * HEAD_DIM)), j = r / 64, u = r % 64;
      const int warp = u / 16, L = 8 * ((u % 16) / 4) + u % 4;
      const float4* at = reinterpret_cast<const float4*>(acc + blk * 64 * HEAD_DIM) +
                         128 * j + 32 * warp + L;
      const float4 a = at[0], b = at[4];
      const int q = (int)(blk % blocks) * 64 + 8 * j + 2 * (L % 4);
      u16* row = dq + layout.start(bh) + (long long)q * layout.token + 16 * warp + L / 4;
      if (q < tokens) {
        *reinterpret_cast<u32*>(row) = pack(a.x * scale, b.x * scale);
        *reinterpret_cast<u32*>(row + 8) = pack(a.z * scale, b.z * scale);
      }
      if (q + 1 < tokens) {
        *reinterpret_cast<u32*>(row + layout.token) = pack(a.y * scale, b.y * scale);
        *reinterpret_cast<u32*>(row + layout.token + 8) = pack(a.w * scale, b.w * scale);
      }
    }
  }
}
