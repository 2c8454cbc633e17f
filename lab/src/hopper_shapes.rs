//! The block shapes `hopper-check` compares for step 06's kernels: every rung of the
//! forward and both of the backward, in the shapes the step's methods launch and the others
//! that fit. The step's `kernel` module picks one per length; these are what the picks were
//! made among.

use flash_core::Shape;
use step06_hopper::kernel::{
    BackwardKernel, BackwardKernels, BackwardPass, BackwardRung, ForwardKernel, ForwardRung,
};

/// Lengths on both sides of every threshold at which a method changes its kernels.
const LENGTHS: [usize; 4] = [1, 4097, 8193, 1 << 14];

/// Pushes `x` unless it is there.
fn push_new<T: PartialEq>(all: &mut Vec<T>, x: T) {
    if !all.contains(&x) {
        all.push(x);
    }
}

/// Every forward kernel the methods launch at head dim `d`, first, then each rung in the
/// other shapes that fit: warpgroups × stages × blocks a multiprocessor, each in both grid
/// orders.
pub fn forward(d: usize) -> Vec<ForwardKernel> {
    let mut all = Vec::new();
    for t in LENGTHS {
        // in both block orders: which one runs depends on the batch and heads as well
        let s = Shape::new(1, 1, t, d);
        let launched = ForwardKernel::for_shape(s, 1);
        push_new(&mut all, launched);
        push_new(&mut all, launched.other_order());
        for rung in ForwardRung::ALL {
            push_new(&mut all, rung.shape(s, 1));
            push_new(&mut all, rung.shape(s, 1).other_order());
        }
    }
    for rung in ForwardRung::ALL {
        let shapes: &[(usize, usize, usize)] = match rung {
            ForwardRung::Wgmma => &[
                (1, 2, 2),
                (1, 2, 3),
                (1, 3, 2),
                (2, 2, 1),
                (3, 2, 1),
                (1, 2, 1),
            ],
            _ => &[(2, 2, 1), (3, 2, 1), (2, 3, 1)],
        };
        for &(warpgroups, stages, min_blocks) in shapes {
            // three warpgroups of 64 rows at head dim 128 spill (the output alone is 64
            // registers a thread, beside 64 of scores and 32 of P)
            if d == 128 && warpgroups == 3 {
                continue;
            }
            for longest_first in [true, false] {
                let k = ForwardKernel {
                    rung,
                    warpgroups,
                    stages,
                    min_blocks,
                    longest_first,
                };
                if k.check(d).is_ok() {
                    push_new(&mut all, k);
                }
            }
        }
    }
    all
}

/// Every backward the methods launch at head dim `d`, first, then the two passes with each
/// pass in its other shapes beside the other pass's default, and the one pass in two or
/// three stages; each in both grid orders.
pub fn backward(d: usize) -> Vec<BackwardKernels> {
    let mut all = Vec::new();
    for t in LENGTHS {
        for rung in [BackwardRung::TwoPasses, BackwardRung::OnePass] {
            let launched = BackwardKernels::rung(rung, Shape::new(1, 1, t, d));
            push_new(&mut all, launched);
            push_new(&mut all, launched.other_order());
        }
    }
    for longest_first in [true, false] {
        let two = BackwardKernels::two_passes(Shape::new(1, 1, 1, d));
        let two = if two.dkdv.longest_first == longest_first {
            two
        } else {
            two.other_order()
        };
        let kernel = |pass, warpgroups, stages, stream| BackwardKernel {
            pass,
            warpgroups,
            stages,
            stream,
            longest_first,
        };
        // (128 queries a step for dK and dV spill at head dim 64: Sᵀ and dPᵀ are 64
        // registers each)
        for (w, s, r) in [(2, 2, 64), (2, 3, 64), (3, 2, 64), (3, 3, 64), (1, 2, 64)] {
            let dkdv = kernel(BackwardPass::Dkdv, w, s, r);
            if dkdv.check(d).is_ok() {
                push_new(&mut all, BackwardKernels { dkdv, ..two });
            }
        }
        for (w, s, r) in [(2, 2, 128), (2, 3, 128), (2, 2, 64), (3, 2, 64)] {
            let dq = kernel(BackwardPass::Dq, w, s, r);
            if dq.check(d).is_ok() {
                push_new(
                    &mut all,
                    BackwardKernels {
                        dq: Some(dq),
                        ..two
                    },
                );
            }
        }
        for stages in [2, 3] {
            let dkdv = kernel(BackwardPass::OnePass, 2, stages, 64);
            if dkdv.check(d).is_ok() {
                push_new(&mut all, BackwardKernels { dkdv, dq: None });
            }
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use step06_hopper::kernel::HEAD_DIMS;

    /// What the methods launch is among the shapes compared, every shape fits, and no two
    /// share a name.
    #[test]
    fn the_defaults_are_among_the_shapes_and_every_name_is_its_own() {
        for d in HEAD_DIMS {
            let f = forward(d);
            let b = backward(d);
            for t in [1, 2048, 2049, 4096, 4097, 8192, 8193, 1 << 14, 1 << 20] {
                for s in [Shape::new(1, 1, t, d), Shape::new(16, 32, t, d)] {
                    assert!(f.contains(&ForwardKernel::for_shape(s, 8)), "{s}");
                    for rung in ForwardRung::ALL {
                        assert!(f.contains(&rung.shape(s, 8)), "{s} {rung:?}");
                    }
                    for rung in [BackwardRung::TwoPasses, BackwardRung::OnePass] {
                        assert!(
                            b.contains(&BackwardKernels::rung(rung, s)),
                            "{s} {rung:?}"
                        );
                    }
                }
            }
            assert!(f.iter().all(|k| k.check(d).is_ok()));
            assert!(b.iter().all(|k| k.kernels().all(|k| k.check(d).is_ok())));
            let names: std::collections::HashSet<_> = f.iter().map(|k| k.name()).collect();
            assert_eq!(
                names.len(),
                f.len(),
                "d{d}: two forward shapes share a name"
            );
            let names: std::collections::HashSet<_> = b.iter().map(|k| k.name()).collect();
            assert_eq!(
                names.len(),
                b.len(),
                "d{d}: two backward shapes share a name"
            );
        }
    }
}
