// The masked forward on step 06's rung 1 (forward_1_wgmma.cu): a producer warp, one or two
// consumer warpgroups, no overlap; what runs at head dim 64 up to 4,096 queries, as it does
// for cuda_hopper. After hopper.cuh, forward.cuh, the mask's source and masked.cuh. The
// changes are masked_4_overlap.cu's: the producer loads the blocks the list names, the
// score function applies to every block and the mask to the partial ones, and k and v have
// their own length.

static_assert(THREADS == 128 * WGS + 32, "WGS consumer warpgroups and a producer warp");

// ANCHOR: masked_1
// MIN_BLOCKS blocks a multiprocessor, as rung 1's launch bounds ask, but stated as the
// registers a thread may use: the bound ptxas derives from the launch bounds is 128, eight
// short of what MIN_BLOCKS blocks leave a thread, and the mask needs them
#define MAX_REGS (65536 / (THREADS * MIN_BLOCKS) / 8 * 8)
extern "C" __global__ void __maxnreg__(MAX_REGS) masked_forward(
    const __grid_constant__ TensorMap map_q,  // q, read in boxes of BLOCK_M rows
    const __grid_constant__ TensorMap map_k,  // k, in boxes of BLOCK_N rows
    const __grid_constant__ TensorMap map_v,  // v, in boxes of BLOCK_N rows
    u16* __restrict__ out,                    // the output, where out_layout says
    const Layout out_layout,                  // the output's strides (q's heads)
    float* __restrict__ lse,                  // [batch · heads, tq] log-sum-exps
    int tq,                                   // q's length
    int tk,                                   // k's and v's length, tq or more
    int q_per_kv,                             // query heads per head of k and v
    const BlockList list,                     // the blocks of keys each query block sees
    const int* __restrict__ mask_data,        // the mask's data (document ids), or null
    float scale,                              // 1/√d: the scores the score function sees
    float scale_log2) {                       // 1/√d · log2(e): scores to base 2
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~1023ull);
  unsigned char* sq = smem;
  unsigned char* sk = sq + BLOCK_M * ROW_BYTES;
  unsigned char* sv = sk + STAGES * BLOCK_N * ROW_BYTES;
  __shared__ __align__(8) u64 full[STAGES], empty[STAGES], qbar;
  // the list's entry of the block in each buffer, written by the producer before the
  // buffer's barrier is armed (its arrival releases the write to the consumers' wait)
  __shared__ int stage_entry[STAGES];

  const BlockPlace place = block_place(tq);
  const int mb = place.mb, head = place.head;
  const int heads = out_layout.heads, b = head / heads, h = head % heads;
  const int kv_head = head / q_per_kv, kv_heads = heads / q_per_kv;
  const int row = list.row(b, h);
  const int n_blocks = list.n(row, mb);
  const int tid = threadIdx.x;
  const int wg = tid / 128;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_u32(&full[s]), 1);
      mbar_init(smem_u32(&empty[s]), WGS);
    }
    mbar_init(smem_u32(&qbar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == WGS) {
    if (tid == 128 * WGS && n_blocks > 0) {
      mbar_expect_tx(smem_u32(&qbar), BLOCK_M * ROW_BYTES);
      tma_load(smem_u32(sq), &map_q, smem_u32(&qbar), BLOCK_M, mb * BLOCK_M, head, heads);
      for (int i = 0; i < n_blocks; ++i) {
        const int s = i % STAGES, entry = list.at(row, mb, i);
        const int key0 = (entry >> 1) * BLOCK_N;
        if (i >= STAGES) mbar_wait(smem_u32(&empty[s]), ((i / STAGES) - 1) & 1);
        stage_entry[s] = entry;
        mbar_expect_tx(smem_u32(&full[s]), 2 * BLOCK_N * ROW_BYTES);
        tma_load(smem_u32(sk + s * BLOCK_N * ROW_BYTES), &map_k, smem_u32(&full[s]),
                 BLOCK_N, key0, kv_head, kv_heads);
        tma_load(smem_u32(sv + s * BLOCK_N * ROW_BYTES), &map_v, smem_u32(&full[s]),
                 BLOCK_N, key0, kv_head, kv_heads);
      }
    }
    return;
  }

  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int first_row = mb * BLOCK_M + wg * 64;
  const int r0 = first_row + warp * 16 + lane / 4;
  float o[HALVES][32];
#pragma unroll
  for (int hh = 0; hh < HALVES; ++hh) {
#pragma unroll
    for (int i = 0; i < 32; ++i) o[hh][i] = 0.f;
  }
  float m[2] = {NO_KEY_YET, NO_KEY_YET};
  float l[2] = {0.f, 0.f};
  float corr[2];
  if (n_blocks == 0) {
    store_masked_output(o, m, l, out, out_layout, lse, head, r0, tq, lane);
    return;
  }
  const MaskArgs args{mask_data, b, h, tk - tq, tk};
  const RowKeys keys = row_keys(r0, args);
  const float exp_scale = SCORE_MOD_IDENTITY ? scale_log2 : LOG2E;
  float sc[64];
  u32 p[32];
  const u32 aq = smem_u32(sq) + wg * 64 * 128, q_half = BLOCK_M * 128,
            k_half = BLOCK_N * 128;
  mbar_wait(smem_u32(&qbar), 0);

  for (int i = 0; i < n_blocks; ++i) {
    const int s = i % STAGES;
    mbar_wait(smem_u32(&full[s]), (i / STAGES) & 1);
    const int entry = stage_entry[s], key0 = (entry >> 1) * BLOCK_N;
    const bool partial = (entry & 1) == 0;
    const u64 bits = MASK_INTERVAL || !partial ? ~0ull : visible_bits(key0, r0, lane, args);
    wgmma_fence();
    issue_abt<BLOCK_N>(sc, aq, q_half, smem_u32(sk + s * BLOCK_N * ROW_BYTES),
                       k_half);  // S = q·kᵀ
    wgmma_commit();
    wgmma_wait0();
    fence_operands(sc);
    apply_mods(sc, partial, bits, keys, key0, r0, lane, scale, args);
    softmax(sc, m, l, corr, exp_scale);
    rescale(o, corr);
    pack_fragments<BLOCK_N>(p, sc);
    wgmma_fence();
    issue_pb<BLOCK_N>(o, p, smem_u32(sv + s * BLOCK_N * ROW_BYTES), BLOCK_N);  // o += P·v
    wgmma_commit();
    wgmma_wait0();
    fence_operands(o);
    if (tid % 128 == 0) mbar_arrive(smem_u32(&empty[s]));
  }

  store_masked_output(o, m, l, out, out_layout, lse, head, r0, tq, lane);
}
// ANCHOR_END: masked_1
