// The masked backward: step 06's one pass (backward_2_one_pass.cu, before this file, with
// its dS and dQ machinery and hopper_dq_convert) walking a block mask's list: a block of
// keys meets only the query blocks that see it, the mask is evaluated only in partial
// ones, and dS goes through the score function's derivative. After hopper.cuh,
// backward.cuh, backward_2_one_pass.cu, the mask's source and masked.cuh.

// ANCHOR: produce_listed
// backward.cuh's producer for the one pass, its stream of query blocks taken from the
// list: the block's keys and values once, then each listed block of STREAM queries with
// its rows' log-sum-exps (in base 2) and δs, and its entry in stage_entry (the consumers
// read it there, not from global memory on every block). A row past tq, or one that saw
// no key (a log-sum-exp of −∞), gets +∞: its probabilities are then 0
__device__ __forceinline__ void
produce_listed(const TensorMap* map_k, const TensorMap* map_v, const TensorMap* map_q,
               const TensorMap* map_do, unsigned char* sk, unsigned char* sv,
               unsigned char* sq, unsigned char* sdo, float (*slse)[STREAM],
               float (*sdelta)[STREAM], int* stage_entry, u64* kv_bar, u64* full,
               u64* empty,
               const float* lse, const float* delta, const BlockList& list, int row,
               int kb, int head, int heads, int q_per_kv, int tq, int lane) {
  const int kv_head = head / q_per_kv, kv_heads = heads / q_per_kv;
  const int n_blocks = list.n(row, kb);
  // keys no query sees are not loaded: their gradients are zeros
  if (lane == 0 && n_blocks > 0) {
    mbar_expect_tx(smem_u32(kv_bar), 2 * BLOCK_ROWS * ROW_BYTES);
    tma_load(smem_u32(sk), map_k, smem_u32(kv_bar), BLOCK_ROWS, kb * BLOCK_ROWS, kv_head,
             kv_heads);
    tma_load(smem_u32(sv), map_v, smem_u32(kv_bar), BLOCK_ROWS, kb * BLOCK_ROWS, kv_head,
             kv_heads);
  }
  for (int n = 0; n < n_blocks; ++n) {
    const int s = n % STAGES, entry = list.at(row, kb, n), row0 = (entry >> 1) * STREAM;
    if (n >= STAGES) mbar_wait(smem_u32(&empty[s]), ((n / STAGES) - 1) & 1);
    if (lane == 0) stage_entry[s] = entry;
    for (int i = lane; i < STREAM; i += 32) {
      const bool valid = row0 + i < tq;
      const float l = valid ? lse[(u64)head * tq + row0 + i] : INFINITY;
      slse[s][i] = l == -INFINITY ? INFINITY : l * LOG2E;
      sdelta[s][i] = valid ? delta[(u64)head * tq + row0 + i] : 0.f;
    }
    if (lane == 0) {
      mbar_expect_tx(smem_u32(&full[s]), 2 * STREAM * ROW_BYTES);
      tma_load(smem_u32(sq + s * STREAM * ROW_BYTES), map_q, smem_u32(&full[s]), STREAM,
               row0, head, heads);
      tma_load(smem_u32(sdo + s * STREAM * ROW_BYTES), map_do, smem_u32(&full[s]), STREAM,
               row0, head, heads);
    } else {
      mbar_arrive(smem_u32(&full[s]));
    }
  }
}
// ANCHOR_END: produce_listed

