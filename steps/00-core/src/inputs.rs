//! Seeded random inputs: the same seed gives the same q, k, v on every machine.
//!
//! A small generator of our own (SplitMix64, then Box–Muller for normal values) rather than
//! a crate, so that the numbers never change under a dependency update.

use ndarray::Array4;

use crate::Shape;

/// SplitMix64 (Steele, Lea & Flood 2014): a 64-bit state, one add and a mix per draw.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1]: never 0, so its logarithm is finite.
    pub fn next_unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal, by Box–Muller (one of the pair is used).
    pub fn next_normal(&mut self) -> f64 {
        let (u1, u2) = (self.next_unit(), self.next_unit());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// An array of the given shape filled with standard normal values.
pub fn random_normal(shape: Shape, seed: u64) -> Array4<f32> {
    let mut rng = SplitMix64::new(seed);
    Array4::from_shape_simple_fn(shape.dims(), || rng.next_normal() as f32)
}

/// q, k and v of one shape, normal values, each from its own stream of the one seed.
pub fn random_qkv(shape: Shape, seed: u64) -> [Array4<f32>; 3] {
    let s = seed.wrapping_mul(3);
    [
        random_normal(shape, s),
        random_normal(shape, s + 1),
        random_normal(shape, s + 2),
    ]
}
