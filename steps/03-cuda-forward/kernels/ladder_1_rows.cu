// Rung 1 of the ladder: the CPU loop of chapter 2 moved to the GPU, as it is.
//
// One thread per query row. Each thread holds its row of q and its running output in
// registers, in f32, and walks over every key its row may see, one key at a time: the
// online softmax with blocks of a single key. Keys and values are read straight from global
// memory, so every warp reads every key and value of its head again (the 32 threads of a
// warp read the same key at the same moment, which the hardware serves as one broadcast
// read). No shared memory, no tensor cores: this is the baseline every later rung is
// measured against.
//
// Compile-time parameters, every one given to NVRTC as a -D option by src/ladder.rs:
//   HEAD_DIM  32 or 64 (a row of q and one of o, in f32, take 2·HEAD_DIM registers a
//             thread: at 128 that is more than the 255 a thread can have)
//   IS_BF16   1 for bf16 inputs and output, 0 for f16
//   BLOCK_M   threads (= query rows) per thread block
//
// src/kernel.rs prepends tensor_cores.cuh (the 16-bit conversions and ex2) before NVRTC
// compiles it.

#define LN2 0.6931471805599453f

// ANCHOR: rows_kernel
extern "C" __global__ void __launch_bounds__(BLOCK_M) ladder_rows(
    const u16* __restrict__ q,  // [B*H, T, HEAD_DIM] queries, bf16 or f16 bits
    const u16* __restrict__ k,  // [B*H, T, HEAD_DIM] keys
    const u16* __restrict__ v,  // [B*H, T, HEAD_DIM] values
    u16* __restrict__ out,      // [B*H, T, HEAD_DIM] output
    float* __restrict__ lse,    // [B*H, T] natural log-sum-exp of each row's scaled scores
    int T,            // tokens per sequence; the grid has ceil(T / BLOCK_M) blocks a head
    float scale_log2  // log2(e)/sqrt(HEAD_DIM): scores in base-2 units, for ex2
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
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < HEAD_DIM; ++c) s = fmaf(qr[c], to_f32(kj[c]), s);
        // ANCHOR: rows_update
        // chapter 2's update with a block of one key: a new maximum shrinks what was summed
        // so far by 2^((m_old - m_new)·scale_log2) (on the first key m_old = -inf gives 0)
        const float m_new = fmaxf(m, s);
        const float correction = fast_exp2((m - m_new) * scale_log2);
        const float p = fast_exp2((s - m_new) * scale_log2);
        l = l * correction + p;
#pragma unroll
        for (int c = 0; c < HEAD_DIM; ++c) o[c] = fmaf(o[c], correction, p * to_f32(vj[c]));
        m = m_new;
        // ANCHOR_END: rows_update
    }

    // o / l, and ln(sum e^(s/sqrt(d))) = (m·scale_log2 + log2 l)·ln 2
    const float inv = 1.f / l;
#pragma unroll
    for (int c = 0; c < HEAD_DIM; ++c) out[c] = from_f32(o[c] * inv);
    lse[(long long)bh * T + row] = (m * scale_log2 + __log2f(l)) * LN2;
}
// ANCHOR_END: rows_kernel
