//! Chapter 6.1's exercise checker can tell right from wrong: it accepts `backward.cuh`'s
//! waits (the solution, held to the kernel's text); it lets a producer whose first round
//! waits for parity 1 (which returns at once on a new barrier, as CUTLASS's pipelines
//! start) through every rule but the last, the kernel's own; and it refuses the template, a
//! producer that never waits, one that waits for this round's release rather than the
//! last's, and consumers that wait for the wrong parity. None of them reads `exercises/`.

use step06_hopper::exercise::{WAIT_STAGES, Waits, check_waits, stream_waits};

const BACKWARD_CUH: &str = include_str!("../kernels/backward.cuh");
const ONE_PASS_CU: &str = include_str!("../kernels/backward_2_one_pass.cu");

#[test]
fn the_solution_is_the_kernels_waits() {
    for line in [
        "const int s = n % STAGES, row0 = stream_row0 + n * STREAM;",
        "if (n >= STAGES) mbar_wait(smem_u32(&empty[s]), ((n / STAGES) - 1) & 1);",
    ] {
        assert!(
            BACKWARD_CUH.contains(line),
            "backward.cuh no longer has {line}"
        );
    }
    let consumer = "mbar_wait(smem_u32(&full[s]), (n / STAGES) & 1);";
    assert!(
        ONE_PASS_CU.contains(consumer),
        "the one pass no longer has {consumer}"
    );
}

#[test]
fn the_checker_accepts_the_solution() {
    assert_eq!(check_waits(&stream_waits), Ok(WAIT_STAGES.len()));
}

#[test]
fn a_first_wait_that_returns_at_once_breaks_only_the_kernels_rule() {
    // right in what it does, but not the kernel's: only the last rule tells them apart
    let e = check_waits(&|n, s| Waits {
        empty_parity: Some(stream_waits(n, s).empty_parity.unwrap_or(1)),
        ..stream_waits(n, s)
    })
    .unwrap_err();
    assert!(e.why.contains("backward.cuh's is"), "{e}");
}

#[test]
fn the_checker_refuses_the_template() {
    let e = check_waits(&|_, _| -> Waits { todo!() }).unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_checker_refuses_a_producer_that_never_waits() {
    let e = check_waits(&|n, s| Waits {
        empty_parity: None,
        ..stream_waits(n, s)
    })
    .unwrap_err();
    assert_eq!(e.case, "2 stages, block 2", "{e}");
    assert!(e.why.contains("may still be reading"), "{e}");
}

#[test]
fn the_checker_refuses_a_producer_a_round_late() {
    // empty's phase k rather than k - 1: a wait for a release that has not happened yet
    let e = check_waits(&|n, s| Waits {
        empty_parity: Some(((n / s) % 2) as u32),
        ..stream_waits(n, s)
    })
    .unwrap_err();
    assert!(e.why.contains("waits forever"), "{e}");
}

#[test]
fn the_checker_refuses_consumers_on_the_wrong_parity() {
    let e = check_waits(&|n, s| Waits {
        full_parity: 1 - stream_waits(n, s).full_parity,
        ..stream_waits(n, s)
    })
    .unwrap_err();
    assert_eq!(e.case, "2 stages, block 0", "{e}");
    assert!(e.why.contains("before block 0's copy lands"), "{e}");
}
