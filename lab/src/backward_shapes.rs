//! The tile shapes `backward-tune` times against step 04's kernels, one head dim at a time,
//! each one change of the kernels' shape (or of the shape before it at head dim 128). Step
//! 04's `flash_backward.cu` fixes its thread blocks as macros of the head dim (`WARPS`,
//! `M_TILES`, `DKDV_MIN_BLOCKS`, `DQ_MIN_BLOCKS`) and its streams and steps as constants
//! (`DKDV_STREAM`, `DQ_STREAM`, `DKDV_SUB`, `DQ_SUB`); a [`BackwardShape`] is those kernels
//! with other values, set by [`BackwardShapeKernel`] in step 04's source and launched by
//! step 04's [`backward_built`].

use std::borrow::Cow;

use cudarc::driver::CudaFunction;
use flash_core::AttnError;
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu, KernelSpec};
use step03_cuda_forward::kernel::TENSOR_CORES_CUH;
use step04_backward::cuda::{
    self, BackwardKernel, BackwardLaunch, DKDV_STREAM, DQ_STREAM, DeviceGrads,
    FLASH_BACKWARD_CU, backward_built,
};

use crate::patch::set_define;

/// The source the shapes patch.
const FILE: &str = "steps/04-backward/kernels/flash_backward.cu";

/// A tile shape of step 04's backward kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardShape {
    /// Warps per thread block (`WARPS`): 4 or 8.
    pub warps: usize,
    /// 16-row tiles of keys (dK/dV) or queries (dQ) per warp (`M_TILES`): 1 or 2.
    pub m_tiles: usize,
    /// The blocks of `backward_dkdv` each multiprocessor must fit (`DKDV_MIN_BLOCKS`, the
    /// register budget): 1 or 2.
    pub dkdv_min_blocks: usize,
    /// The blocks of `backward_dq` each multiprocessor must fit (`DQ_MIN_BLOCKS`): 1 or 2.
    pub dq_min_blocks: usize,
    /// Queries streamed past `backward_dkdv`'s keys per stage (`DKDV_STREAM`): 64 or 128.
    pub dkdv_stream: usize,
    /// Keys streamed past `backward_dq`'s queries per stage (`DQ_STREAM`): 64 or 128.
    pub dq_stream: usize,
    /// Queries per step of `backward_dkdv`'s inner loop (`DKDV_SUB`): 16 or 32.
    pub dkdv_sub: usize,
    /// Keys per step of `backward_dq`'s inner loop (`DQ_SUB`): 16, 32 or 64.
    pub dq_sub: usize,
}

impl BackwardShape {
    /// The shape step 04's kernels have at a head dim (the blocks a multiprocessor and the
    /// steps as `flash_backward.cu` fixes them; `lab-kernel-check` fails where this shape's
    /// build is not the kernels').
    pub fn kernels(head_dim: usize) -> Self {
        let blocks = if head_dim <= 64 { 2 } else { 1 };
        BackwardShape {
            warps: cuda::warps(head_dim),
            m_tiles: cuda::m_tiles(head_dim),
            dkdv_min_blocks: blocks,
            dq_min_blocks: blocks,
            dkdv_stream: DKDV_STREAM,
            dq_stream: DQ_STREAM,
            dkdv_sub: 16,
            dq_sub: 32,
        }
    }

    /// A short name for tables: `w<warps>x<m-tiles> s<dK/dV stream>/<dQ stream>
    /// sub<dK/dV step>/<dQ step>`, then the blocks a multiprocessor of each kernel where
    /// that caps its registers below 255 (`kb<dK/dV blocks>`, `b<dQ blocks>`).
    pub fn label(&self) -> String {
        let mut s = format!(
            "w{}x{} s{}/{} sub{}/{}",
            self.warps,
            self.m_tiles,
            self.dkdv_stream,
            self.dq_stream,
            self.dkdv_sub,
            self.dq_sub
        );
        let capped = |blocks: usize| blocks * self.threads() as usize > 256;
        if capped(self.dkdv_min_blocks) {
            s += &format!(" kb{}", self.dkdv_min_blocks);
        }
        if capped(self.dq_min_blocks) {
            s += &format!(" b{}", self.dq_min_blocks);
        }
        s
    }

