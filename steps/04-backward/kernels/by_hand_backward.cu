// The two elementwise steps of the backward by hand on the GPU, between the cuBLAS products
// of src/cuda_by_hand.rs: one warp per row of a [B*H*T, T] table, as chapter 3's
// causal_softmax. Row r of the table is query r % T of its head, which may see keys 0..=r %
// T; every entry past that is written as an exact zero. Values are 16-bit (IS_BF16: bf16,
// else f16), arithmetic f32.
//
// src/cuda_by_hand.rs prepends chapter 3's tensor_cores.cuh, for its 16-bit conversions
// (to_f32, from_f32); its HEAD_DIM is given but nothing here depends on it.

// ANCHOR: probabilities_from_lse
// P = exp(S - lse), the forward's probabilities rebuilt from the scaled scores cuBLAS wrote
// and the log-sum-exp the forward kept, in place: no maximum, no sum, one pass.
extern "C" __global__ void probabilities_from_lse(
    u16* __restrict__ table,        // [rows, T] scaled scores in, probabilities out
    const float* __restrict__ lse,  // [rows] the forward's natural log-sum-exp of each row
    int T,                          // tokens
    long long rows                  // batch * heads * T
) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int last = (int)(row % T);  // the last key this query may see
    u16* p = table + row * T;
    const float l = lse[row];
    for (int j = lane; j < T; j += 32)
        p[j] = j <= last ? from_f32(__expf(to_f32(p[j]) - l)) : (u16)0;
}
// ANCHOR_END: probabilities_from_lse

// ANCHOR: softmax_backward
// dS = P o (dP - rowsum(P o dP)), softmax's gradient as PyTorch's autograd computes it, in
// place over dP. The row sum is delta_i = sum_d dO_id O_id by another road (dP = dO V^T and
// O = P V give rowsum(P o dP) = dO . O); this one uses the P and dP at hand.
extern "C" __global__ void softmax_backward(
    const u16* __restrict__ probs,  // [rows, T] P, zero past the diagonal
    u16* __restrict__ grad,         // [rows, T] dP in, dS out
    int T,                          // tokens
    long long rows                  // batch * heads * T
) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    // a whole warp leaves together (one row a warp), so the shuffles below have all 32
    // lanes
    if (row >= rows) return;
    const int last = (int)(row % T);
    const u16* p = probs + row * T;
    u16* g = grad + row * T;
    float dot = 0.f;
    for (int j = lane; j <= last; j += 32) dot += to_f32(p[j]) * to_f32(g[j]);
    for (int offset = 16; offset > 0; offset /= 2)
        dot += __shfl_xor_sync(0xffffffff, dot, offset);
    for (int j = lane; j < T; j += 32)
        g[j] = j <= last ? from_f32(to_f32(p[j]) * (to_f32(g[j]) - dot)) : (u16)0;
}
// ANCHOR_END: softmax_backward
