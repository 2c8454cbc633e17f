//! # Step 06: Hopper's own instructions
//!
//! Chapter 3's kernel is built from the instructions every GPU since the A100 has
//! (`mma.sync`, `cp.async`). This step writes the forward and the backward with those of
//! Hopper (compute capability 9.0: H100, H200), as FlashAttention-3 and cuDNN do: whole
//! tiles copied by the tensor memory accelerator (TMA) through tensor maps made on the
//! host, `mbarrier`s through which a producer hands each stage to the consumers, and
//! asynchronous warpgroup products (`wgmma`) that read their operands from shared memory
//! through matrix descriptors.
//!
//! The forward is a ladder, each rung a whole kernel that adds one idea to the one before
//! ([`kernel::ForwardRung`]):
//!
//! | rung | kernel | what it adds |
//! | --- | --- | --- |
//! | 1 | `kernels/forward_1_wgmma.cu` | TMA copies by a producer warp, `wgmma` by consumer warpgroups |
//! | 2 | `kernels/forward_2_producer_warpgroup.cu` | a producer warpgroup that hands its registers over (`setmaxnreg`) |
//! | 3 | `kernels/forward_3_turns.cu` | the consumer warpgroups take turns at the tensor cores |
//! | 4 | `kernels/forward_4_overlap.cu` | each warpgroup's softmax beside its own products |
//!
//! The backward has two ([`kernel::BackwardRung`]): step 04's two passes
//! (`backward_1_dkdv.cu`, `backward_1_dq.cu`), the same bits every run, and one pass that
//! adds dQ with a warp of its own (`backward_2_one_pass.cu`). `cuda_hopper` runs rung 1 or
//! 4 by the shape, and the one pass; each rung is a method of its own. The chapter has each
//! rung measured against cuDNN.
//!
//! ## Layout
//!
//! - [`kernel`]: the kernels' typed descriptions (which source, the `-D` set, the name, the
//!   limits) and the shapes the methods pick
//! - [`forward`]: the forward's host side: checks, tensor maps, the launch; `forward_into`,
//!   which reads q, k and v and writes the output where a [`layout::Layout`] says
//! - [`backward`]: δ, then the backward's kernels; `backward_into`, likewise with layouts
//! - [`layout`]: the strides between batches, heads and tokens the kernels read and write
//!   at (the trainer's fused projection), checked against a shape and TMA's alignment
//! - [`methods`]: `cuda_hopper` and the rungs in the registry
//! - [`exercise`]: the checker of chapter 6's exercise, which element of a `wgmma`
//!   accumulator each register holds (`bin/hopper-exercise`, on the CPU)
//! - `kernels/`: `hopper.cuh` (types, descriptors, mbarriers, TMA, `wgmma`), `forward.cuh`
//!   and `backward.cuh` (what each direction's kernels share), and the rungs
//! - `bin/hopper-kernel-check`: every kernel the methods launch through NVRTC and ptxas for
//!   `sm_90a`, no GPU needed (CI runs it)

pub mod backward;
pub mod exercise;
pub mod forward;
pub mod kernel;
pub mod layout;
pub mod methods;

pub use methods::methods;
