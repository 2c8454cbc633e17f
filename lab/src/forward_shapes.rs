//! The tile shapes `forward-tune` times against step 03's kernel, one head dim at a time.
//! Step 03's `flash_forward.cu` fixes its tile as macros of the head dim (`WARPS`,
//! `M_TILES`, `BLOCK_N`, `SUB_N`, `MIN_BLOCKS`) and puts every head's longest query blocks
//! first; a [`ForwardShape`] is that kernel with other values, compiled from step 03's
//! source with those lines set ([`ForwardShapeKernel`]) and launched by step 03's
//! [`Gpu::forward_built`]. Whether a lane holds one ldmatrix offset a step or one an
//! operand is the head dim's (one an operand at 128: `Offsets<HEAD_DIM == 128>` in
//! `flash_forward.cu`), not a shape's.

use std::borrow::Cow;

use flash_core::AttnError;

use crate::patch::{replace_once, set_define};
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu, KernelSpec};
use step03_cuda_forward::kernel::{
    self, FLASH_FORWARD, FLASH_FORWARD_CU, ForwardKernel, ForwardLaunch,
};

/// A tile shape of step 03's forward kernel: the sizes that may change without changing
/// what it computes (other sizes sum in another order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardShape {
    /// Warps per thread block (`WARPS`).
    pub warps: u32,
    /// 16-row tiles of queries per warp (`M_TILES`): each fragment of k and v read from
    /// shared memory serves this many tiles.
    pub m_tiles: u32,
    /// Keys per block, copied into shared memory together (`BLOCK_N`).
    pub block_n: u32,
    /// Keys per step of the products and the softmax within a block of `block_n` (`SUB_N`),
    /// a multiple of 16 that divides `block_n`; 0 for all of them at once.
    pub sub_n: u32,
    /// Heads whose blocks are scheduled together, longest query blocks first; 0 for all
    /// heads (the kernel's order). Fewer keeps fewer heads' keys and values in flight.
    pub head_group: u32,
    /// Thread blocks per multiprocessor the register budget must allow (`MIN_BLOCKS`, in
    /// `__launch_bounds__`).
    pub min_blocks: u32,
}

impl ForwardShape {
    /// The shape step 03's kernel has at a head dim.
    pub fn kernel(head_dim: usize) -> Self {
        let (block_n, sub_n) = (kernel::block_n(head_dim), kernel::sub_n(head_dim));
        ForwardShape {
            warps: kernel::WARPS,
            m_tiles: kernel::M_TILES,
            block_n: block_n as u32,
            sub_n: if sub_n == block_n { 0 } else { sub_n as u32 },
            head_group: 0,
            min_blocks: 1,
        }
    }

    /// A short name for tables: `w<warps>x<m-tiles> n<keys per block>` and what else is
    /// set.
    pub fn label(&self) -> String {
        let mut s = format!("w{}x{} n{}", self.warps, self.m_tiles, self.block_n);
        if self.sub_n != 0 && self.sub_n != self.block_n {
            s += &format!(" sub{}", self.sub_n);
        }
        if self.head_group != 0 {
            s += &format!(" g{}", self.head_group);
        }
        if self.min_blocks != 1 {
            s += &format!(" b{}", self.min_blocks);
        }
        s
    }

    /// Keys per step of the products and the softmax (`SUB_N` in the source).
    pub fn keys_per_step(&self) -> u32 {
        match self.sub_n {
            0 => self.block_n,
            n => n,
        }
    }

    /// Whether the kernel can be compiled with this shape, or what is wrong with it.
    pub fn check(&self) -> Result<(), AttnError> {
        let n = self.keys_per_step();
        let ok = matches!(self.warps, 1..=16)
            && matches!(self.m_tiles, 1..=4)
            && self.block_n.is_multiple_of(16)
            && n.is_multiple_of(16)
            && (16..=self.block_n).contains(&n)
            && self.block_n.is_multiple_of(n)
            && matches!(self.min_blocks, 1..=8);
        if ok {
            Ok(())
        } else {
            Err(AttnError::Unsupported {
                what: format!(
                    "{self:?}: the forward kernel takes 1-16 warps of 1-4 tiles of 16 rows, a multiple of 16 keys a block, steps of a multiple of 16 keys that divide it, 1-8 blocks a multiprocessor"
                ),
            })
        }
    }

