//! FlashAttention's rule for a forward and backward on the GPU, in one place for the GPU
//! tests and for the exercise checker ([`exercise`](crate::exercise)): for each of the
//! output, dq, dk and dv, the largest error against the `f64` reference is at most twice
//! that of attention by hand (forward, and autograd's backward) in the same precision,
//! computed on the CPU, plus 10⁻⁵ of the largest value of the reference, for errors that
//! are (nearly) zero both ways.

use std::fmt;

use flash_core::reference::{Error, attention_f64, error};
use flash_core::{Attention, AttnError};
use ndarray::{Array4, ArrayView4};
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step03_cuda_forward::host::{by_hand_low_precision, round_array};

use crate::Grads;
use crate::cuda::backward_by_hand_low_precision;
use crate::reference::backward_f64;

/// A forward and backward on host arrays:
/// [`cuda::forward_backward`](crate::cuda::forward_backward) (the kernels),
/// [`cuda_by_hand::forward_backward`](crate::cuda_by_hand::forward_backward), or a reader's
/// row kernels through
/// [`cuda_by_hand::forward_backward_from`](crate::cuda_by_hand::forward_backward_from).
pub trait ForwardBackwardFn:
    Fn(
    &Gpu,
    ArrayView4<f32>,
    ArrayView4<f32>,
    ArrayView4<f32>,
    ArrayView4<f32>,
    Dtype,
) -> Result<(Attention, Grads), AttnError>
{
}
impl<F> ForwardBackwardFn for F where
    F: Fn(
        &Gpu,
        ArrayView4<f32>,
        ArrayView4<f32>,
        ArrayView4<f32>,
        ArrayView4<f32>,
        Dtype,
    ) -> Result<(Attention, Grads), AttnError>
{
}

/// One array's errors: the method's and by hand's against the reference, and the
/// reference's largest value (at least 1), which sizes the margin.
#[derive(Clone, Copy, Debug)]
pub struct ArrayCheck {
    /// `out`, `dq`, `dk` or `dv`.
    pub name: &'static str,
    pub ours: Error,
    pub by_hand: Error,
    pub size: f64,
}

impl ArrayCheck {
    /// The margin for errors that are (nearly) zero both ways: 10⁻⁵ of the array's size.
    pub fn margin(&self) -> f64 {
        1e-5 * self.size
    }

    /// Whether the error is within the rule (a NaN is not).
    pub fn within(&self) -> bool {
        let ours = self.ours.max_abs;
        !ours.is_nan() && ours <= 2.0 * self.by_hand.max_abs + self.margin()
    }
}

/// What one run of a forward and backward measured: out, dq, dk and dv.
#[derive(Clone, Debug)]
pub struct BackwardCheck {
    /// The input and the dtype, for messages.
    pub what: String,
    pub arrays: [ArrayCheck; 4],
}

// ANCHOR: backward_rule
impl BackwardCheck {
    /// Runs `run` on q, k, v and dout in `dtype` and measures it against the reference; an
    /// error only where the method itself fails (no GPU, a kernel that does not compile).
    pub fn run(
        gpu: &Gpu,
        run: impl ForwardBackwardFn,
        [q, k, v, dout]: [&Array4<f32>; 4],
        dtype: Dtype,
        what: &str,
    ) -> Result<BackwardCheck, AttnError> {
        let (fwd, grads) = run(gpu, q.view(), k.view(), v.view(), dout.view(), dtype)?;
        // the reference sees exactly the values the GPU saw
        let [qr, kr, vr, dr] = [q, k, v, dout].map(|x| round_array(x.view(), dtype));
        let want_out = attention_f64(qr.view(), kr.view(), vr.view())?;
        let want = backward_f64(qr.view(), kr.view(), vr.view(), dr.view())?;
        let hand_out = by_hand_low_precision(q.view(), k.view(), v.view(), dtype);
        let hand = backward_by_hand_low_precision(
            q.view(),
            k.view(),
            v.view(),
            dout.view(),
            dtype,
        );
        let size = |x: &Array4<f64>| x.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let check =
            |name, ours: &Array4<f32>, hand: &Array4<f32>, want: &Array4<f64>| ArrayCheck {
                name,
                ours: error(ours, want),
                by_hand: error(hand, want),
                size: size(want),
            };
        Ok(BackwardCheck {
            what: format!("{what} {}", dtype.name()),
            arrays: [
                check("out", &fwd.out, &hand_out, &want_out.out),
                check("dq", &grads.dq, &hand.dq, &want.dq),
                check("dk", &grads.dk, &hand.dk, &want.dk),
                check("dv", &grads.dv, &hand.dv, &want.dv),
            ],
        })
    }

    /// The rule for every array: `Ok`, or a message with both errors of the first one over
    /// it.
    pub fn verdict(&self) -> Result<(), String> {
        match self.arrays.iter().find(|a| !a.within()) {
            None => Ok(()),
            Some(a) => Err(format!(
                "{}: {} max abs error {:.3e} > 2 × by hand's {:.3e} (+{:.1e})",
                self.what,
                a.name,
                a.ours.max_abs,
                a.by_hand.max_abs,
                a.margin()
            )),
        }
    }
}
// ANCHOR_END: backward_rule

impl fmt::Display for BackwardCheck {
    /// A line for each array.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.arrays.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(
                f,
                "{} {}: ours {}; by hand {}",
                self.what, a.name, a.ours, a.by_hand
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_is_twice_by_hand_plus_a_margin_of_the_size() {
        let e = |max_abs| Error {
            max_abs,
            rel_norm: 0.0,
        };
        let a = |ours, size| ArrayCheck {
            name: "dq",
            ours: e(ours),
            by_hand: e(1e-3),
            size,
        };
        assert!(a(2e-3, 1.0).within());
        assert!(!a(2.1e-3, 1.0).within());
        // the margin grows with the gradient's size: 10⁻⁵ of 20 is 2·10⁻⁴
        assert!(a(2.1e-3, 20.0).within());
        assert!(!a(f64::NAN, 1.0).within());
        let check = BackwardCheck {
            what: "x bf16".into(),
            arrays: [a(1e-3, 1.0), a(3e-3, 1.0), a(1e-3, 1.0), a(1e-3, 1.0)],
        };
        let err = check.verdict().unwrap_err();
        assert!(
            err.starts_with("x bf16: dq max abs error 3.000e-3"),
            "{err}"
        );
    }
}
