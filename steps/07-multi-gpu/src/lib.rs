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
//! - [`merge`](mod@merge): the merge of two partial results over disjoint keys, `lse =
//!   logaddexp(lse_a, lse_b)`, `o = e^(lse_a − lse)·o_a + e^(lse_b − lse)·o_b`, and the
//!   partial result of rows that have seen no key, `(0, −∞)`.
//! - [`schedule`]: the zig-zag split of the sequence over the ranks, and which blocks of
//!   queries and keys meet at each step of the ring.
//! - [`comm`]: opening NCCL, one communicator per GPU, with errors that say what is missing.

pub mod comm;
pub mod merge;
pub mod schedule;
