//! The machine's f32 peak, measured: what the online softmax's GFLOP/s are a fraction of.
//!
//! A core's peak is its fused multiply-add units × their lanes × 2 × its clock, and the
//! clock under load is what no file says reliably (and it changes with how many cores are
//! busy). So the peak is measured, as a roofline's is: every core of rayon's pool runs
//! [`Kernels::fma_chains`](crate::kernels::Kernels::fma_chains), independent chains of
//! multiply-adds that never touch memory, for some milliseconds; the FLOPs of all of them over
//! the wall time of the slowest is the peak this machine reaches with these instructions.

use std::time::Instant;

use crate::kernels::{Isa, Kernels};

/// The measured f32 peak of `isa` over every thread of rayon's pool, in GFLOP/s: the best
/// of three rounds (a round shares the cores with whatever else runs; the best one shared
/// the least).
pub fn f32_peak_gflops(isa: Isa) -> Option<f64> {
    let kernels = Kernels::new(isa).ok()?;
    // 12 chains × 4M vector multiply-adds a thread: 13 ms a round on a 2-core Zen 4,
    // short enough to run before a sweep
    let iters = 4_000_000;
    let best = (0..3)
        .map(|_| {
            let start = Instant::now();
            // one set of chains on every thread of the pool, never two on one
            let (flops, sum) = rayon::broadcast(|_| kernels.fma_chains(iters))
                .into_iter()
                .fold((0.0, 0.0f32), |a, b| (a.0 + b.0, a.1 + b.1));
            std::hint::black_box(sum);
            flops / start.elapsed().as_secs_f64()
        })
        .fold(0.0, f64::max);
    Some(best / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_counts_what_the_chains_compute() {
        // every instruction set this CPU has gives a positive, finite peak, and the chains'
        // FLOP count is 2 × lanes × chains × iterations
        let (flops, sum) = Kernels::new(Isa::Scalar).unwrap().fma_chains(10);
        assert_eq!(flops, 2.0 * crate::kernels::PEAK_CHAINS as f64 * 10.0);
        assert!(sum.is_finite() && sum > 0.0);
        let peak = f32_peak_gflops(Isa::detect()).expect("the detected ISA is available");
        assert!(peak.is_finite() && peak > 0.0, "{peak}");
    }
}
