//! What the CPU exercise checkers share. A reader fills in a function in a step's
//! `exercises/` folder; the step's exercise binary compiles that file in, hands the function
//! to the step's checker, and prints the verdict with [`report`]. A checker runs the
//! reader's code through [`attempt`], so a `todo!()` still in place, or an index out of
//! range, is a verdict (`not yet`, and why) rather than a crash.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::ExitCode;

/// Why a reader's function is not right yet: the case it failed on, and what was wrong
/// there (what was expected, what came back, and the rule it broke).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotYet {
    pub case: String,
    pub why: String,
}

impl NotYet {
    pub fn new(case: impl Into<String>, why: impl Into<String>) -> Self {
        NotYet {
            case: case.into(),
            why: why.into(),
        }
    }
}

impl fmt::Display for NotYet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.case, self.why)
    }
}

impl std::error::Error for NotYet {}

thread_local! {
    /// Where the last panic on this thread happened, as [`quiet_panics`]'s hook saw it.
    static PANIC_AT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// For a checker binary: a panic prints nothing of its own (no backtrace of the checker's
/// frames) and [`attempt`] says where in the reader's file it happened.
pub fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        // a binary includes the reader's file by a path relative to its own
        let at = info.location().map(|l| {
            let file = l.file().replace("/src/bin/../../", "/");
            format!("{file}:{}", l.line())
        });
        PANIC_AT.with(|p| *p.borrow_mut() = at);
    }));
}

/// Runs `f`, which calls the reader's code, in `case`; a panic becomes a [`NotYet`] that
/// gives its message (`not yet implemented` for a `todo!()` left in), and where it
/// happened once [`quiet_panics`] has been called.
pub fn attempt<T>(case: &str, f: impl FnOnce() -> T) -> Result<T, NotYet> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        let at = PANIC_AT
            .with(|p| p.borrow_mut().take())
            .map(|at| format!(" at {at}"))
            .unwrap_or_default();
        NotYet::new(case, format!("your function panicked{at}: {message}"))
    })
}

/// FlashAttention's rule for an exercise: at most twice the error the step's own code makes
/// on the same case against the `f64` reference, or twice one rounding of a value of size
/// `scale` where the step's own is smaller (an exact answer from the step must not demand
/// an exact one from the reader).
pub fn twice(step_error: f64, scale: f64) -> f64 {
    2.0 * step_error.max(f64::from(f32::EPSILON) * scale.abs().max(1.0))
}

/// The largest `|got − expected|`; a NaN, or a length that differs, counts as infinite.
pub fn max_error(got: &[f32], expected: &[f64]) -> f64 {
    if got.len() != expected.len() {
        return f64::INFINITY;
    }
    got.iter()
        .zip(expected)
        .map(|(&g, &e)| match f64::from(g) - e {
            d if d.is_nan() => f64::INFINITY,
            d => d.abs(),
        })
        .fold(0.0, f64::max)
}

/// `got` against `expected` within `allowed` at every index, or a [`NotYet`] for `case` that
/// names the worst entry (`what at [i]`), both values, its error and the bound (`rule` says where
/// the bound comes from). An `expected` of ±∞ must come back exact.
pub fn within(
    case: &str,
    what: &str,
    got: &[f32],
    expected: &[f64],
    allowed: f64,
    rule: &str,
) -> Result<(), NotYet> {
    if got.len() != expected.len() {
        return Err(NotYet::new(
            case,
            format!(
                "{what} has {} values, where {} were expected",
                got.len(),
                expected.len()
            ),
        ));
    }
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&g, &e)) in got.iter().zip(expected).enumerate() {
        let error = if e.is_infinite() {
            // the log-sum-exp of a row that saw no key
            if f64::from(g) == e {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            match f64::from(g) - e {
                d if d.is_nan() => f64::INFINITY,
                d => d.abs(),
            }
        };
        if error > allowed && worst.is_none_or(|(_, w)| error > w) {
            worst = Some((i, error));
        }
    }
    match worst {
        None => Ok(()),
        Some((i, error)) => Err(NotYet::new(
            case,
            format!(
                "{what}{} is {}, the f64 reference {}: error {error:.2e}, allowed {allowed:.2e} ({rule})",
                if got.len() == 1 {
                    String::new()
                } else {
                    format!(" at [{i}]")
                },
                got[i],
                expected[i]
            ),
        )),
    }
}

