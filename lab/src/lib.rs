//! # The lab
//!
//! The lesson is the kernels under `steps/NN-*/kernels/`: what runs, and the rungs that
//! teach the way to it. The lab is the search that chose their shapes: the tools that time
//! every shape a kernel takes against the reference and one another, the notes that say
//! what was tried and what it measured (`notes/`), and the raw logs of those runs
//! (`logs/`). No stage holds it and no chapter teaches from it; CI builds it and runs its
//! kernel checks, so it cannot rot.
//!
//! ## Layout
//!
//! - [`forward_shapes`], [`backward_shapes`]: the tile shapes compared with the defaults of
//!   step 03's forward kernel and step 04's backward kernels, default first.
//! - [`hopper_shapes`]: the shapes of step 06's rungs that `hopper-check` compares.
//! - [`patch`]: the steps' kernel sources with other sizes set, which the shapes compile.
//! - [`probe`]: one `wgmma` tile, which pins down the shared-memory descriptors' encoding.
//! - [`tool`]: what the timing tools share (the GPU, inputs, a median of timed calls).
//! - `src/bin/forward-tune.rs`, `src/bin/backward-tune.rs`: on a GPU, time every shape of a
//!   head dim after checking that they all compute the same (`backward-tune --split` times
//!   each backward kernel on its own).
//! - `src/bin/hopper-check.rs`: step 06's shapes against the `f64` reference, then timed
//!   beside steps 03 and 04; `src/bin/wgmma-probe.rs`: the probe on the GPU.
//! - `src/bin/lab-kernel-check.rs`, `src/bin/hopper-shapes-check.rs`: every shape through
//!   NVRTC and ptxas, no GPU needed (CI).
//! - `tests/gpu.rs`: every shape against the `f64` reference (forward) or the default
//!   (backward), ignored without a GPU.
//! - `notes/`: what did not pay, a page a step, with the numbers from `logs/`.

pub mod backward_shapes;
pub mod forward_shapes;
pub mod hopper_shapes;
pub mod patch;
pub mod probe;
pub mod tool;
