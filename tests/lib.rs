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
