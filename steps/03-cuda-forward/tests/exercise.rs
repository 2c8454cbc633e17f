//! The exercise checker can tell right from wrong: it accepts rung 1's own kernel (the
//! solution) and refuses rung 1 with its rescale taken out. Neither reads the template in
//! `exercises/`, so both keep passing once a reader has filled it in. Ignored where there
//! is no GPU.

use step03_cuda_forward::Gpu;
use step03_cuda_forward::exercise::{self, Exercise};

/// The line of rung 1 that shrinks what was summed so far when a new maximum comes.
const RESCALE: &str = "const float correction = fast_exp2((m - m_new) * scale_log2);";

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_checker_accepts_the_solution() {
    let gpu = Gpu::new().expect("a GPU");
    let checks = exercise::check(&gpu, Exercise::Rows, Exercise::Rows.solution(), |c| {
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
fn the_checker_refuses_a_kernel_without_its_rescale() {
    let gpu = Gpu::new().expect("a GPU");
    let solution = Exercise::Rows.solution();
    assert!(solution.contains(RESCALE), "rung 1 no longer has {RESCALE}");
    let broken = solution.replace(RESCALE, "const float correction = 1.f;");
    let checks =
        exercise::check(&gpu, Exercise::Rows, &broken, |c| println!("{c}")).unwrap();
    let refused = checks.iter().filter(|c| c.verdict().is_err()).count();
    assert!(refused > 0, "every case passed without the rescale");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_checker_reports_a_kernel_that_does_not_compile() {
    let gpu = Gpu::new().expect("a GPU");
    let broken = Exercise::Rows
        .solution()
        .replace(RESCALE, "const float correction = ;");
    let err = exercise::check(&gpu, Exercise::Rows, &broken, |_| {})
        .expect_err("a syntax error is refused");
    assert!(err.to_string().contains("NVRTC could not compile"), "{err}");
}
