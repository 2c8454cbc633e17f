//! # Step 02: the online softmax on the CPU
//!
//! The same causal attention as step 01, without its table of scores: keys and values are
//! read a block at a time, and each query row keeps three running values, its largest score
//! so far `m`, its sum `ℓ = Σ e^(s − m)` and its unnormalised output `Σ e^(s − m)·v`,
//! rescaled by `e^(m_old − m_new)` whenever a larger score arrives (Milakov & Gimelshein
//! 2018; FlashAttention, Dao et al. 2022). Memory beyond the output grows with the block
//! size, not with T². Key blocks entirely after a query block's last row are skipped, so
//! causal attention does about half the work of the full product.
//!
//! Two versions of one algorithm:
//!
//! 1. [`attention_loop`] / [`attention_blocked`]: single-threaded plain loops, to be read
//!    next to the derivation (the book includes it piece by piece).
//! 2. [`attention`] / [`attention_with`]: parallel over (sequence, head, query block) with
//!    rayon; register-blocked micro-kernels for `S = Q·Kᵀ` and `O += P·V` in AVX-512F,
//!    AVX2+FMA or plain Rust, chosen at run time; `log2(e)` folded into the subtraction of
//!    the row maximum so the softmax takes `2^x`, by a SIMD polynomial. The scores are
//!    rounded exactly as step 01 rounds them, which step 04's backward relies on
//!    ([`Kernels::scores`](kernels::Kernels::scores)).
//!
//! Both return the output and each row's natural log-sum-exp, like every method of the
//! repository, and are checked against step 01's `f64` reference.
//!
//! ## Versions and what they measured
//!
//! `cargo run --release -p step02-online-softmax --example online-speed -- variants`, 1
//! sequence × 12 heads × head dim 64, f32, causal, median of several runs, on the idle
//! 2-core AMD EPYC (AVX-512) of the book's CPU numbers; the full output is
//! `lab/logs/02-online-softmax/variants.txt`:
//!
//! | version | 1024 tokens | 4096 tokens |
//! | --- | --- | --- |
//! | `online` (AVX-512, blocks 64 × 64, polynomial `2^x`, log2 e folded) | 10.0 ms, 161 GFLOP/s | 154.9 ms, 166 GFLOP/s |
//! | the same with AVX2 | 24.1 ms | 227.1 ms |
//! | the same with the scalar fallback | 80.7 ms | 790.7 ms |
//! | the same with the standard library's `exp2` per value | 20.7 ms | 303.0 ms |
//! | `log2(e)` not folded (one multiply more per score) | 9.9 ms | 167.9 ms |
//! | the online softmax on `ndarray`'s matrix product, blocks of 64 | 35.8 ms | 427.3 ms |
//!
//! Blocks of 32 × 64 to 256 × 64 were within 10% of 64 × 64 at 4096 tokens (128 × 64 and
//! larger a little faster there, 256 × 64 23% slower at 1024). The book's numbers come from
//! the repository's benchmark, not from this table.
//!
//! ## Layout
//!
//! - [`blocked`]: the readable version ([`attention_blocked`], [`attention_loop`]).
//! - [`fast`]: the fast version's driver ([`attention`], [`attention_with`], [`Config`]):
//!   packs one head's keys and values, then runs the query blocks in parallel.
//! - [`kernels`]: the micro-kernels in three instruction sets ([`Isa`]), the `2^x`
//!   polynomial, the peak's multiply-add chains, and all of the crate's `unsafe`.
//! - [`peak`]: the machine's f32 peak, measured, that the GFLOP/s are a fraction of.
//! - [`OnlineLoop`], [`Online`]: the two as the benchmark's registry lists them
//!   ([`methods`]).
//! - `examples/online-speed.rs`: milliseconds and GFLOP/s at 1k–8k tokens, and the
//!   alternatives measured; `benches/online.rs`: criterion.

pub mod blocked;
pub mod exercise;
pub mod fast;
pub mod kernels;
pub mod peak;

pub use blocked::{DEFAULT_BLOCK, attention_blocked, attention_loop};
pub use fast::{Config, attention, attention_with};
pub use kernels::Isa;

use flash_core::{
    Attention, AttnError, Describe, Descriptor, Device, Dtype, Method, check_f32,
};
use ndarray::ArrayView4;

/// This step's methods, as the benchmark and the cross-step tests run them.
pub fn methods() -> Vec<&'static dyn Method> {
    vec![&OnlineLoop, &Online]
}

/// The step its methods' descriptors name.
const STEP: &str = "02-online-softmax";

/// `online_loop`: [`attention_loop`], the readable version.
#[derive(Clone, Copy, Debug)]
pub struct OnlineLoop;

impl Describe for OnlineLoop {
    fn descriptor(&self) -> Descriptor {
        Descriptor::new(
            "online_loop",
            STEP,
            Device::Cpu,
            "the online softmax as plain loops, blocks of 64: a running max, sum and output per row, no T×T table; single-threaded",
        )
    }
}

impl Method for OnlineLoop {
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        check_f32(dtype)?;
        attention_loop(q, k, v)
    }
}

/// `online`: [`attention`], the fast version.
#[derive(Clone, Copy, Debug)]
pub struct Online;

impl Describe for Online {
    fn descriptor(&self) -> Descriptor {
        Descriptor::new(
            "online",
            STEP,
            Device::Cpu,
            "the online softmax, parallel over (sequence, head, query block), AVX-512/AVX2 micro-kernels, 2^x by polynomial; no T×T table",
        )
    }
}

impl Method for Online {
    fn implementation(&self) -> String {
        fast::implementation()
    }
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        check_f32(dtype)?;
        attention(q, k, v)
    }
}
