// The backward, rung 1: step 04's two passes with Hopper's products. This is the first, dK
// and dV a block of keys at a time; backward_1_dq.cu is the second. After hopper.cuh and
// backward.cuh (and, in this module, hopper_delta runs first: δ = rowsum(dO ∘ O)).
//
// One block per BLOCK_ROWS keys of a head, each consumer warpgroup owning 64 of them; the
// queries that see them stream past STREAM at a time: Sᵀ = k·qᵀ and dPᵀ = v·dOᵀ (wgmma from
// shared memory), Pᵀ = 2^(Sᵀ·scale·log2e − lse₂) and dSᵀ = Pᵀ ∘ (dPᵀ − δ) in registers,
// then dV += Pᵀ·dO and dK += dSᵀ·q with Pᵀ and dSᵀ straight from registers. Each block
// writes only its own rows: the same bits every run.

// dV += Pᵀ·dO is issued as soon as Pᵀ is made, and runs while dSᵀ is made, where Pᵀ's
// fragments can stay in registers meanwhile: with two warpgroups and the producer's
// registers given to them; with three, ptxas would spill
#define EARLY_DV (WGS == 2)

// ANCHOR: dkdv
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
    // a block whose queries all come before this warpgroup's keys adds nothing here
    if (q0 + STREAM - 1 >= kw0) {
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
      wgmma_fence();
      if constexpr (!EARLY_DV) issue_pb<STREAM>(dv, pf, ado, STREAM);  // dV += Pᵀ·dO
      issue_pb<STREAM>(dk, dsf, aq, STREAM);  // dK += dSᵀ·q  (· scale at the end)
      wgmma_commit();
      wgmma_wait0();
      fence_operands(dv);
      fence_operands(dk);
    }
    // this thread is done with the buffer
    release_stage(empty, s);
  }
  const long long start = layout.start(head);
  store_rows(dk_out + start, layout.token, dk, scale, kr0, tokens, lane);
  store_rows(dv_out + start, layout.token, dv, 1.f, kr0, tokens, lane);
}
// ANCHOR_END: dkdv
