//! # The lab
//!
//! The lesson is the kernels under `steps/NN-*/kernels/`: what runs, and the rungs that teach
//! the way to it. The lab is the search that chose their shapes: the tools that time every
//! shape a kernel takes against the reference and one another, the notes that say what was
//! tried and what it measured (`notes/`), and the raw logs of those runs (`logs/`). No stage
//! holds it and no chapter teaches from it; CI builds it and runs its kernel checks, so it
//! cannot rot.
//!
//! ## Layout
//!
//! - [`forward_shapes`]: the tile shapes compared with the default of step 03's forward
//!   kernel, default first.
//! - `src/bin/forward-tune.rs`: on a GPU, times every shape of a head dim after checking that
//!   they all compute the same.
//! - `src/bin/lab-kernel-check.rs`: every shape through NVRTC and ptxas, no GPU needed (CI).
//! - `tests/gpu.rs`: every shape against the `f64` reference, ignored without a GPU.
//! - `notes/`: what did not pay, a table a step, with the numbers from `logs/`.

pub mod forward_shapes;
