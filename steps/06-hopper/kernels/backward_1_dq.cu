// The backward, rung 1, second pass: dQ a block of queries at a time, after
// backward_1_dkdv.cu (and its δ). After hopper.cuh and backward.cuh.
//
// One block per BLOCK_ROWS queries of a head; the keys they see stream past STREAM at a
// time: S = q·kᵀ and dP = dO·vᵀ, P and dS = P ∘ (dP − δ) in registers, dQ += dS·k. Each
// block writes only its own rows: the same bits every run.

// ANCHOR: dq
extern "C" __global__ void __launch_bounds__(THREADS, 1) hopper_dq(
    const __grid_constant__ TensorMap map_q,   // q, read in boxes of BLOCK_ROWS rows
    const __grid_constant__ TensorMap map_k,   // k, in boxes of STREAM rows
    const __grid_constant__ TensorMap map_v,   // v, in boxes of STREAM rows
    const __grid_constant__ TensorMap map_do,  // dO, in boxes of BLOCK_ROWS rows
    const float* __restrict__ lse,             // the forward's [batch · heads, tokens]
    const float* __restrict__ delta,           // δ, [batch · heads, tokens]
    u16* __restrict__ dq_out,                  // dQ, where `layout` says
    const Layout layout,                       // the gradients' strides
    int q_per_kv,  // query heads per head of k and v // [step 08]
    int tokens,                                // the sequence's length
    float scale_log2,                          // 1/√d · log2(e)
    float scale) {                             // 1/√d, dQ's factor
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* sq = smem;
  unsigned char* sdo = sq + BLOCK_ROWS * ROW_BYTES;
  unsigned char* sk = sdo + BLOCK_ROWS * ROW_BYTES;
  unsigned char* sv = sk + STAGES * STREAM * ROW_BYTES;
  __shared__ __align__(8) u64 full[STAGES], empty[STAGES], qbar;

  // the last query blocks see the most keys: they start first
  const BlockPlace place = block_place(tokens, true);
  const int head = place.head, q0 = place.block * BLOCK_ROWS;
  // the keys up to this block's last query
  const int n_blocks =
      min((tokens + STREAM - 1) / STREAM, (q0 + BLOCK_ROWS + STREAM - 1) / STREAM);
  const int tid = threadIdx.x, wg = tid / 128;
  init_barriers(&qbar, full, empty, 4 * WGS);

  if (wg == WGS) {
    release_registers<PRODUCER_REGS>();
    if (tid < 128 * WGS + 32) {
      produce<false>(&map_q, &map_do, &map_k, &map_v, sq, sdo, sk, sv, nullptr, nullptr,
                     &qbar, full, empty, lse, delta, q0, 0, n_blocks, head, layout.heads,
                     1, q_per_kv,  // q, dO not grouped; k, v grouped // [step 08]
                     tokens, tid % 32);
    }
    return;
  }

  take_registers<CONSUMER_REGS>();
  // a consumer warpgroup: 64 queries, 16 per warp; each thread holds two, r0 and r0 + 8
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int w0 = q0 + wg * 64, r0 = w0 + warp * 16 + lane / 4;
  float lse2[2], dl[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + 8 * h;
    lse2[h] = row < tokens ? lse[(u64)head * tokens + row] * LOG2E : INFINITY;
    dl[h] = row < tokens ? delta[(u64)head * tokens + row] : 0.f;
  }
  float dq[HALVES][32];
#pragma unroll
  for (int h = 0; h < HALVES; ++h) {
#pragma unroll
    for (int i = 0; i < 32; ++i) dq[h][i] = 0.f;
  }
  float sc[STREAM / 2], dp[STREAM / 2];
  u32 dsf[STREAM / 4];
  const u32 aq = smem_u32(sq) + wg * 64 * 128, ado = smem_u32(sdo) + wg * 64 * 128,
            q_half = BLOCK_ROWS * 128;
  mbar_wait(smem_u32(&qbar), 0);

  for (int n = 0; n < n_blocks; ++n) {
    const int s = n % STAGES, key0 = n * STREAM;
    mbar_wait(smem_u32(&full[s]), (n / STAGES) & 1);
    // a block whose keys all come after this warpgroup's queries adds nothing here
    if (key0 <= w0 + 63) {
      const u32 ak = smem_u32(sk + s * STREAM * ROW_BYTES),
                av = smem_u32(sv + s * STREAM * ROW_BYTES);
      // two groups of products: P is made from S while dP is still being computed
      wgmma_fence();
      issue_abt<STREAM>(sc, aq, q_half, ak, STREAM * 128);  // S = q·kᵀ
      wgmma_commit();
      issue_abt<STREAM>(dp, ado, q_half, av, STREAM * 128);  // dP = dO·vᵀ
      wgmma_commit();
      wgmma_wait1();
      fence_operands(sc);
      // register 4j+e: query r0 + 8·(e/2), key key0 + 8j + 2·(lane%4) + e%2
      const bool masked = key0 + STREAM - 1 > w0;
#pragma unroll
      for (int j = 0; j < STREAM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + 8 * j + 2 * (lane % 4) + (e % 2);
          float p = fast_exp2(sc[4 * j + e] * scale_log2 - lse2[e / 2]);
          if (masked && key > r0 + 8 * (e / 2)) p = 0.f;
          sc[4 * j + e] = p;
        }
      }
      wgmma_wait0();
      fence_operands(dp);
#pragma unroll
      for (int j = 0; j < STREAM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dp[4 * j + e] = sc[4 * j + e] * (dp[4 * j + e] - dl[e / 2]);
      }
      pack_fragments<STREAM>(dsf, dp);
      wgmma_fence();
      issue_pb<STREAM>(dq, dsf, ak, STREAM);  // dQ += dS·k  (· scale at the end)
      wgmma_commit();
      wgmma_wait0();
      fence_operands(dq);
    }
    // this warp is done with the buffer
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_u32(&empty[s]));
  }
  store_rows(dq_out + layout.start(head), layout.token, dq, scale, r0, tokens, lane);
}
// ANCHOR_END: dq
