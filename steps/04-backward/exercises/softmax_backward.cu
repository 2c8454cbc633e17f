// Chapter 4's exercise: the backward by hand's two row kernels
// (kernels/by_hand_backward.cu) with the body of softmax_backward taken out. Write it where
// the TODO says, then run
//
//     cargo run -p step04-backward --bin backward-exercise -- softmax-backward
//
// which runs the backward by hand on the GPU (cuBLAS products, src/cuda_by_hand.rs) with
// this file's kernels in place of the step's, on seeded inputs of 1, 77, 128, 190 and 300
// tokens in bf16 and f16, and says "right" when the output, dq, dk and dv are each within
// twice the error of the backward by hand in the same precision against the f64 reference.
// `git checkout` brings the template back; the solution is softmax_backward in
// kernels/by_hand_backward.cu.
//
// One warp per row of a [B*H*T, T] table. Row r of the table is query r % T of its head,
// which may see keys 0..=r % T; every entry past that must be written as an exact zero.
// Values are 16-bit (IS_BF16: bf16, else f16), arithmetic f32. From tensor_cores.cuh (put
// in front): u16 (a 16-bit value's bits), to_f32 and from_f32 (16 bits to f32 and back).

// P = exp(S - lse), the forward's probabilities rebuilt from the scaled scores cuBLAS wrote
// and the log-sum-exp the forward kept, in place: no maximum, no sum, one pass. (Given.)
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

// dS = P o (dP - delta), softmax's gradient, in place over dP, with delta = rowsum(P o dP).
extern "C" __global__ void softmax_backward(
    const u16* __restrict__ probs,  // [rows, T] P, zero past the diagonal
    u16* __restrict__ grad,         // [rows, T] dP in, dS out
    int T,                          // tokens
    long long rows                  // batch * heads * T
) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    // a whole warp leaves together (one row a warp), so a shuffle below would have all 32
    // lanes
    if (row >= rows) return;
    const int last = (int)(row % T);  // the last key this query may see
    const u16* p = probs + row * T;
    u16* g = grad + row * T;

    // TODO: the 32 lanes of this warp share the row. Compute
    //   delta = the sum over j of p[j]·g[j] (keys j up to `last`),
    // which each lane can only start on its own share of j, then overwrite g[j] with
    //   p[j]·(g[j] - delta) for j up to `last`, and an exact zero for j past it.
    // Each lane needs the whole of delta, the sum of every lane's share, before it writes.
    (void)p;
    (void)g;
    (void)last;
    (void)lane;
}