    /// How a build of this shape is launched at a head dim: `warps` warps, `warps` ×
    /// `m_tiles` × 16 queries a block, a tile of q and two stages each of k and v.
    pub fn launch(&self, head_dim: usize) -> ForwardLaunch {
        let block_m = (self.warps * self.m_tiles) as usize * 16;
        ForwardLaunch {
            threads: self.warps * 32,
            block_m,
            smem_bytes: ((block_m + 4 * self.block_n as usize) * head_dim * 2) as u32,
        }
    }

    /// Step 03's source with this shape's tile: each size's `#define` line set to its
    /// value, and with a group of heads, the block order grouped.
    pub fn source(&self) -> Result<String, AttnError> {
        let mut source = FLASH_FORWARD_CU.to_string();
        for (name, value) in [
            ("WARPS", self.warps),
            ("M_TILES", self.m_tiles),
            ("BLOCK_N", self.block_n),
            ("SUB_N", self.keys_per_step()),
            ("MIN_BLOCKS", self.min_blocks),
        ] {
            source = set_define(&source, FILE, name, value)?;
        }
        if self.head_group != 0 {
            let grouped = grouped_order(self.head_group);
            source = replace_once(&source, FILE, BLOCK_ORDER, &grouped)?;
        }
        Ok(source)
    }
}

/// The source the shapes patch.
const FILE: &str = "steps/03-cuda-forward/kernels/flash_forward.cu";

/// The kernel's block order: every head's blocks, longest first.
const BLOCK_ORDER: &str = "    const int bh = blockIdx.x % heads;
    const int q_block = q_blocks - 1 - blockIdx.x / heads;
";

/// The block order in groups of `group` heads, each group's longest blocks first.
fn grouped_order(group: u32) -> String {
    format!(
        "    const int head_group = min({group}, heads);
    const int group = blockIdx.x / (q_blocks * head_group);
    const int in_group = blockIdx.x - group * (q_blocks * head_group);
    const int group_heads = min(head_group, heads - group * head_group);
    const int bh = group * head_group + in_group % group_heads;
    const int q_block = q_blocks - 1 - in_group / group_heads;
"
    )
}

/// Step 03's causal forward kernel in a tile shape, for a dtype and head dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardShapeKernel {
    pub dtype: Dtype,
    pub head_dim: usize,
    pub shape: ForwardShape,
}

impl ForwardShapeKernel {
    /// The build of step 03 this one changes: its name and `-D` set.
    fn taught(&self) -> ForwardKernel {
        ForwardKernel::new(self.dtype, self.head_dim)
    }
}

impl KernelSpec for ForwardShapeKernel {
    fn name(&self) -> String {
        let taught = self.taught().name();
        let stem = taught.strip_suffix(".cu").unwrap_or(&taught);
        format!("{stem}_{}.cu", self.shape.label().replace(' ', "_"))
    }

    fn source(&self) -> Cow<'_, str> {
        // check() has made sure that the patch applies
        self.shape
            .source()
            .expect("a shape checked before its source is asked for")
            .into()
    }

    fn defines(&self) -> Vec<String> {
        self.taught().defines()
    }

    /// The head dim, the shape, and a patch that applies to step 03's source.
    fn check(&self) -> Result<(), AttnError> {
        self.taught().check()?;
        self.shape.check()?;
        self.shape.source().map(|_| ())
    }
}

/// Step 03's [`Gpu::forward_into`] with the kernel in `shape`.
pub fn forward(
    gpu: &Gpu,
    shape: ForwardShape,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    result: &mut DeviceAttention,
) -> Result<(), AttnError> {
    let head_dim = q.shape.head_dim;
    let launch = shape.launch(head_dim);
    let build = ForwardShapeKernel {
        dtype: q.dtype,
        head_dim,
        shape,
    };
    let f = gpu.kernel(&build, FLASH_FORWARD, launch.smem_bytes)?;
    gpu.forward_built(&f, launch, q, k, v, result)
}