// one_pass's adding warp, each listed query block's dQ added into that block's f32 sums
__device__ __noinline__ void add_dq_listed(float* dq_accum, unsigned char* sdq, int head,
                                           const BlockList& list, int row, int kb, int tq,
                                           int lane) {
  float* base = dq_accum + (u64)head * ((tq + 63) / 64) * 64 * HEAD_DIM;
  const int n_blocks = list.n(row, kb);
#pragma unroll 1
  for (int n = 0; n < n_blocks; ++n) {
    float* dst = base + (u64)(list.at(row, kb, n) >> 1) * 64 * HEAD_DIM;
    const int b = n % DQ_BUFS, w = n % 2;
    asm volatile("bar.sync %0, %1;\n" ::"r"(BAR_DQ_WRITTEN(w, b)), "n"(BAR_DQ_COUNT)
                 : "memory");
    if (lane == 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        asm volatile(
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"
            " [%0], [%1], %2;\n" ::
                "l"(dst + half * 32 * HEAD_DIM),
            "r"(smem_u32(sdq + b * 64 * HEAD_DIM * 4 + half * 32 * HEAD_DIM * 4)),
            "n"(32 * HEAD_DIM * 4)
            : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      }
      asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
    __syncwarp();
    if (n + DQ_BUFS < n_blocks)
      asm volatile("bar.arrive %0, %1;\n" ::"r"(BAR_DQ_READ(w, b)), "n"(BAR_DQ_COUNT)
                   : "memory");
  }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

static_assert(STREAM == 64, "a listed block of queries is one of the block mask's tiles, "
                             "visible_bits_t's 64 queries");

// ANCHOR: probabilities_masked
// Pᵀ from Sᵀ (register 4j+e as in masked.cuh's visible_bits_t), through the score
// function, with the mask's bits (all ones in a full block): packed into pf for dV = Pᵀ·dO,
// and left in st times the score function's derivative there, for dS (the derivative is
// then needed nowhere else)
__device__ __forceinline__ void probabilities_masked(float (&st)[STREAM / 2],
                                                     u32 (&pf)[STREAM / 4],
                                                     const float* lse2, int q0, int kr0,
                                                     int lane, u32 bits, float scale,
                                                     float exp_scale, const MaskArgs& a) {
#pragma unroll
  for (int j = 0; j < STREAM / 8; ++j) {
    float p[4], g[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 8 * j + 2 * (lane % 4) + (e % 2);
      const int key = kr0 + 8 * (e / 2), qp = q0 + col + a.q_offset;
      float s = st[4 * j + e];
      g[e] = 1.f;
      if constexpr (!SCORE_MOD_IDENTITY) {
        g[e] = score_mod_grad(s * scale, a.b, a.h, qp, key);
        s = score_mod(s * scale, a.b, a.h, qp, key);
      }
      p[e] = (bits >> (4 * j + e)) & 1 ? fast_exp2(s * exp_scale - lse2[col]) : 0.f;
    }
    pf[2 * j] = pack(p[0], p[1]);
    pf[2 * j + 1] = pack(p[2], p[3]);
#pragma unroll
    for (int e = 0; e < 4; ++e) st[4 * j + e] = p[e] * g[e];
  }
}
// ANCHOR_END: probabilities_masked

// ANCHOR: masked_dkdv
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    masked_dkdv(const __grid_constant__ TensorMap map_q,   // q, in boxes of STREAM rows
                const __grid_constant__ TensorMap map_k,   // k, in boxes of BLOCK_ROWS rows
                const __grid_constant__ TensorMap map_v,   // v, in boxes of BLOCK_ROWS rows
                const __grid_constant__ TensorMap map_do,  // dO, in boxes of STREAM rows
                const float* __restrict__ lse,    // the forward's [batch · heads, tq]
                const float* __restrict__ delta,  // δ, [batch · heads, tq]
                u16* __restrict__ dk_out,         // dK, a query head's, where `layout` says
                u16* __restrict__ dv_out,         // dV, likewise
                const Layout layout,              // the gradients' strides
                float* __restrict__ dq_accum,     // dQ's f32 sums, zeros at the start
                int q_per_kv,                     // query heads per head of k and v
                int tq,                           // q's length
                int tk,                           // k's and v's length
                const BlockList list,             // the query blocks each key block meets
                const int* __restrict__ mask_data,  // the mask's data, or null
                float scale,                      // 1/√d
                float scale_log2) {               // 1/√d · log2(e)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* sk = smem;
  unsigned char* sv = sk + BLOCK_ROWS * ROW_BYTES;
  unsigned char* sq = sv + BLOCK_ROWS * ROW_BYTES;
  unsigned char* sdo = sq + STAGES * STREAM * ROW_BYTES;
  unsigned char* sds = sdo + STAGES * STREAM * ROW_BYTES;
  unsigned char* sdq = sds + 2 * WGS * 64 * 128;
  __shared__ float slse[STAGES][STREAM], sdelta[STAGES][STREAM];
  __shared__ __align__(8) u64 full[STAGES], empty[STAGES], kvbar;
  __shared__ int stage_entry[STAGES];

  const BlockPlace place = block_place(tk, false);
  const int head = place.head, kb = place.block, k0 = kb * BLOCK_ROWS;
  const int heads = layout.heads, b = head / heads, h = head % heads;
  const int row = list.row(b, h), n_blocks = list.n(row, kb);
  const int tid = threadIdx.x, wg = tid / 128;
  init_barriers(&kvbar, full, empty, 128 * WGS);

  if (wg == WGS) {
    release_registers<PRODUCER_REGS>();
    if (tid < 128 * WGS + 32) {
      produce_listed(&map_k, &map_v, &map_q, &map_do, sk, sv, sq, sdo, slse, sdelta,
                     stage_entry, &kvbar, full, empty, lse, delta, list, row, kb, head,
                     heads, q_per_kv, tq, tid % 32);
    } else if (tid < 128 * WGS + 64) {
      add_dq_listed(dq_accum, sdq, head, list, row, kb, tq, tid % 32);
    }
    return;
  }

  take_registers<CONSUMER_REGS>();
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int kw0 = k0 + wg * 64, kr0 = kw0 + warp * 16 + lane / 4;
  float dk[HALVES][32], dv[HALVES][32];
#pragma unroll
  for (int hh = 0; hh < HALVES; ++hh) {
#pragma unroll
    for (int i = 0; i < 32; ++i) dk[hh][i] = dv[hh][i] = 0.f;
  }
  const MaskArgs args{mask_data, b, h, tk - tq, tk};
  const float exp_scale = SCORE_MOD_IDENTITY ? scale_log2 : LOG2E;
  float st[STREAM / 2], dpt[STREAM / 2];
  u32 pf[STREAM / 4], dsf[STREAM / 4];
  const u32 ak = smem_u32(sk) + wg * 64 * 128, av = smem_u32(sv) + wg * 64 * 128,
            kv_half = BLOCK_ROWS * 128;
  if (n_blocks > 0) mbar_wait(smem_u32(&kvbar), 0);

  for (int n = 0; n < n_blocks; ++n) {
    const int s = n % STAGES;
    mbar_wait(smem_u32(&full[s]), (n / STAGES) & 1);
    const int entry = stage_entry[s], q0 = (entry >> 1) * STREAM;
    const u32 bits = entry & 1 ? 0xffffffffu : visible_bits_t(q0, kr0, lane, args);
    const u32 aq = smem_u32(sq + s * STREAM * ROW_BYTES),
              ado = smem_u32(sdo + s * STREAM * ROW_BYTES);
    wgmma_fence();
    issue_abt<STREAM>(st, ak, kv_half, aq, STREAM * 128);    // Sᵀ = k·qᵀ
    wgmma_commit();
    issue_abt<STREAM>(dpt, av, kv_half, ado, STREAM * 128);  // dPᵀ = v·dOᵀ
    wgmma_commit();
    wgmma_wait1();
    fence_operands(st);
    probabilities_masked(st, pf, slse[s], q0, kr0, lane, bits, scale, exp_scale, args);
    if constexpr (EARLY_DV) {
      wgmma_fence();
      issue_pb<STREAM>(dv, pf, ado, STREAM);  // dV += Pᵀ·dO
      wgmma_commit();
      wgmma_wait1();
    } else {
      wgmma_wait0();
    }
    fence_operands(dpt);
    scores_grad_t(dpt, st, sdelta[s], lane);  // dSᵀ = Pᵀ∘g ∘ (dPᵀ − δ)
    pack_fragments<STREAM>(dsf, dpt);
    const u32 ads = smem_u32(sds) + (n % 2) * WGS * 64 * 128;
    store_ds_t(ads + wg * 64 * 128, dsf, warp, lane);
    wgmma_fence();
    if constexpr (!EARLY_DV) issue_pb<STREAM>(dv, pf, ado, STREAM);
    issue_pb<STREAM>(dk, dsf, aq, STREAM);  // dK += dSᵀ·q  (· scale at the end)
    wgmma_commit();
    const bool dq_here = __shfl_sync(0xffffffff, wg, 0) == n % 2;
    if constexpr (DQ_ROWS) {
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
    release_stage(empty, s);
  }
  const long long start = layout.start(head);
  store_rows(dk_out + start, layout.token, dk, scale, kr0, tk, lane);
  store_rows(dv_out + start, layout.token, dv, 1.f, kr0, tk, lane);
}
// ANCHOR_END: masked_dkdv