/// `got` exactly 0 at every index where `zero` holds (a masked key, say: `because` says
/// why), or a [`NotYet`] for `case` that names the first entry that is not.
pub fn zero_where(
    case: &str,
    what: &str,
    got: &[f32],
    zero: impl Fn(usize) -> bool,
    because: &str,
) -> Result<(), NotYet> {
    match (0..got.len()).find(|&i| zero(i) && got[i] != 0.0) {
        None => Ok(()),
        Some(i) => Err(NotYet::new(
            case,
            format!(
                "{what} at [{i}] is {}, where it must be exactly 0 ({because})",
                got[i]
            ),
        )),
    }
}

/// Prints a checker's verdict on the file `template`: `right` and where the solution is to
/// compare with (exit 0), or `not yet`, the case and why (exit 1). `cases` is how many cases
/// a right answer passed.
pub fn report(template: &str, solution: &str, verdict: Result<usize, NotYet>) -> ExitCode {
    match verdict {
        Ok(cases) => {
            println!("right: {template} passes all {cases} cases");
            println!("compare with the solution: {solution}");
            ExitCode::SUCCESS
        }
        Err(not_yet) => {
            println!("not yet: {not_yet}");
            println!("(edit {template} and run this again; the solution is {solution})");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_a_verdict_that_gives_its_message() {
        let e = attempt("case 1", || -> u32 { todo!() }).unwrap_err();
        assert_eq!(e.case, "case 1");
        assert!(e.why.contains("not yet implemented"), "{e}");
        let e = attempt("case 2", || -> u32 { panic!("index {} out of range", 3) });
        assert!(e.unwrap_err().why.contains("index 3 out of range"));
        assert_eq!(attempt("case 3", || 7), Ok(7));
    }

    #[test]
    fn within_names_the_worst_entry_and_holds_zeros_exact() {
        let expected = [1.0, 0.5, 0.0];
        assert_eq!(
            within("c", "p", &[1.0, 0.5, 0.0], &expected, 1e-6, "r"),
            Ok(())
        );
        let e = within("c", "p", &[1.0, 0.6, 0.0], &expected, 1e-6, "r").unwrap_err();
        assert!(e.why.starts_with("p at [1] is 0.6"), "{e}");
        // ±∞ must be exact, and a masked entry exactly 0 by zero_where
        let inf = [f64::NEG_INFINITY];
        assert!(within("c", "lse", &[-1e30], &inf, 1e-6, "r").is_err());
        assert_eq!(
            within("c", "lse", &[f32::NEG_INFINITY], &inf, 1e-6, "r"),
            Ok(())
        );
        assert_eq!(
            within("c", "p", &[1.0, 0.5, 1e-9], &expected, 1e-6, "r"),
            Ok(())
        );
        let e = zero_where("c", "p", &[1.0, 0.5, 1e-9], |i| i == 2, "masked").unwrap_err();
        assert!(e.why.starts_with("p at [2] is 0.000000001, where"), "{e}");
        assert_eq!(
            zero_where("c", "p", &[1.0, 0.5, 0.0], |i| i == 2, "masked"),
            Ok(())
        );
        let e = within("c", "p", &[f32::NAN, 0.5, 0.0], &expected, 1e-6, "r").unwrap_err();
        assert!(e.why.contains("error inf"), "{e}");
        assert!(within("c", "p", &[1.0], &expected, 1e-6, "r").is_err());
        assert_eq!(max_error(&[1.0, f32::NAN], &[1.0, 0.0]), f64::INFINITY);
        assert_eq!(twice(0.0, 1.0), 2.0 * f64::from(f32::EPSILON));
        assert_eq!(twice(1e-3, 1.0), 2e-3);
    }
}
