//! The exercise checker can tell right from wrong: it accepts the step's own LayerNorm
//! backward (the solution) and refuses the template as shipped (a `todo!()`), a `dx` without
//! `g`'s mean taken away, one without the mean of `g ∘ x̂`, and one whose `σ` leaves out
//! `eps`. None of them reads `exercises/`, so these keep passing once a reader has filled the
//! template in.

use step05_train::exercise::{CASES, check, layernorm_dx_of_the_step};

/// `dx = (g − a·mean(g) − b·x̂·mean(g ∘ x̂)) / σ`, `σ` with `eps` or without: the right
/// formula at `a = b = 1` with `eps`, a wrong one otherwise.
fn dx_with(x: &[f64], w: &[f64], dy: &[f64], eps: f64, a: f64, b: f64) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    let r = 1.0 / (var + eps).sqrt();
    let xhat: Vec<f64> = x.iter().map(|x| (x - mean) * r).collect();
    let g: Vec<f64> = dy.iter().zip(w).map(|(dy, w)| dy * w).collect();
    let mean_g = g.iter().sum::<f64>() / n;
    let mean_gx = g.iter().zip(&xhat).map(|(g, x)| g * x).sum::<f64>() / n;
    (0..x.len())
        .map(|j| (g[j] - a * mean_g - b * xhat[j] * mean_gx) * r)
        .collect()
}

#[test]
fn the_checker_accepts_the_solution() {
    assert_eq!(check(&layernorm_dx_of_the_step), Ok(CASES.len()));
}

#[test]
fn the_checker_accepts_the_formula_written_out() {
    let right =
        |x: &[f64], w: &[f64], dy: &[f64], eps: f64| dx_with(x, w, dy, eps, 1.0, 1.0);
    assert_eq!(check(&right), Ok(CASES.len()));
}

#[test]
fn the_checker_refuses_the_template() {
    let e = check(&|_: &[f64], _: &[f64], _: &[f64], _: f64| -> Vec<f64> { todo!() })
        .unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_checker_refuses_a_dx_without_the_mean_of_g() {
    let e = check(&|x: &[f64], w: &[f64], dy: &[f64], eps: f64| {
        dx_with(x, w, dy, eps, 0.0, 1.0)
    })
    .unwrap_err();
    // a row of one value has dx = 0, which only g's mean taken away gives
    assert!(e.case.starts_with("one value"), "{e}");
    assert!(e.why.contains("must sum to 0"), "{e}");
}

#[test]
fn the_checker_refuses_a_dx_without_the_mean_of_g_times_xhat() {
    let e = check(&|x: &[f64], w: &[f64], dy: &[f64], eps: f64| {
        dx_with(x, w, dy, eps, 1.0, 0.0)
    })
    .unwrap_err();
    assert!(e.case.starts_with("4 values"), "{e}");
    assert!(e.why.contains("finite differences give"), "{e}");
}

#[test]
fn the_checker_refuses_a_sigma_without_eps() {
    let e =
        check(&|x: &[f64], w: &[f64], dy: &[f64], _: f64| dx_with(x, w, dy, 0.0, 1.0, 1.0))
            .unwrap_err();
    // a row of one value has variance 0: 0/0
    assert!(
        e.case.starts_with("one value") && e.why.contains("NaN"),
        "{e}"
    );
    // and elsewhere eps still counts: at a variance of 1 it moves σ by 5·10⁻⁶ of itself
    let guarded = |x: &[f64], w: &[f64], dy: &[f64], _: f64| {
        if x.len() == 1 {
            vec![0.0]
        } else {
            dx_with(x, w, dy, 0.0, 1.0, 1.0)
        }
    };
    let e = check(&guarded).unwrap_err();
    assert!(e.case.starts_with("4 values"), "{e}");
    assert!(e.why.contains("finite differences give"), "{e}");
}
