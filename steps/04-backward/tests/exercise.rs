//! The exercise checker can tell right from wrong: it accepts the step's own
//! `softmax_backward` (the solution) and refuses one that leaves δ out. Neither reads the
//! template in `exercises/`, so both keep passing once a reader has filled it in. Ignored
//! where there is no GPU.

use step03_cuda_forward::Gpu;
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
