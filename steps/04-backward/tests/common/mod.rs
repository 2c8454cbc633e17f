//! FlashAttention's rule on inputs whose scores are large, for `large_scores.rs` and
//! `properties.rs`.
//!
//! The rule: a gradient's max-abs error against the `f64` reference is at most twice a
//! baseline's, plus 10⁻⁶. On inputs of order 1 the baseline is the backward by hand in
//! `f32` (`against_reference.rs`). With scores in the hundreds it is the larger of that and
//! the
//! *floor* of FlashAttention's formulas in `f32`:
//!
//! The blockwise backward rebuilds `P = exp(S − lse)` from `f32` scores and the forward's
//! `f32` log-sum-exp, and takes `δ = dO·O` from the forward's `f32` output. An `f32`
//! log-sum-exp of 300 is known to half a unit in the last place, 1.5·10⁻⁵, and so, in every
//! probability of its row, is the `P` rebuilt from it, where the backward by hand, which
//! normalises its own rows, is exact to a few units of 10⁻⁸ (FlashAttention keeps its
//! log-sum-exp in `f32` as well). The floor is the error of a backward that rounds only
//! what those formulas take in, the way the blockwise backward must: the scores (step 01's,
//! which every forward and the backward round alike), a log-sum-exp faithful to them
//! (either `f32` neighbour of the exact value, the worse of the two), `P` (to `f32`,
//! through an exponential as accurate as step 02's `2^x`), `dP = dO·Vᵀ` and `δ`; everything
//! else is exact. A backward whose scores and log-sum-exp are rounded differently from each
//! other is far above it.

use flash_core::Shape;
use flash_core::reference::error;
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, Array4, s};
use step04_backward::blockwise::delta;
use step04_backward::reference::{ReferenceGrads, backward_f64};
use step04_backward::{Grads, backward_by_hand, forward};

/// One input: q, k, v and dO, the `f64` reference gradients and the errors of the backward
/// by hand, `[dq, dk, dv]`.
pub struct Check<'a> {
    q: &'a Array4<f32>,
    k: &'a Array4<f32>,
    v: &'a Array4<f32>,
    dout: &'a Array4<f32>,
    want: ReferenceGrads,
    by_hand: [f64; 3],
}

const GRADS: [&str; 3] = ["dq", "dk", "dv"];

fn max_abs_errors(got: [&Array4<f32>; 3], want: &ReferenceGrads) -> [f64; 3] {
    let want = [&want.dq, &want.dk, &want.dv];
    [0, 1, 2].map(|i| error(got[i], want[i]).max_abs)
}