/// The kernel's shape for a head dim, then the shapes compared with it (what each measured
/// is in `lab/logs/03-cuda-forward/`; the variants that lost and left the kernel, in
/// `lab/notes/03-cuda-forward.md`).
pub fn candidates(head_dim: usize) -> Vec<ForwardShape> {
    let base = ForwardShape::kernel(head_dim);
    let with = |f: fn(&mut ForwardShape)| {
        let mut c = base;
        f(&mut c);
        c
    };
    if head_dim <= 64 {
        vec![
            base,
            // one head at a time, or 16 together, rather than all heads' longest blocks
            // first
            with(|c| c.head_group = 1),
            with(|c| c.head_group = 16),
            // 64 keys a block
            with(|c| c.block_n = 64),
            // 8 warps of 32 rows: 256 queries a block
            with(|c| c.warps = 8),
        ]
    } else {
        vec![
            base,
            // 8 warps of 16 rows, the shape before run 14, with 64 or 128 keys at once
            with(|c| (c.warps, c.m_tiles, c.sub_n) = (8, 1, 0)),
            with(|c| (c.warps, c.m_tiles, c.block_n, c.sub_n) = (8, 1, 128, 0)),
            // 32 keys a block; 64 in steps of 16; all 64 at once (FlashAttention-2's loop,
            // which spills)
            with(|c| (c.block_n, c.sub_n) = (32, 0)),
            with(|c| c.sub_n = 16),
            with(|c| c.sub_n = 0),
            // 64 x 64 tiles, two blocks a multiprocessor (FlashAttention-2's causal tile on
            // sm86 and sm89)
            with(|c| (c.m_tiles, c.sub_n, c.min_blocks) = (1, 0, 2)),
            // at head dim 128 a head's keys and values are 8 MB at 16k tokens: fewer heads
            // scheduled together keep fewer of them in flight, for L2's 60 MB
            with(|c| c.head_group = 2),
            with(|c| c.head_group = 4),
            with(|c| c.head_group = 8),
            with(|c| c.head_group = 12),
            with(|c| (c.sub_n, c.head_group) = (0, 2)),
            with(|c| (c.sub_n, c.head_group) = (0, 8)),
            with(|c| (c.sub_n, c.head_group) = (0, 12)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use step03_cuda_forward::kernel::HEAD_DIMS;

    /// The kernel's shape comes first (the tools' first column), every shape is one the
    /// kernel takes and whose patch applies to step 03's source, and no two share a label
    /// (the tools' `--only` picks them by it).
    #[test]
    fn the_kernels_shape_first_every_shape_valid_no_label_twice() {
        for d in HEAD_DIMS {
            let all = candidates(d);
            assert_eq!(all[0], ForwardShape::kernel(d));
            assert_eq!(all[0].launch(d), ForwardLaunch::for_head_dim(d));
            let mut labels: Vec<String> = all.iter().map(ForwardShape::label).collect();
            for c in &all {
                c.check().unwrap();
                c.source().unwrap();
            }
            labels.sort();
            labels.dedup();
            assert_eq!(
                labels.len(),
                all.len(),
                "head dim {d}: two shapes share a label"
            );
        }
    }

    /// A shape's source is step 03's with its sizes' lines set, and a group of heads
    /// changes the block order.
    #[test]
    fn a_shape_sets_the_sizes_lines_and_groups_the_heads() {
        let shape = ForwardShape {
            warps: 8,
            head_group: 2,
            ..ForwardShape::kernel(64)
        };
        let source = shape.source().unwrap();
        assert!(source.contains("\n#define WARPS 8\n"));
        assert!(!FLASH_FORWARD_CU.contains("\n#define WARPS 8\n"));
        assert!(
            source.contains("head_group = min(2, heads);") && !source.contains(BLOCK_ORDER)
        );
    }
}