    /// A line for reports: the blocks and streams of both kernels.
    pub fn describe(&self) -> String {
        let rows = self.block_rows();
        format!(
            "dK/dV per {rows} keys with {} queries a stage, dQ per {rows} queries with {} keys a stage, {} warps of {} rows",
            self.dkdv_stream,
            self.dq_stream,
            self.warps,
            self.m_tiles * 16
        )
    }

    /// Rows (keys or queries) per thread block (`BLOCK_ROWS` in the source).
    pub fn block_rows(&self) -> usize {
        self.warps * self.m_tiles * 16
    }

    /// Threads per block of `backward_dkdv` and `backward_dq`.
    pub fn threads(&self) -> u32 {
        (self.warps * 32) as u32
    }

    /// Whether the kernels can be compiled with this shape, or what is wrong with it.
    pub fn check(&self) -> Result<(), AttnError> {
        let ok = matches!(self.warps, 4 | 8)
            && matches!(self.m_tiles, 1 | 2)
            && matches!(self.dkdv_min_blocks, 1 | 2)
            && matches!(self.dq_min_blocks, 1 | 2)
            && matches!(self.dkdv_stream, 64 | 128)
            && matches!(self.dq_stream, 64 | 128)
            && matches!(self.dkdv_sub, 16 | 32)
            && matches!(self.dq_sub, 16 | 32 | 64);
        if ok {
            Ok(())
        } else {
            Err(AttnError::Unsupported {
                what: format!(
                    "{self:?}: warps must be 4 or 8, m_tiles 1 or 2, each kernel's blocks a multiprocessor 1 or 2, streams 64 or 128, dkdv_sub 16 or 32, dq_sub 16, 32 or 64"
                ),
            })
        }
    }

    /// How a build of this shape is launched at a head dim: its thread blocks, the shared
    /// memory of its streams (as step 04 sizes it for its own).
    pub fn launch(&self, head_dim: usize) -> BackwardLaunch {
        let rows = self.block_rows();
        BackwardLaunch {
            threads: self.threads(),
            block_rows: rows,
            dkdv_smem_bytes: ((2 * rows + 4 * self.dkdv_stream) * head_dim * 2
                + 4 * self.dkdv_stream * 4) as u32,
            dq_smem_bytes: ((2 * rows + 4 * self.dq_stream) * head_dim * 2) as u32,
        }
    }

    /// Step 04's kernels with this shape's thread blocks, streams and steps set.
    pub fn source(&self) -> Result<String, AttnError> {
        let mut source = FLASH_BACKWARD_CU.to_string();
        for (name, value) in [
            ("WARPS", self.warps),
            ("M_TILES", self.m_tiles),
            ("DKDV_MIN_BLOCKS", self.dkdv_min_blocks),
            ("DQ_MIN_BLOCKS", self.dq_min_blocks),
            ("DKDV_STREAM", self.dkdv_stream),
            ("DQ_STREAM", self.dq_stream),
            ("DKDV_SUB", self.dkdv_sub),
            ("DQ_SUB", self.dq_sub),
        ] {
            source = set_define(&source, FILE, name, value)?;
        }
        Ok(source)
    }
}

/// Step 04's causal backward kernels in a tile shape, for a dtype and head dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardShapeKernel {
    pub dtype: Dtype,
    pub head_dim: usize,
    pub shape: BackwardShape,
}

impl BackwardShapeKernel {
    /// The build of step 04 this one changes: its `-D` set and its checks.
    fn taught(&self) -> BackwardKernel {
        BackwardKernel::new(self.dtype, self.head_dim)
    }
}

impl KernelSpec for BackwardShapeKernel {
    fn name(&self) -> String {
        let (dtype, d) = (self.dtype.name(), self.head_dim);
        let label = self.shape.label().replace([' ', '/'], "_");
        format!("lab_flash_backward_{dtype}_d{d}_{label}.cu")
    }

