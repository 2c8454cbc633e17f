//! Chapter 5's exercise, on the CPU: the backward of LayerNorm for one row, `dx` from the
//! row `x`, its weights `w` and the output's gradient `dy`, written by the reader in
//! `exercises/layernorm_backward.rs`. The checker holds it, on seeded rows of every width
//! the cases name, to central finite differences of the `f64` forward
//! ([`layernorm`](crate::layers::layernorm)), by FlashAttention's rule against the step's
//! own [`layernorm_backward`](crate::layers::layernorm_backward), which the template was
//! cut from. The `train-exercise` binary runs it on the reader's file.

use flash_core::exercise::{NotYet, attempt, twice};
use flash_core::inputs::SplitMix64;
use ndarray::{Array1, Array2, aview1};

use crate::layers::{LAYERNORM_EPS, layernorm, layernorm_backward};

/// The template the reader fills in.
pub const TEMPLATE: &str = "steps/05-train/exercises/layernorm_backward.rs";

/// Where the solution is.
pub const SOLUTION: &str = "layernorm_backward in steps/05-train/src/layers.rs \
     (chapter 5, Exercises, under Solution)";

/// The signature of the exercise: `(x, w, dy, eps) -> dx`.
pub type LayernormDx<'a> = dyn Fn(&[f64], &[f64], &[f64], f64) -> Vec<f64> + 'a;

/// One case: a name, the row's length, and how its values are drawn (`offset + spread · z`
/// with `z` standard normal); where `zero_weights` holds, every other weight is 0.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub name: &'static str,
    pub width: usize,
    pub offset: f64,
    pub spread: f64,
    pub zero_weights: bool,
}

/// Rows of one value, whose output is `b` whatever `x` is, so `dx` is 0; of 4, of 64
/// (chapter 5's model) and of 768 (GPT-2 small's); of 64 around 1,000; of 64 almost equal,
/// whose variance (10⁻⁶) is under `eps`, so that a `σ` without it is off by a factor of 3;
/// and of 64 with every other weight 0.
pub const CASES: [Case; 7] = [
    Case::normal("one value", 1),
    Case::normal("4 values", 4),
    Case::normal("64 values", 64),
    Case::normal("768 values", 768),
    Case {
        name: "64 values around 1000",
        offset: 1000.0,
        ..Case::normal("", 64)
    },
    Case {
        name: "64 values within 0.001 of each other, a variance under eps",
        offset: 3.0,
        spread: 1e-3,
        ..Case::normal("", 64)
    },
    Case {
        name: "64 values, every other weight 0",
        zero_weights: true,
        ..Case::normal("", 64)
    },
];

/// Rows drawn for each case.
pub const ROWS: usize = 8;

impl Case {
    const fn normal(name: &'static str, width: usize) -> Case {
        Case {
            name,
            width,
            offset: 0.0,
            spread: 1.0,
            zero_weights: false,
        }
    }

    /// Row `row`'s `x`, `w`, `b` and `dy`, drawn from `seed`.
    fn draw(&self, seed: u64) -> [Vec<f64>; 4] {
        let mut rng = SplitMix64::new(seed);
        let mut normals =
            |n: usize| -> Vec<f64> { (0..n).map(|_| rng.next_normal()).collect() };
        let x = normals(self.width)
            .into_iter()
            .map(|z| self.offset + self.spread * z)
            .collect();
        let mut w: Vec<f64> = normals(self.width)
            .into_iter()
            .map(|z| 1.0 + 0.5 * z)
            .collect();
        if self.zero_weights {
            w.iter_mut().step_by(2).for_each(|w| *w = 0.0);
        }
        let b = normals(self.width);
        let dy = normals(self.width);
        [x, w, b, dy]
    }
}

/// `Σ_j dy_j · y_j(x)`, whose gradient with respect to `x` is the row's `dx`, by the step's
/// `f64` forward.
fn loss(x: &[f64], w: &[f64], b: &[f64], dy: &[f64]) -> f64 {
    let x = Array2::from_shape_vec((1, x.len()), x.to_vec()).expect("one row");
    let y = layernorm(x.view(), aview1(w), aview1(b)).out;
    y.iter().zip(dy).map(|(y, dy)| y * dy).sum()
}

