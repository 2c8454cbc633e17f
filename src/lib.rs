//! # The benchmark and the `attend` command
//!
//! The root package runs every method the repository has: the benchmark (`cargo run
//! --release`) measures time and peak memory over a sweep of lengths and writes the JSON
//! the charts are drawn from; `attend` runs one method on `.npy` files so that its results
//! can be checked against any framework.
//!
//! ## Layout
//!
//! - [`methods`]: the registry of every method, behind one shape of function.
//! - [`cli`]: the command line.
//! - [`bench`]: the sweep, the timing and the peak-memory child.
//! - [`report`]: the printed table.
//! - [`attend`] and [`npy`]: the interop command and its `.npy` reader and writer.
pub mod attend;
pub mod bench;
pub mod cli;
pub mod methods;
pub mod npy;
pub mod report;