impl<'a> Check<'a> {
    pub fn new(
        q: &'a Array4<f32>,
        k: &'a Array4<f32>,
        v: &'a Array4<f32>,
        dout: &'a Array4<f32>,
    ) -> Check<'a> {
        let want = backward_f64(q.view(), k.view(), v.view(), dout.view()).unwrap();
        let fwd = forward(q.view(), k.view(), v.view()).unwrap();
        let by_hand =
            backward_by_hand(q.view(), k.view(), v.view(), &fwd, dout.view()).unwrap();
        let by_hand = max_abs_errors([&by_hand.dq, &by_hand.dk, &by_hand.dv], &want);
        Check {
            q,
            k,
            v,
            dout,
            want,
            by_hand,
        }
    }

    /// The floor's errors `[dq, dk, dv]` for a backward given the output `out` of a
    /// forward.
    pub fn floor(&self, out: &Array4<f32>) -> [f64; 3] {
        let (q, k, v, dout) = (self.q, self.k, self.v, self.dout);
        let [b_n, h_n, t_n, d_n] = <[usize; 4]>::try_from(q.shape()).unwrap();
        let scale = Shape::new(b_n, h_n, t_n, d_n).scale();
        let scores = step01_naive::scores(q.view(), k.view()).unwrap();
        let delta = delta(out.view(), dout.view());
        let wide = |x: ndarray::ArrayView2<f32>| x.mapv(f64::from);
        let mut worst = [0.0f64; 3];
        for side in [Side::Down, Side::Up] {
            let mut g = ReferenceGrads {
                dq: Array4::zeros(q.raw_dim()),
                dk: Array4::zeros(q.raw_dim()),
                dv: Array4::zeros(q.raw_dim()),
            };
            for (b, h) in (0..b_n).flat_map(|b| (0..h_n).map(move |h| (b, h))) {
                let at = s![b, h, .., ..];
                // P_ij = exp(S_ij − lse_i) rounded to f32, lse_i one f32 neighbour of the
                // exact log-sum-exp of the f32 scores
                let mut p = Array2::<f64>::zeros((t_n, t_n));
                for i in 0..t_n {
                    let row = scores.slice(s![b, h, i, ..=i]).mapv(f64::from);
                    let m = row.fold(f64::NEG_INFINITY, |m, &x| m.max(x));
                    let lse = side.of(m + row.mapv(|x| (x - m).exp()).sum().ln());
                    for (j, &x) in row.iter().enumerate() {
                        p[[i, j]] = f64::from(((x - lse).exp() * side.exp_error()) as f32);
                    }
                }
                // dP = dO·Vᵀ in f32, as the backward's product makes it
                let mut dp = Array2::<f32>::zeros((t_n, t_n));
                general_mat_mul(1.0, &dout.slice(at), &v.slice(at).t(), 0.0, &mut dp);
                let mut ds = dp.mapv(f64::from);
                for (i, (mut ds, p)) in ds.rows_mut().into_iter().zip(p.rows()).enumerate()
                {
                    let delta = f64::from(delta[[b, h, i]]);
                    ds.zip_mut_with(&p, |d, &p| *d = p * (*d - delta));
                }
                g.dv.slice_mut(at).assign(&p.t().dot(&wide(dout.slice(at))));
                g.dq.slice_mut(at)
                    .assign(&(ds.dot(&wide(k.slice(at))) * scale));
                g.dk.slice_mut(at)
                    .assign(&(ds.t().dot(&wide(q.slice(at))) * scale));
            }
            let want = [&self.want.dq, &self.want.dk, &self.want.dv];
            for (i, got) in [&g.dq, &g.dk, &g.dv].into_iter().enumerate() {
                worst[i] = worst[i].max(error(got, want[i]).max_abs);
            }
        }
        worst
    }

    /// FlashAttention's rule for `got`, a backward given a forward whose floor is `floor`:
    /// each gradient's error at most twice the larger of by hand's and the floor's, plus
    /// 10⁻⁶. Each gradient's error over that baseline, or a message with the three errors.
    pub fn rule(&self, got: &Grads, floor: [f64; 3]) -> Result<[f64; 3], String> {
        let errs = max_abs_errors([&got.dq, &got.dk, &got.dv], &self.want);
        let mut ratios = [0.0; 3];
        for i in 0..3 {
            let base = self.by_hand[i].max(floor[i]);
            if errs[i] > 2.0 * base + 1e-6 {
                return Err(format!(
                    "{}: max abs error {:.3e}, by hand {:.3e}, floor {:.3e}",
                    GRADS[i], errs[i], self.by_hand[i], floor[i]
                ));
            }
            ratios[i] = errs[i] / base.max(1e-300);
        }
        Ok(ratios)
    }
}

/// Which `f32` neighbour of an exact value.
#[derive(Clone, Copy)]
enum Side {
    Down,
    Up,
}

impl Side {
    /// The factor by which step 02's `2^x` polynomial, relative error under 4·10⁻⁷
    /// (`kernels.rs`), can be off, in the direction a log-sum-exp rounded this way is.
    fn exp_error(self) -> f64 {
        match self {
            Side::Down => 1.0 + 4e-7,
            Side::Up => 1.0 - 4e-7,
        }
    }

    /// The largest `f32` at most `x` (down) or the smallest at least `x` (up), widened.
    fn of(self, x: f64) -> f64 {
        let near = x as f32;
        let r = match self {
            Side::Down if f64::from(near) > x => near.next_down(),
            Side::Up if f64::from(near) < x => near.next_up(),
            _ => near,
        };
        f64::from(r)
    }
}