/// Central finite differences of [`loss`], one input at a time: `(L(x + h) − L(x − h)) / 2h`,
/// `h` a millionth of the rows' spread, so that a row within 0.001 of its mean is not
/// flattened.
fn finite_differences(
    case: &Case,
    x: &[f64],
    w: &[f64],
    b: &[f64],
    dy: &[f64],
) -> Vec<f64> {
    let h = 1e-6 * case.spread;
    (0..x.len())
        .map(|j| {
            let mut at = x.to_vec();
            at[j] = x[j] + h;
            let up = loss(&at, w, b, dy);
            at[j] = x[j] - h;
            let down = loss(&at, w, b, dy);
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// The step's own `dx` for one row, as the model computes it: the forward for the row's
/// mean and `1/σ`, then [`layernorm_backward`] into zeros.
pub fn layernorm_dx_of_the_step(x: &[f64], w: &[f64], dy: &[f64], eps: f64) -> Vec<f64> {
    assert_eq!(
        eps, LAYERNORM_EPS,
        "the step's LayerNorm has eps {LAYERNORM_EPS}"
    );
    let d = x.len();
    let x = Array2::from_shape_vec((1, d), x.to_vec()).expect("one row");
    let dy = Array2::from_shape_vec((1, d), dy.to_vec()).expect("one row");
    let norm = layernorm(x.view(), aview1(w), Array1::zeros(d).view());
    let (mut dx, mut dw, mut db) =
        (Array2::zeros((1, d)), Array1::zeros(d), Array1::zeros(d));
    layernorm_backward(
        dy.view(),
        x.view(),
        aview1(w),
        &norm,
        dx.view_mut(),
        dw.view_mut(),
        db.view_mut(),
    );
    dx.into_iter().collect()
}

/// Checks `dx` (the reader's) on [`ROWS`] rows of every case, with `eps` the model's
/// ([`LAYERNORM_EPS`]). For each row, in order: `dx` has the row's length and is finite; it
/// sums to 0, as adding one number to every `x` changes no `y`; and each entry is within
/// twice the error of the step's own against the finite differences (or of one `f32`
/// rounding of the largest, where the step's is smaller). The number of cases, or the first
/// row that fails and why.
pub fn check(dx: &LayernormDx) -> Result<usize, NotYet> {
    for (n, case) in CASES.iter().enumerate() {
        let rows: Vec<[Vec<f64>; 4]> = (0..ROWS)
            .map(|r| case.draw(5500 + 100 * n as u64 + r as u64))
            .collect();
        let fd: Vec<Vec<f64>> = rows
            .iter()
            .map(|[x, w, b, dy]| finite_differences(case, x, w, b, dy))
            .collect();
        let scale = fd.iter().flatten().fold(0.0_f64, |m, v| m.max(v.abs()));
        let step_error = rows
            .iter()
            .zip(&fd)
            .map(|([x, w, _, dy], fd)| {
                let ours = layernorm_dx_of_the_step(x, w, dy, LAYERNORM_EPS);
                ours.iter()
                    .zip(fd)
                    .fold(0.0_f64, |m, (o, f)| m.max((o - f).abs()))
            })
            .fold(0.0, f64::max);
        let allowed = twice(step_error, scale);
        let rule =
            "twice the error of the step's layernorm_backward against finite differences";
        for (r, ([x, w, _, dy], fd)) in rows.iter().zip(&fd).enumerate() {
            let at = format!("{} (width {}), row {r}", case.name, case.width);
            let got = attempt(&at, || dx(x, w, dy, LAYERNORM_EPS))?;
            if got.len() != x.len() {
                let why =
                    format!("dx has {} values, where the row has {}", got.len(), x.len());
                return Err(NotYet::new(at, why));
            }
            if let Some(j) = got.iter().position(|v| !v.is_finite()) {
                let why = format!(
                    "dx[{j}] is {}, where it must be a number (a row of equal values has \
                     variance 0: is eps in σ?)",
                    got[j]
                );
                return Err(NotYet::new(at, why));
            }
            let sum: f64 = got.iter().sum();
            if sum.abs() > allowed * x.len() as f64 {
                let why = format!(
                    "dx sums to {sum:.3e}, where it must sum to 0: adding one number to every \
                     x moves μ with it and changes no y (is g's mean taken away?)"
                );
                return Err(NotYet::new(at, why));
            }
            let worst = (0..got.len())
                .map(|j| (j, (got[j] - fd[j]).abs()))
                .fold((0, 0.0), |w, e| if e.1 > w.1 { e } else { w });
            if worst.1 > allowed {
                let j = worst.0;
                let why = format!(
                    "dx[{j}] is {:.6e}, finite differences give {:.6e}: error {:.2e}, \
                     allowed {allowed:.2e} ({rule})",
                    got[j], fd[j], worst.1
                );
                return Err(NotYet::new(at, why));
            }
        }
    }
    Ok(CASES.len())
}
