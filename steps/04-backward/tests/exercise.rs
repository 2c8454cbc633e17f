//! The exercise checker can tell right from wrong: it accepts the step's own
//! `softmax_backward` (the solution) and refuses one that leaves δ out. Neither reads the
//! template in `exercises/`, so both keep passing once a reader has filled it in. Ignored
//! where there is no GPU.

use step03_cuda_forward::gpu::Gpu;
use step04_backward::exercise::{self, Exercise};

/// dS = P ∘ (dP − δ) as the solution writes it.
const DS: &str = "from_f32(to_f32(p[j]) * (to_f32(g[j]) - dot))";

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_checker_accepts_the_solution() {
    let gpu = Gpu::new().expect("a GPU");
    let solution = Exercise::SoftmaxBackward.solution();
    let checks = exercise::check(&gpu, Exercise::SoftmaxBackward, solution, |c| {
        println!("{c}")
    })
    .unwrap();
    assert_eq!(checks.len(), 2 * exercise::CASES.len());
    for check in checks {
        check.verdict().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_checker_refuses_a_kernel_without_delta() {
    let gpu = Gpu::new().expect("a GPU");
    let solution = Exercise::SoftmaxBackward.solution();
    assert!(solution.contains(DS), "softmax_backward no longer has {DS}");
    let broken = solution.replace(DS, "from_f32(to_f32(p[j]) * to_f32(g[j]))");
    let checks = exercise::check(&gpu, Exercise::SoftmaxBackward, &broken, |c| {
        println!("{c}")
    })
    .unwrap();
    let refused = checks.iter().filter(|c| c.verdict().is_err()).count();
    assert!(refused > 0, "every case passed without delta");
}

// The CPU exercise: the checker accepts the step's own δ and dS, and refuses the template
// as shipped (a `todo!()`) and a δ summed over the block's keys only, which is right only
// where the block holds the whole row.

use ndarray::{ArrayView2, ArrayViewMut2};
use step04_backward::exercise::{BLOCK_CASES, check_grad_scores, grad_scores_of_the_step};

#[test]
fn the_cpu_checker_accepts_the_solution() {
    assert_eq!(
        check_grad_scores(&grad_scores_of_the_step),
        Ok(BLOCK_CASES.len())
    );
}

#[test]
fn the_cpu_checker_refuses_the_template() {
    let e =
        check_grad_scores(&|_: ArrayView2<f32>,
                            _: ArrayView2<f32>,
                            _: ArrayView2<f32>,
                            _: ArrayViewMut2<f32>| { todo!() })
        .unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_cpu_checker_refuses_a_delta_over_the_block_only() {
    let e =
        check_grad_scores(&|_: ArrayView2<f32>,
                            _: ArrayView2<f32>,
                            p: ArrayView2<f32>,
                            mut ds: ArrayViewMut2<f32>| {
            for (mut ds, p) in ds.rows_mut().into_iter().zip(p.rows()) {
                let delta = p.dot(&ds);
                ds.zip_mut_with(&p, |d, &p| *d = p * (*d - delta));
            }
        })
        .unwrap_err();
    // one token, or one block a row, and the block's sum is the row's
    assert!(e.case.starts_with("77 tokens"), "{e}");
}