    fn source(&self) -> Cow<'_, str> {
        // check() has made sure that the patch applies
        let kernels = self
            .shape
            .source()
            .expect("a shape checked before its source is asked for");
        [TENSOR_CORES_CUH, &kernels].concat().into()
    }

    fn defines(&self) -> Vec<String> {
        self.taught().defines()
    }

    /// The head dim, the shape, and a patch that applies to step 04's source.
    fn check(&self) -> Result<(), AttnError> {
        self.taught().check()?;
        self.shape.check()?;
        self.shape.source().map(|_| ())
    }
}

/// Step 04's [`backward`](step04_backward::cuda::backward) with the kernels in `shape`,
/// calling `mark` before the first launch and after each of the three (`backward-tune
/// --split` records an event there).
#[allow(clippy::too_many_arguments)]
pub fn backward_marked(
    gpu: &Gpu,
    shape: BackwardShape,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
    mark: &mut dyn FnMut() -> Result<(), AttnError>,
) -> Result<DeviceGrads, AttnError> {
    let head_dim = q.shape.head_dim;
    let build = BackwardShapeKernel {
        dtype: q.dtype,
        head_dim,
        shape,
    };
    let kernels = |entry: &str, smem| -> Result<CudaFunction, AttnError> {
        gpu.kernel(&build, entry, smem)
    };
    backward_built(
        gpu,
        shape.launch(head_dim),
        &kernels,
        q,
        k,
        v,
        fwd,
        dout,
        mark,
    )
}

/// [`backward_marked`] with nothing marked.
pub fn backward(
    gpu: &Gpu,
    shape: BackwardShape,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    backward_marked(gpu, shape, q, k, v, fwd, dout, &mut || Ok(()))
}

/// The kernels' shape for a head dim, then the shapes compared with it (what each measured
/// is in `lab/logs/04-backward/`; the variants that lost and left the kernels, in
/// `lab/notes/04-backward.md`).
pub fn candidates(head_dim: usize) -> Vec<BackwardShape> {
    let base = BackwardShape::kernels(head_dim);
    if head_dim <= 64 {
        vec![
            base,
            BackwardShape {
                dkdv_stream: 64,
                ..base
            },
            BackwardShape {
                dq_stream: 128,
                ..base
            },
            // wider steps: more scores in registers at once (both spill)
            BackwardShape {
                dkdv_sub: 32,
                ..base
            },
            BackwardShape { dq_sub: 64, ..base },
        ]
    } else {
        // the shapes measured beside 64 queries a stage for dK/dV, the default before run 6
        let old = BackwardShape {
            dkdv_stream: 64,
            ..base
        };
        // 64-row blocks of four warps, two blocks a multiprocessor
        let four_warps = |shape| BackwardShape {
            warps: 4,
            dkdv_min_blocks: 2,
            dq_min_blocks: 2,
            ..shape
        };
        vec![
            base,
            old,
            BackwardShape {
                dq_stream: 128,
                ..old
            },
            BackwardShape { dq_sub: 16, ..old },
            BackwardShape { dq_sub: 64, ..old },
            four_warps(old),
            four_warps(base),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use step04_backward::cuda::HEAD_DIMS;

    /// The kernels' shape comes first (the tool's first column) and is launched as step
    /// 04 launches its own, every shape is one the kernels take and whose patch applies,
    /// and no two share a label.
    #[test]
    fn the_kernels_shape_first_every_shape_valid_no_label_twice() {
        for d in HEAD_DIMS {
            let all = candidates(d);
            assert_eq!(all[0], BackwardShape::kernels(d));
            assert_eq!(all[0].launch(d), BackwardLaunch::for_head_dim(d));
            for c in &all {
                c.check().unwrap();
                c.source().unwrap();
            }
            let mut labels: Vec<String> = all.iter().map(BackwardShape::label).collect();
            labels.sort();
            labels.dedup();
            assert_eq!(
                labels.len(),
                all.len(),
                "head dim {d}: two shapes share a label"
            );
        }
    }
}
