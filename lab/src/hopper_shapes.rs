//! The block shapes `hopper-check` compares for step 06's kernels: every rung of the
//! forward and both of the backward, in the shapes the step's methods launch and the others
//! that fit. The step's `kernel` module picks one per length; these are what the picks were
//! made among. The forward's buffers of keys and values are `forward.cuh`'s own (`STAGES`);
//! a [`HopperForward`] sets them in its source ([`HopperForwardBuild`]) and runs through
//! step 06's [`forward_built`].

use std::borrow::Cow;

use flash_core::{AttnError, Shape};
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu, KernelSpec};
use step06_hopper::forward::forward_built;
use step06_hopper::kernel::{
    BLOCK_N, BackwardKernel, BackwardKernels, BackwardPass, BackwardRung, Build,
    ForwardKernel, ForwardRung, SMEM_PER_SM, STAGES,
};
use step06_hopper::layout::TmaRank;

use crate::patch::set_define;

/// A forward kernel of step 06 with `stages` buffers of keys and values in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HopperForward {
    pub kernel: ForwardKernel,
    /// Buffers of keys and values in flight (`STAGES`).
    pub stages: usize,
}

impl HopperForward {
    /// The kernel as step 06 builds it.
    pub fn of(kernel: ForwardKernel) -> Self {
        HopperForward {
            kernel,
            stages: STAGES,
        }
    }

    /// As [`ForwardKernel::name`]: the rung, warpgroups × stages × blocks a multiprocessor,
    /// and "longest first".
    pub fn name(&self) -> String {
        let k = self.kernel;
        format!(
            "rung {} {}x{}x{}{}",
            k.rung.number(),
            k.warpgroups,
            self.stages,
            k.min_blocks,
            if k.longest_first {
                " longest first"
            } else {
                ""
            }
        )
    }

    /// As [`ForwardKernel::smem_bytes`], with `stages` tiles of k and v.
    pub fn smem_bytes(&self, d: usize) -> u32 {
        ((self.kernel.block_m() + 2 * self.stages * BLOCK_N) * d * 2 + 1024) as u32
    }

    /// Step 06's limits, and the shared memory of `stages` buffers.
    pub fn check(&self, d: usize) -> Result<(), AttnError> {
        self.kernel.check(d)?;
        let smem = self.smem_bytes(d) as usize;
        if self.stages < 2 || self.kernel.min_blocks * (smem + 1024) > SMEM_PER_SM {
            return Err(AttnError::Unsupported {
                what: format!(
                    "the Hopper forward {}: 2 or more stages, {smem} bytes of shared memory a block at head dim {d} in {} blocks a multiprocessor, at most {SMEM_PER_SM} bytes",
                    self.name(),
                    self.kernel.min_blocks
                ),
            });
        }
        Ok(())
    }

    /// This shape for a dtype, a head dim and a rank of the tensor maps: what is compiled.
    pub fn build(self, dtype: Dtype, head_dim: usize, rank: TmaRank) -> HopperForwardBuild {
        HopperForwardBuild {
            shape: self,
            build: self.kernel.build(dtype, head_dim, rank),
        }
    }
}

/// A [`HopperForward`] compiled: step 06's build with its `STAGES` set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HopperForwardBuild {
    pub shape: HopperForward,
    pub build: Build<ForwardKernel>,
}

impl HopperForwardBuild {
    fn patched(&self) -> Result<String, AttnError> {
        let file = "steps/06-hopper/kernels/forward.cuh";
        set_define(&self.build.source(), file, "STAGES", self.shape.stages)
    }
}

impl KernelSpec for HopperForwardBuild {
    fn name(&self) -> String {
        let name = self.build.name();
        let (kernel, shape) = (self.shape.kernel.name(), self.shape.name());
        let (kernel, shape) = (kernel.replace(' ', "_"), shape.replace(' ', "_"));
        format!("lab_{}", name.replace(&kernel, &shape))
    }

    fn source(&self) -> Cow<'_, str> {
        // check() has made sure that the patch applies
        self.patched()
            .expect("a build checked before its source is asked for")
            .into()
    }

    fn defines(&self) -> Vec<String> {
        self.build.defines()
    }

    fn check(&self) -> Result<(), AttnError> {
        self.shape.check(self.build.head_dim)?;
        self.patched().map(|_| ())
    }

    fn arch(&self, device: &'static str) -> &'static str {
        self.build.arch(device)
    }
}

/// Step 06's [`forward_with`](step06_hopper::forward::forward_with) with the kernel in
/// `shape`.
pub fn run_forward(
    gpu: &Gpu,
    shape: HopperForward,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    result: &mut DeviceAttention,
) -> Result<(), AttnError> {
    let build = |dtype, d, rank| {
        let smem = shape.smem_bytes(d);
        let f = gpu.kernel(&shape.build(dtype, d, rank), "hopper_forward", smem)?;
        Ok((f, smem))
    };
    forward_built(gpu, shape.kernel, &build, q, k, v, result)
}

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
pub fn forward(d: usize) -> Vec<HopperForward> {
    let mut all = Vec::new();
    for t in LENGTHS {
        // in both block orders: which one runs depends on the batch and heads as well
        let s = Shape::new(1, 1, t, d);
        let launched = ForwardKernel::for_shape(s, 1);
        for k in [launched, launched.other_order()] {
            push_new(&mut all, HopperForward::of(k));
        }
        for rung in ForwardRung::ALL {
            for k in [rung.shape(s, 1), rung.shape(s, 1).other_order()] {
                push_new(&mut all, HopperForward::of(k));
            }
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
                let kernel = ForwardKernel {
                    rung,
                    warpgroups,
                    min_blocks,
                    longest_first,
                };
                let k = HopperForward { kernel, stages };
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
                    let launched = HopperForward::of(ForwardKernel::for_shape(s, 8));
                    assert!(f.contains(&launched), "{s}");
                    assert_eq!(launched.name(), launched.kernel.name());
                    for rung in ForwardRung::ALL {
                        let k = HopperForward::of(rung.shape(s, 8));
                        assert!(f.contains(&k), "{s} {rung:?}");
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
