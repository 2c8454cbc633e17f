//! # Step 04: the backward pass
//!
//! The gradients of causal attention with respect to q, k and v, given the gradient of the
//! output `dO`, three ways:
//!
//! - [`reference::backward_f64`]: in `f64`, by hand through the whole table of
//!   probabilities, exactly as the chain rule reads. Every other backward is checked
//!   against it; it is itself checked against finite differences.
//! - [`backward_by_hand`]: the same formulas in `f32` on step 01's tables: the
//!   probabilities `P` and their gradient `dP`, `[batch, heads, T, T]` each.
//! - [`backward`]: blockwise, the way of FlashAttention-2 (Dao 2023, Algorithm 2): no
//!   table. The probabilities are rebuilt a block at a time from the scores and the
//!   log-sum-exp the forward kept, `P = exp(S − lse)`. One pass: a task takes a run of a
//!   head's key blocks, owns their dK and dV and a whole dQ to add into, so every sum runs
//!   in one fixed order and the result is the same on every run and on any number of
//!   threads. Parallel with rayon.
//! - [`backward_two_pass`]: the split of the GPU kernels: dK and dV per block of keys, then
//!   dQ per block of queries, the scores computed twice.
//!
//! With the output `O = P·V`, `P = softmax(S)` row by row and `S = Q·Kᵀ·scale` (masked):
//!
//! ```text
//! dV = Pᵀ·dO      dP = dO·Vᵀ      dS = P ∘ (dP − δ),  δ_i = Σ_d dO_id·O_id
//! dQ = dS·K·scale                 dK = dSᵀ·Q·scale
//! ```
//!
//! ## A forward and a backward for training
//!
//! [`forward`] returns what the backward needs: the output and each row's natural-log
//! log-sum-exp. Every backward here takes that [`Attention`] back together with q, k, v and
//! `dO`, and returns [`Grads`]. Any forward that returns a correct output and the
//! natural-log log-sum-exp of each row of scaled, masked scores will do: the one
//! re-exported here is step 01's attention by hand; the online-softmax forward of step 02
//! returns the same two arrays without the table.
//!
//! ## Layout
//!
//! - [`check_backward`]: the checks every backward runs before any work (CPU or GPU); the
//!   result, [`Grads`], is the shared core's, so the registry's methods can return it;
//!   [`BackwardFn`] is the one shape of this step's backward functions.
//! - [`methods`](mod@methods): what this step adds to the benchmark's registry:
//!   [`WithBackward`], four earlier methods each with its [`Backward`].
//! - [`reference`](mod@reference): the `f64` backward, through the full table of
//!   probabilities.
//! - [`by_hand`]: [`backward_by_hand`], `f32` through step 01's tables.
//! - [`blockwise`]: [`backward`], [`backward_with_blocks`] and [`backward_two_pass`], with
//!   the preprocessing [`delta`](blockwise::delta).
//!
//! - [`cuda`]: the backward on the GPU, `kernels/flash_backward.cu` (δ, then dK and dV per
//!   block of keys, then dQ per block of queries), through step 03's
//!   [`Gpu`](step03_cuda_forward::gpu::Gpu); [`BackwardKernel`](cuda::BackwardKernel),
//!   which alone turns a dtype and a head dim into the kernels' `-D` options (the `.cu`
//!   file holds no defaults; its thread blocks are macros of the head dim, which
//!   [`warps`](cuda::warps) and [`m_tiles`](cuda::m_tiles) mirror for the launch, and its
//!   streams and steps, the same at every head dim, are constants).
//!   `src/bin/backward-kernel-check.rs` compiles every kernel the library launches (and the
//!   exercise's template) with NVRTC and ptxas and fails on any spill (no GPU needed); the
//!   search that chose the shapes is the lab's (`lab/notes/04-backward.md`: what did not
//!   pay).
//! - [`cuda_by_hand`]: the backward by hand on the GPU, cuBLAS through two `[b·h, T, T]`
//!   tables and `kernels/by_hand_backward.cu`, with the same signature as
//!   [`cuda::backward`].
//! - [`rule`](mod@rule): FlashAttention's rule for out, dq, dk and dv
//!   ([`BackwardCheck`](rule::BackwardCheck)), which the GPU tests and the exercise checker
//!   both apply.
//! - [`exercise`]: chapter 4's exercises: `grad_scores` (δ and dS for one block) written by
//!   the reader in `exercises/grad_scores.rs`, checked on the CPU; `softmax_backward` in
//!   `exercises/softmax_backward.cu`, checked on the GPU. `src/bin/backward-exercise.rs`
//!   runs either (`cargo run -p step04-backward --bin backward-exercise -- grad-scores`).

pub mod blockwise;
pub mod by_hand;
pub mod cuda;
pub mod cuda_by_hand;
pub mod exercise;
pub mod methods;
pub mod reference;
pub mod rule;

pub use methods::{Backward, WithBackward};

pub use blockwise::{BlockSizes, backward, backward_two_pass, backward_with_blocks};
pub use by_hand::backward_by_hand;
pub use flash_core::method::Grads;
pub use flash_core::{Attention, AttnError, Shape};
/// The forward of this pair: step 01's attention by hand, which returns the output and the
/// natural-log log-sum-exp of each row that every backward here needs.
pub use step01_naive::attention as forward;

use flash_core::{check_qkv, check_same};
use ndarray::ArrayView4;

/// The shape of every backward function of this step: q, k, v, what the forward returned
/// for them (its log-sum-exp is what lets the backward rebuild the probabilities without a
/// stored table), and the gradient of the output `dO`, all `f32`, in; dq, dk and dv out.
pub type BackwardFn = fn(
    ArrayView4<f32>,
    ArrayView4<f32>,
    ArrayView4<f32>,
    &Attention,
    ArrayView4<f32>,
) -> Result<Grads, AttnError>;

// ANCHOR: check_backward
/// Checks the inputs of a backward pass before any work and returns their common shape.
///
/// Accepted: q, k and v as the forward accepts them (`[batch, heads, tokens, head_dim]`,
/// one shape, `head_dim ≥ 1`); `dout` and `fwd.out` of that same shape; `fwd.lse` of shape
/// `[batch, heads, tokens]`.
pub fn check_backward<A: Copy + Into<f64>>(
    q: &ArrayView4<A>,
    k: &ArrayView4<A>,
    v: &ArrayView4<A>,
    fwd: &Attention,
    dout: &ArrayView4<A>,
) -> Result<Shape, AttnError> {
    let shape = check_qkv(q, k, v)?;
    check_same("dout", dout, shape)?;
    check_same("the forward's out", &fwd.out.view(), shape)?;
    let lse: [usize; 3] = fwd.lse.dim().into();
    let want = [shape.batch, shape.heads, shape.tokens];
    if lse != want {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the forward's lse is {lse:?} but must be [batch, heads, tokens] = \
                 {want:?} to go with q, k and v of {:?}",
                shape.dims()
            ),
        });
    }
    Ok(shape)
}
// ANCHOR_END: check_backward
