//! # Step 02: the online softmax on the CPU
//!
//! The same causal attention as step 01, without its table of scores: keys and values are read a
//! block at a time, and each query row keeps three running values, its largest score so far
//! `m`, its sum `ℓ = Σ e^(s − m)` and its unnormalised output `Σ e^(s − m)·v`, rescaled by
//! `e^(m_old − m_new)` whenever a larger score arrives (Milakov & Gimelshein 2018; FlashAttention,
//! Dao et al. 2022). Memory beyond the output grows with the block size, not with T². Key blocks
//! entirely after a query block's last row are skipped, so causal attention does about half the
//! work of the full product.
//!
//! Two versions of one algorithm:
//!
//! 1. [`attention_loop`] / [`attention_blocked`]: single-threaded plain loops, to be read next to
//!    the derivation (the book includes it piece by piece).
//! 2. [`attention`] / [`attention_with`]: parallel over (sequence, head, query block) with rayon;
//!    register-blocked micro-kernels for `S = Q·Kᵀ` and `O += P·V` in AVX-512F, AVX2+FMA or
//!    plain Rust, chosen at run time; `log2(e)` folded into the scale of q so the softmax takes
//!    `2^x`, by a SIMD polynomial.
//!
//! Both return the output and each row's natural log-sum-exp, like every method of the
//! repository, and are checked against step 01's `f64` reference.
//!
//! ## Versions and what they measured
//!
//! `cargo run --release -p step02-online-softmax --example speed [-- variants]`, 1 sequence × 12
//! heads × head dim 64, f32, causal, median of 5–9 runs, on the 2-core AVX-512 machine of the
//! book's CPU numbers while other work shared it (about one of its two cores was ours: the example
//! prints the cores it got), so these are per-core figures more than whole-machine ones:
//!
//! | version | 1024 tokens | 4096 tokens |
//! | --- | --- | --- |
//! | `online` (AVX-512, blocks 64 × 64, polynomial `2^x`) | 19–20 ms, 81–85 GFLOP/s | 303–317 ms, 81–85 GFLOP/s |
//! | the same with AVX2 | 22.7 ms | 620 ms (0.7 cores) |
//! | the same with the scalar fallback | 99.6 ms | 1516 ms |
//! | the same with the standard library's `exp2` per value | 31.4 ms | 621 ms |
//! | `log2(e)` not folded (one multiply more per score) | 19.2 ms | 327 ms (within the noise) |
//! | the online softmax on `ndarray`'s matrix product, blocks of 64 | 50.8 ms | 763 ms |
//! | `online_loop` (plain loops, one thread) | 461 ms, 3.5 GFLOP/s | |
//!
//! Blocks of 64 × 64, 64 × 128, 128 × 64, 128 × 128 and 256 × 64 were within 10% of each other;
//! 32 × 64 and 64 × 32 were 15–20% slower at 4096 tokens. The book's numbers come from the
//! repository's benchmark, not from this table.
//!
//! ## Layout
//!
//! - [`blocked`]: the readable version ([`attention_blocked`], [`attention_loop`]).
//! - [`fast`]: the fast version's driver ([`attention`], [`attention_with`], [`Config`]): packs
//!   one head's keys and values, then runs the query blocks in parallel.
//! - [`kernels`]: the micro-kernels in three instruction sets ([`Isa`]), the `2^x` polynomial,
//!   and all of the crate's `unsafe`.
//! - `examples/speed.rs`: milliseconds and GFLOP/s at 1k–8k tokens, and the alternatives
//!   measured; `benches/online.rs`: criterion.

pub mod blocked;
pub mod fast;
pub mod kernels;

pub use blocked::{DEFAULT_BLOCK, attention_blocked, attention_loop};
pub use fast::{Config, attention, attention_with};
pub use kernels::Isa;
