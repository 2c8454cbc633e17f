//! # Step 07: attention across GPUs
//!
//! Two partial results of the online softmax over disjoint blocks of keys merge exactly
//! through their log-sum-exps (chapter 2's algebra), so the keys and values of one sequence
//! can live on different devices: each rank keeps its queries, and the keys and values
//! travel round a ring of ranks (ring attention, or context parallelism), each step's
//! products overlapped with the copy of the next step's block. The backward passes the
//! gradients of the keys and values round the ring with them.
//!
//! On the CPU the ranks are threads and the links between them channels: [`ring_forward`]
//! and [`ring_backward`] return what steps 01 to 04 return, for any length and any number
//! of ranks, and are checked against the `f64` reference like every method.
//!
//! ## Layout
//!
//! - [`merge`](mod@merge): the merge of two partial results over disjoint keys, `lse =
//!   logaddexp(lse_a, lse_b)`, `o = e^(lse_a − lse)·o_a + e^(lse_b − lse)·o_b`, and the
//!   partial result of rows that have seen no key, `(0, −∞)`.
//! - [`cpu`]: ring attention on the CPU, one thread per rank, the keys and values (and in
//!   the backward their gradients) passed round the ring over channels; each block by hand,
//!   as step 01 and step 04 compute it, the causal mask on the diagonal only.
//! - [`schedule`]: the zig-zag split of the sequence over the ranks, and which blocks of
//!   queries and keys meet at each step of the ring.
//! - [`comm`]: opening NCCL, one communicator per GPU, with errors that say what is
//!   missing.
//! - [`gpu`]: the ring on GPUs ([`gpu::RingAttention`]): step 03's and step 04's kernels
//!   for each block, `kernels/ring.cu` to merge them, NCCL (or copies between simulated
//!   ranks on one GPU) to pass the keys and values on, overlapped with the blocks.
//! - [`methods`]: `cuda_ring` in the registry.
//! - [`exercise`]: the checker of chapter 7's exercise, the merge of two partial results.

pub mod comm;
pub mod cpu;
pub mod exercise;
pub mod gpu;
pub mod merge;
pub mod methods;
pub mod schedule;

pub use cpu::{MAX_RANKS, ring_backward, ring_forward};
