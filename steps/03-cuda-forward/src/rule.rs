//! FlashAttention's rule for a forward on the GPU, in one place for the GPU tests and for
//! the exercise checker ([`exercise`](crate::exercise)): a method's largest error against
//! the `f64` reference is at most twice that of attention by hand computed in the same
//! precision ([`by_hand_low_precision`]), plus a margin for errors that are (nearly) zero
//! both ways; and its log-sum-exp is within a bound of the reference's.

use std::fmt;

use flash_core::inputs::random_qkv;
use flash_core::reference::{Error, attention_f64, error};
use flash_core::{Attention, AttnError, Shape};
use ndarray::ArrayView4;

use crate::gpu::{Dtype, Gpu};
use crate::host::{by_hand_low_precision, round_array};

/// The margin of the rule, for the case where both errors are (nearly) zero.
pub const MARGIN: f64 = 1e-5;

/// The bound on a kernel's log-sum-exp: it is accumulated in f32 from the 16-bit inputs'
/// exact products.
pub const KERNEL_LSE: f64 = 1e-3;
/// The bound on attention by hand's log-sum-exp: it is taken from scores rounded to 16 bits
/// (bf16 keeps 8 bits: about 0.4% of scores up to ~5 in size).
pub const BY_HAND_LSE: f64 = 3e-2;

/// A forward on host arrays: [`Gpu::attention`], [`Gpu::attention_by_hand`], a rung of the
/// ladder through [`Gpu::ladder_attention`], or a reader's rung through
/// [`Gpu::ladder_attention_from`].
pub trait HostFn:
    Fn(
    &Gpu,
    ArrayView4<f32>,
    ArrayView4<f32>,
    ArrayView4<f32>,
    Dtype,
) -> Result<Attention, AttnError>
{
}
impl<F> HostFn for F where
    F: Fn(
        &Gpu,
        ArrayView4<f32>,
        ArrayView4<f32>,
        ArrayView4<f32>,
        Dtype,
    ) -> Result<Attention, AttnError>
{
}

/// What one run of a forward measured against the reference: its errors and by hand's.
#[derive(Clone, Debug)]
pub struct ForwardCheck {
    /// The method, the shape and the dtype, for messages.
    pub what: String,
    /// The method's output against the `f64` reference.
    pub ours: Error,
    /// Attention by hand in the same precision against the same reference.
    pub by_hand: Error,
    /// The method's log-sum-exp against the reference's.
    pub lse: Error,
    /// The largest log-sum-exp error allowed.
    pub lse_bound: f64,
}

// ANCHOR: forward_rule
impl ForwardCheck {
    /// Runs `method` on seeded normal inputs of `shape` in `dtype` and measures it; an
    /// error only where the method itself fails (no GPU, a kernel that does not compile).
    pub fn run(
        gpu: &Gpu,
        shape: Shape,
        dtype: Dtype,
        seed: u64,
        name: &str,
        method: impl HostFn,
        lse_bound: f64,
    ) -> Result<ForwardCheck, AttnError> {
        let [q, k, v] = random_qkv(shape, seed);
        let got = method(gpu, q.view(), k.view(), v.view(), dtype)?;
        // the reference sees exactly the values the GPU saw
        let (qr, kr, vr) = (
            round_array(q.view(), dtype),
            round_array(k.view(), dtype),
            round_array(v.view(), dtype),
        );
        let reference = attention_f64(qr.view(), kr.view(), vr.view())?;
        let by_hand = by_hand_low_precision(q.view(), k.view(), v.view(), dtype);
        Ok(ForwardCheck {
            what: format!("{name} {shape} {}", dtype.name()),
            ours: error(&got.out, &reference.out),
            by_hand: error(&by_hand, &reference.out),
            lse: error(&got.lse, &reference.lse),
            lse_bound,
        })
    }

    /// The rule: `Ok`, or a message with both errors.
    pub fn verdict(&self) -> Result<(), String> {
        let (ours, by_hand) = (self.ours.max_abs, self.by_hand.max_abs);
        // a NaN is no error within the rule
        if ours.is_nan() || ours > 2.0 * by_hand + MARGIN {
            return Err(format!(
                "{}: out max abs error {ours:.3e} > 2 × by hand's {by_hand:.3e} \
                 (+{MARGIN:e})",
                self.what
            ));
        }
        if self.lse.max_abs.is_nan() || self.lse.max_abs >= self.lse_bound {
            return Err(format!(
                "{}: lse {}, allowed {:e}",
                self.what, self.lse, self.lse_bound
            ));
        }
        Ok(())
    }
}
// ANCHOR_END: forward_rule

impl fmt::Display for ForwardCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: ours {}; by hand {}; lse {}",
            self.what, self.ours, self.by_hand, self.lse
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(ours: f64, by_hand: f64, lse: f64) -> ForwardCheck {
        let e = |max_abs| Error {
            max_abs,
            rel_norm: 0.0,
        };
        ForwardCheck {
            what: "m".into(),
            ours: e(ours),
            by_hand: e(by_hand),
            lse: e(lse),
            lse_bound: KERNEL_LSE,
        }
    }

    #[test]
    fn the_rule_is_twice_by_hand_and_a_nan_breaks_it() {
        assert!(check(2e-3, 1e-3, 0.0).verdict().is_ok());
        let err = check(2.1e-3, 1e-3, 0.0).verdict().unwrap_err();
        assert!(err.contains("2.100e-3 > 2 × by hand's 1.000e-3"), "{err}");
        assert!(check(1e-3, 1e-3, 2e-3).verdict().is_err());
        // reference::error makes a NaN an infinite error; a NaN here fails too
        assert!(check(f64::NAN, 1e-3, 0.0).verdict().is_err());
        assert!(check(1e-3, 1e-3, f64::NAN).verdict().is_err());
    }
}
