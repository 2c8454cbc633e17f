//! The table of cases every method runs, and the tolerance rule results are held to.

use flash_core::Shape;

/// One case of the table: a shape and a seed.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub shape: Shape,
    pub seed: u64,
}

/// The cross-step table: lengths that leave partial blocks of every size we use (1, 77,
/// 100, 300, 1000), full blocks (128, 256), odd numbers of sequences and heads, and head
/// dims 64 (the tutorial's), 32 and 128.
pub fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (i, tokens) in [1, 77, 100, 128, 256, 300, 1000].into_iter().enumerate() {
        cases.push(Case {
            shape: Shape::new(2, 3, tokens, 64),
            seed: 10 + i as u64,
        });
    }
    cases.push(Case {
        shape: Shape::new(1, 5, 130, 32),
        seed: 40,
    });
    cases.push(Case {
        shape: Shape::new(3, 1, 200, 128),
        seed: 41,
    });
    cases
}

/// The largest max-abs error an `f32` CPU method may have against the `f64` reference.
pub const F32_MAX_ABS: f64 = 1e-5;

/// What a test checked of each method, per kind of case the method claims (a dtype of its
/// `dtypes()`, a pass it has): the cases checked and the cases it refused. A test that
/// skips a refusal (a head dim a kernel is not compiled for) counts it here, so that a
/// method refusing every case of a kind it claims fails the test instead of passing on
/// nothing.
#[derive(Debug, Default)]
pub struct Tally {
    // (method, kind) → (cases checked, cases refused), in the order of the claims
    counts: Vec<((String, String), [usize; 2])>,
}

impl Tally {
    /// A kind of case `method` claims: the test must check it on at least one case.
    pub fn claim(&mut self, method: &str, kind: impl std::fmt::Display) {
        self.at(method, kind);
    }

    /// One case of `kind` checked on `method`.
    pub fn checked(&mut self, method: &str, kind: impl std::fmt::Display) {
        self.at(method, kind)[0] += 1;
    }

    /// One case of `kind` that `method` refused and the test skipped.
    pub fn refused(&mut self, method: &str, kind: impl std::fmt::Display) {
        self.at(method, kind)[1] += 1;
    }

    fn at(&mut self, method: &str, kind: impl std::fmt::Display) -> &mut [usize; 2] {
        let key = (method.to_string(), kind.to_string());
        let i = match self.counts.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                self.counts.push((key, [0, 0]));
                self.counts.len() - 1
            }
        };
        &mut self.counts[i].1
    }

    /// Prints what was checked of each method, then panics naming every method and kind it
    /// claims that no case checked.
    pub fn assert_each_claim_checked(&self) {
        let mut unchecked = Vec::new();
        for ((method, kind), [checked, refused]) in &self.counts {
            println!("{method:>16} {kind}: {checked} cases checked, {refused} refused");
            if *checked == 0 {
                unchecked.push(format!(
                    "{method} claims {kind} but no case checked it ({refused} refused)"
                ));
            }
        }
        assert!(unchecked.is_empty(), "{}", unchecked.join("; "));
    }
}

#[cfg(test)]
mod tests {
    use super::Tally;

    #[test]
    fn a_claim_no_case_checked_fails_naming_the_method_and_the_kind() {
        let mut tally = Tally::default();
        tally.claim("a", "bf16");
        tally.claim("b", "f16");
        tally.checked("a", "bf16");
        tally.refused("b", "f16");
        let got = std::panic::catch_unwind(|| tally.assert_each_claim_checked());
        let message = *got.unwrap_err().downcast::<String>().unwrap();
        assert_eq!(message, "b claims f16 but no case checked it (1 refused)");
        tally.checked("b", "f16");
        tally.assert_each_claim_checked();
    }
}
