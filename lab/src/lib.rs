//! # The lab
//!
//! The lesson is the kernels under `steps/NN-*/kernels/`: what runs, and the rungs that teach
//! the way to it. The lab is the search that chose their shapes: the tools that time every
//! shape a kernel takes against the reference and one another, the notes that say what was
//! tried and what it measured (`notes/`), and the raw logs of those runs (`logs/`). No stage
//! holds it and no chapter teaches from it; CI builds it and runs its kernel checks, so it
//! cannot rot.

pub mod hopper_shapes;
pub mod probe;
