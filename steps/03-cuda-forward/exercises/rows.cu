// Chapter 3's exercise: rung 1 of the ladder (kernels/ladder_1_rows.cu) with the online
// softmax's update taken out of its key loop. Write it back where the TODO says, then run
//
//     cargo run -p step03-cuda-forward --bin exercise -- rows
//
// which compiles this file as rung 1 is compiled (NVRTC, the same -D options,
// tensor_cores.cuh in front) and launches it as rung 1 is launched, on seeded inputs of 1,
// 77, 128, 190 and 300 tokens, and says "right" when its error against the f64 reference is
// at most twice that of attention by hand in the same precision, in bf16 and f16. `git
// checkout` brings the template back; the solution is rung 1 itself,
// kernels/ladder_1_rows.cu.
//
// One thread per query row, keys and values read from global memory one at a time. The
// compile-time parameters, given as -D options by src/ladder.rs:
//   HEAD_DIM  32 or 64
//   IS_BF16   1 for bf16 inputs and output, 0 for f16
//   BLOCK_M   threads (= query rows) per thread block
// From tensor_cores.cuh: u16 (a 16-bit value's bits), to_f32 and from_f32 (16 bits to f32
// and back), fast_exp2(x) = 2^x, NEG_INF.

#define LN2 0.6931471805599453f

extern "C" __global__ void __launch_bounds__(BLOCK_M) ladder_rows(
    const u16* __restrict__ q,  // [B*H, T, HEAD_DIM] queries, bf16 or f16 bits
    const u16* __restrict__ k,  // [B*H, T, HEAD_DIM] keys
    const u16* __restrict__ v,  // [B*H, T, HEAD_DIM] values
    u16* __restrict__ out,      // [B*H, T, HEAD_DIM] output
    float* __restrict__ lse,    // [B*H, T] natural log-sum-exp of each row's scaled scores
    int T,            // tokens per sequence; the grid has ceil(T / BLOCK_M) blocks a head
    float scale_log2  // log2(e)/sqrt(HEAD_DIM): scores in base-2 units, for fast_exp2
) {
    // blocks go head after head; within a head, BLOCK_M consecutive rows per block
    const int q_blocks = (T + BLOCK_M - 1) / BLOCK_M;
    const int bh = blockIdx.x / q_blocks;
    const int row = (blockIdx.x % q_blocks) * BLOCK_M + threadIdx.x;
    if (row >= T) return;  // the last block of a head may be partial
    const long long head = (long long)bh * T * HEAD_DIM;
    q += head + (long long)row * HEAD_DIM;
    k += head;
    v += head;
    out += head + (long long)row * HEAD_DIM;

    // the row's query and its unnormalised output, in registers for the whole walk
    float qr[HEAD_DIM], o[HEAD_DIM];
#pragma unroll
    for (int c = 0; c < HEAD_DIM; ++c) {
        qr[c] = to_f32(q[c]);
        o[c] = 0.f;
    }
    // m: the largest score seen so far; l: the sum of 2^((s - m)·scale_log2) over those
    // keys
    float m = NEG_INF, l = 0.f;

    // causal: row `row` sees keys 0..row, and no others are read
    for (int j = 0; j <= row; ++j) {
        const u16* kj = k + (long long)j * HEAD_DIM;
        const u16* vj = v + (long long)j * HEAD_DIM;
        float s = 0.f;  // the unscaled score q·k_j
#pragma unroll
        for (int c = 0; c < HEAD_DIM; ++c) s = fmaf(qr[c], to_f32(kj[c]), s);

        // TODO: chapter 2's update with a block of one key. Fold key j (score s, value row
        // vj) into m, l and o, so that after the last key
        //   m = the largest s of the row,
        //   l = the sum over keys of 2^((s - m)·scale_log2),
        //   o = the sum over keys of 2^((s - m)·scale_log2) · v_j (HEAD_DIM values).
        // A new maximum must shrink what l and o hold so far. Scores are unscaled: multiply
        // a difference of scores by scale_log2 before fast_exp2. On the first key m is
        // -inf.
        (void)vj;
    }

    // o / l, and ln(sum e^(s/sqrt(d))) = (m·scale_log2 + log2 l)·ln 2
    const float inv = 1.f / l;
#pragma unroll
    for (int c = 0; c < HEAD_DIM; ++c) out[c] = from_f32(o[c] * inv);
    lse[(long long)bh * T + row] = (m * scale_log2 + __log2f(l)) * LN2;
}
