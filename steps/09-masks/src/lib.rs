//! # Step 09: attention you program
//!
//! Every earlier step computes one pattern, causal attention over sequences of one length.
//! This one takes the pattern as code, the way PyTorch's FlexAttention does: a [`Mask`]
//! (`mask_mod(b, h, q, k)`: does query `q` see key `k`?) and a [`ScoreMod`]
//! (`score_mod(s, b, h, q, k)`: the score before the softmax), with built-ins for causal,
//! full, sliding-window, prefix-LM and packed-document masks, soft-capping and ALiBi, and
//! the user's own. A [`BlockMask`] classifies every tile once as empty, full or partial, so
//! the work skips the empty tiles and asks the mask only in the partial ones.
//!
//! The queries may be fewer than the keys (chunked prefill: they are the last tokens, row
//! `i` at position `i + tk − tq`) and share kv heads (grouped-query attention). A row that
//! sees no key has an output of 0 and a log-sum-exp of −∞, and passes no gradient back.
//!
//! ## Layout
//!
//! - [`mask`](mod@mask): [`Mask`], [`ScoreMod`], [`Documents`], their CUDA text and
//!   [`MaskSpec`], the `--mask` flag parsed in one place.
//! - [`shape`](mod@shape): [`QkvShape`] and [`check_masked`], the checks before any work.
//! - [`reference`](mod@reference): attention by hand with a mask and a score function,
//!   forward and backward, in `f64` (the reference) and `f32` (the rule's baseline).
//! - [`block`](mod@block): [`BlockMask`], the tiles and the lists the kernels read.
//! - [`cpu`](mod@cpu): the online softmax and the blockwise backward over the block mask's
//!   tiles, [`forward`], [`backward`] and their `_with` forms that take a block mask and
//!   count the [`Work`](cpu::Work).
//! - [`cuda`]: the GPU's side: the mask's CUDA compiled by NVRTC into step 06's Hopper
//!   forwards (rungs 1 and 4: `kernels/masked_1_wgmma.cu`, `masked_4_overlap.cu`) and its
//!   one-pass backward (`masked_backward.cu`), with `masked.cuh`; the block mask computed
//!   on the GPU (`kernels/block_mask.cu`) as a [`DeviceMask`](cuda::DeviceMask);
//!   [`cuda::forward`] and [`cuda::backward`].
//! - [`cuda_ampere`]: the same on any GPU from Ampere, through copies of steps 03's and
//!   04's kernels (`kernels/masked_ampere_forward.cu`, `masked_ampere_backward.cu`) that walk
//!   the same block mask; [`Kernels`](cuda_ampere::Kernels) picks them by compute
//!   capability (Hopper's on 9.0), or as asked.
//! - [`rule`]: FlashAttention's rule on the GPU, attention by hand in 16 bits with the same
//!   mask and score function as its baseline.
//! - [`exercise`]: chapter 9's CPU exercise, a dilated sliding window written by the reader
//!   in `exercises/dilated.rs` and checked by `masks-exercise dilated`; the solution is
//!   [`dilated`](mod@dilated).

pub mod block;
pub mod cpu;
pub mod cuda;
pub mod cuda_ampere;
pub mod dilated;
pub mod exercise;
pub mod mask;
pub mod reference;
pub mod rule;
pub mod shape;

pub use block::{BlockMask, BlockSizes, Tile};
pub use cpu::{Work, backward, backward_with, forward, forward_with};
pub use mask::{
    CustomMask, CustomScore, Documents, Mask, MaskError, MaskSpec, ScoreMod, Varies,
    kernel_source,
};
pub use shape::{QkvShape, check_masked};
