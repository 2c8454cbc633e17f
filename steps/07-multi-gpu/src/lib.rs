//! # Step 07: attention across GPUs
//!
//! Two partial results of the online softmax over disjoint blocks of keys merge exactly
//! through their log-sum-exps (chapter 2's algebra), so the keys and values of one sequence
//! can live on different devices: each rank keeps its queries, and the keys and values travel
//! round a ring of ranks (ring attention, or context parallelism), each step's products
//! overlapped with the copy of the next step's block. The backward passes the gradients of
//! the keys and values round the ring with them.
//!
//! ## Layout
//!
//! - [`schedule`]: the zig-zag split of the sequence over the ranks, and which blocks of
//!   queries and keys meet at each step of the ring.
//! - [`comm`]: opening NCCL, one communicator per GPU, with errors that say what is missing.
//! - [`gpu`]: the ring on GPUs ([`gpu::RingAttention`]): step 03's and step 04's kernels for
//!   each block, `kernels/ring.cu` to merge them, NCCL (or copies between simulated ranks on
//!   one GPU) to pass the keys and values on, overlapped with the blocks.
//! - [`methods`]: `cuda_ring` in the registry.

pub mod comm;
pub mod gpu;
pub mod methods;
pub mod schedule;
