//! The kernels' typed descriptions: each kernel this step launches is one value of
//! [`ForwardKernel`] or [`BackwardKernel`], which says which source it is, the `-D` set it
//! is compiled with, its name, and what it needs of the GPU. The `.cu` files hold no
//! defaults: a parameter left out of the `-D` set is a compile error, so nothing here can
//! disagree with them. What no shape changes is the kernels' own: the forward's keys a step
//! and buffers in flight are `forward.cuh`'s ([`BLOCK_N`], [`STAGES`], which a test reads
//! there).
//!
//! The forward is a ladder of four rungs ([`ForwardRung`]), each a whole kernel in a file
//! of its own, each adding one idea to the one before; the backward two ([`BackwardRung`]).

use std::borrow::Cow;

use flash_core::{AttnError, Shape};
use step03_cuda_forward::gpu::{Dtype, KernelSpec};

use crate::layout::TmaRank;

/// What every kernel shares: types, descriptors, mbarriers, TMA copies, the products.
pub const HOPPER_CUH: &str = include_str!("../kernels/hopper.cuh");
/// What the forward's rungs share: the softmax, the mask, the block's place, the end.
pub const FORWARD_CUH: &str = include_str!("../kernels/forward.cuh");
/// What the backward's kernels share: the producer's loop, Pᵀ and dSᵀ, δ.
pub const BACKWARD_CUH: &str = include_str!("../kernels/backward.cuh");

/// The head dims the kernels are compiled for: a row of 64 is one 128-byte swizzle row, a
/// row of 128 two halves of one each.
pub const HEAD_DIMS: [usize; 2] = [64, 128];
/// Keys per step of the forward (`BLOCK_N` in `forward.cuh`).
pub const BLOCK_N: usize = 128;
/// Buffers of keys and values in flight in the forward (`STAGES` in `forward.cuh`): the
/// producer copies the next block while the consumers compute on this one.
pub const STAGES: usize = 2;

/// A multiprocessor's shared memory on sm_90, and the most one thread block may take.
pub const SMEM_PER_SM: usize = 228 * 1024;
pub const SMEM_PER_BLOCK: usize = 227 * 1024;

/// The forward's rungs, each a kernel of its own (`kernels/forward_N_*.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ForwardRung {
    /// TMA copies by a producer warp into stages behind mbarriers, `wgmma` products by
    /// consumer warpgroups, P from registers.
    Wgmma,
    /// A producer warpgroup that hands its registers to the consumers (`setmaxnreg`).
    ProducerWarpgroup,
    /// The consumer warpgroups take turns at the tensor cores.
    Turns,
    /// Each warpgroup's softmax beside its own products; the keys and the values with
    /// barriers of their own.
    Overlap,
}

impl ForwardRung {
    /// Every rung, in the order of the ladder.
    pub const ALL: [ForwardRung; 4] = [
        ForwardRung::Wgmma,
        ForwardRung::ProducerWarpgroup,
        ForwardRung::Turns,
        ForwardRung::Overlap,
    ];

    /// 1 to 4.
    pub fn number(self) -> usize {
        self as usize + 1
    }

    /// The kernel's file, under the crate's folder.
    pub fn file(self) -> &'static str {
        match self {
            ForwardRung::Wgmma => "kernels/forward_1_wgmma.cu",
            ForwardRung::ProducerWarpgroup => "kernels/forward_2_producer_warpgroup.cu",
            ForwardRung::Turns => "kernels/forward_3_turns.cu",
            ForwardRung::Overlap => "kernels/forward_4_overlap.cu",
        }
    }

    fn source(self) -> &'static str {
        match self {
            ForwardRung::Wgmma => include_str!("../kernels/forward_1_wgmma.cu"),
            ForwardRung::ProducerWarpgroup => {
                include_str!("../kernels/forward_2_producer_warpgroup.cu")
            }
            ForwardRung::Turns => include_str!("../kernels/forward_3_turns.cu"),
            ForwardRung::Overlap => include_str!("../kernels/forward_4_overlap.cu"),
        }
    }

    /// The method the registry lists the rung under.
    pub fn method(self) -> &'static str {
        match self {
            ForwardRung::Wgmma => "hopper_wgmma",
            ForwardRung::ProducerWarpgroup => "hopper_producer_warpgroup",
            ForwardRung::Turns => "hopper_turns",
            ForwardRung::Overlap => "hopper_overlap",
        }
    }

    /// What the rung adds, in a line.
    pub fn about(self) -> &'static str {
        match self {
            ForwardRung::Wgmma => {
                "Hopper rung 1: TMA copies by a producer warp, wgmma products by consumer warpgroups, P from registers"
            }
            ForwardRung::ProducerWarpgroup => {
                "Hopper rung 2: rung 1 with a producer warpgroup that hands its registers to the consumers (setmaxnreg)"
            }
            ForwardRung::Turns => {
                "Hopper rung 3: rung 2 with the consumer warpgroups taking turns at the tensor cores"
            }
            ForwardRung::Overlap => {
                "Hopper rung 4: rung 3 with each warpgroup's softmax beside its own products"
            }
        }
    }

    /// The rung with this method name.
    pub fn by_method(name: &str) -> Option<ForwardRung> {
        ForwardRung::ALL.into_iter().find(|r| r.method() == name)
    }

    fn producer_warpgroup(self) -> bool {
        self != ForwardRung::Wgmma
    }

    /// This rung's block shape for queries of shape `q` and `kv_heads` heads of k and v:
    /// with a producer warp, one warpgroup of 64 rows and three blocks to a multiprocessor
    /// taking turns at its tensor cores at head dim 64, two warpgroups at 128; with a
    /// producer warpgroup, three warpgroups sharing each block of keys and values among 192
    /// rows at head dim 64, two at 128. Every head's longest blocks first while the keys and
    /// values of the whole call fit in L2 ([`longest_first`]).
    pub fn shape(self, q: Shape, kv_heads: usize) -> ForwardKernel {
        let (warpgroups, min_blocks) = match (self, q.head_dim) {
            (ForwardRung::Wgmma, 64) => (1, 3),
            (ForwardRung::Wgmma, _) => (2, 1),
            (_, 64) => (3, 1),
            (_, _) => (2, 1),
        };
        // k and v, 16 bits a value
        let longest_first = longest_first(4 * q.batch * kv_heads * q.tokens * q.head_dim);
        ForwardKernel {
            rung: self,
            warpgroups,
            min_blocks,
            longest_first,
        }
    }
}

// ANCHOR: longest_first
/// The H200's L2 cache: 50 MiB.
pub const L2_BYTES: usize = 50 << 20;

/// Whether a launch runs every head's longest blocks first, given the bytes of the operand
/// its blocks stream (k and v in the forward; q and dO in the backward), over the whole
/// call. Longest first spreads a head's blocks over the whole run, and they share what they
/// stream only through the L2 cache: the order pays while all of it fits there (one head
/// after another otherwise keeps a few heads' worth in flight). At 4 × 12 heads that is up
/// to 4,096 tokens at head dim 64 and 2,048 at 128; at 32 heads of 1,024 tokens, 16
/// sequences, never. The lab's notes have both orders measured.
pub fn longest_first(streamed_bytes: usize) -> bool {
    streamed_bytes <= L2_BYTES
}
// ANCHOR_END: longest_first

/// One forward kernel: a rung in one block shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardKernel {
    pub rung: ForwardRung,
    /// Consumer warpgroups per thread block (`WGS`), 64 query rows each.
    pub warpgroups: usize,
    /// Thread blocks each multiprocessor must fit (`MIN_BLOCKS`, the register budget); 1
    /// with a producer warpgroup, whose registers go to its own block's consumers.
    pub min_blocks: usize,
    /// The grid as (heads, query blocks), every head's longest block before any head's next
    /// longest, rather than (query blocks, heads) (`LONGEST_FIRST`).
    pub longest_first: bool,
}

impl ForwardKernel {
    /// What `cuda_hopper` runs for queries of shape `q` and `kv_heads` heads of k and v:
    /// rung 1 at head dim 64 up to 4,096 tokens, where a launch is a few waves and small
    /// blocks fill them; rung 4 beyond, and at head dim 128.
    pub fn for_shape(q: Shape, kv_heads: usize) -> Self {
        let rung = if q.head_dim == 64 && q.tokens <= 4096 {
            ForwardRung::Wgmma
        } else {
            ForwardRung::Overlap
        };
        rung.shape(q, kv_heads)
    }

    /// The same kernel with the other block order: the lab's comparisons and the checks
    /// that every kernel the methods may launch compiles.
    pub fn other_order(self) -> Self {
        ForwardKernel {
            longest_first: !self.longest_first,
            ..self
        }
    }

    /// Queries per thread block (`BLOCK_M`).
    pub fn block_m(&self) -> usize {
        64 * self.warpgroups
    }

    /// Threads per block: the consumer warpgroups and a producer warp (or warpgroup).
    pub fn threads(&self) -> u32 {
        let producer = if self.rung.producer_warpgroup() {
            128
        } else {
            32
        };
        (128 * self.warpgroups + producer) as u32
    }

    /// Dynamic shared memory at head dim `d`: q's tile and [`STAGES`] tiles of k and v,
    /// and room to align them on the swizzle's 1,024 bytes.
    pub fn smem_bytes(&self, d: usize) -> u32 {
        ((self.block_m() + 2 * STAGES * BLOCK_N) * d * 2 + 1024) as u32
    }

    /// The registers a producer warpgroup keeps and each consumer thread may take, where
    /// the rung has one.
    fn registers(&self) -> Option<(u32, u32)> {
        self.rung.producer_warpgroup().then(|| {
            producer_consumer_registers(
                self.warpgroups,
                producer_registers(self.warpgroups),
            )
        })
    }

    /// That the GPU can run this kernel at head dim `d`: its shared memory, `min_blocks`
    /// blocks a multiprocessor, what the rung needs; an error that names the limit
    /// otherwise.
    pub fn check(&self, d: usize) -> Result<(), AttnError> {
        let name = self.name();
        let smem = self.smem_bytes(d) as usize;
        let unsupported = |why: String| {
            Err(AttnError::Unsupported {
                what: format!("the Hopper forward {name}: {why}"),
            })
        };
        if !HEAD_DIMS.contains(&d) {
            return unsupported(format!("head dim {d}; it takes 64 and 128"));
        }
        if !(1..=3).contains(&self.warpgroups) || self.min_blocks < 1 {
            return unsupported(
                "1 to 3 warpgroups, 1 or more blocks a multiprocessor".into(),
            );
        }
        if smem > SMEM_PER_BLOCK || self.min_blocks * (smem + 1024) > SMEM_PER_SM {
            return unsupported(format!(
                "{smem} bytes of shared memory a block at head dim {d}, {} blocks a multiprocessor: more than its {SMEM_PER_SM} bytes (at most {SMEM_PER_BLOCK} a block)",
                self.min_blocks
            ));
        }
        if self.rung.producer_warpgroup() && self.min_blocks != 1 {
            return unsupported(
                "a producer warpgroup's registers go to one block a multiprocessor".into(),
            );
        }
        if matches!(self.rung, ForwardRung::Turns | ForwardRung::Overlap)
            && self.warpgroups < 2
        {
            return unsupported("turns take two or more warpgroups".into());
        }
        Ok(())
    }

    /// A short name for tables and compiled modules: the rung, warpgroups × stages × blocks
    /// a multiprocessor, and "longest first".
    pub fn name(&self) -> String {
        format!(
            "rung {} {}x{STAGES}x{}{}",
            self.rung.number(),
            self.warpgroups,
            self.min_blocks,
            if self.longest_first {
                " longest first"
            } else {
                ""
            }
        )
    }

    /// The `-D` set the kernel is compiled with.
    pub fn defines(&self, dtype: Dtype, d: usize, rank: TmaRank) -> Vec<String> {
        let mut defines = common_defines(dtype, d, rank);
        defines.extend([
            format!("-DWGS={}", self.warpgroups),
            format!("-DMIN_BLOCKS={}", self.min_blocks),
            format!("-DTHREADS={}", self.threads()),
            format!("-DLONGEST_FIRST={}", self.longest_first as u8),
        ]);
        if let Some((producer, consumer)) = self.registers() {
            defines.push(format!("-DPRODUCER_REGS={producer}"));
            defines.push(format!("-DCONSUMER_REGS={consumer}"));
        }
        defines
    }

    /// This kernel for a dtype, a head dim and a rank of the tensor maps: what is
    /// compiled.
    pub fn build(self, dtype: Dtype, head_dim: usize, rank: TmaRank) -> Build<Self> {
        Build {
            kernel: self,
            dtype,
            head_dim,
            rank,
        }
    }

    /// The grid of a launch for `shape`: one block per `block_m` queries of each head of
    /// each sequence; an error where the y dimension would pass its 65,535.
    pub fn grid(&self, shape: Shape) -> Result<(u32, u32, u32), AttnError> {
        ordered_grid(
            shape,
            self.block_m(),
            self.longest_first,
            &format!("forward {}", self.name()),
            "blocks of queries",
        )
    }

    /// The registers the kernel's producer and consumers end with, checked against what the
    /// compiled kernel starts with (`f`'s register count, which ptxas sets from the launch
    /// bounds), before a launch.
    pub fn check_registers(
        &self,
        f: &cudarc::driver::CudaFunction,
    ) -> Result<(), AttnError> {
        match self.registers() {
            Some(r) => {
                check_register_pool(f, self.warpgroups, r, self.threads(), "hopper_forward")
            }
            None => Ok(()),
        }
    }
}

/// The backward's rungs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackwardRung {
    /// Step 04's two passes: dK and dV a block of keys at a time, then dQ a block of
    /// queries at a time (`kernels/backward_1_dkdv.cu`, `kernels/backward_1_dq.cu`); each
    /// block writes only its own rows, the same bits every run.
    TwoPasses,
    /// One pass: the dK and dV pass adds each block's part of dQ into f32 sums, by a warp
    /// of its own (`kernels/backward_2_one_pass.cu`).
    OnePass,
}

/// Which kernel a backward launch is: rung 1's two passes, or rung 2's one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackwardPass {
    /// Rung 1's first pass: dK and dV.
    Dkdv,
    /// Rung 1's second pass: dQ.
    Dq,
    /// Rung 2: dK, dV and dQ's f32 sums.
    OnePass,
}

impl BackwardPass {
    /// The kernel's file, under the crate's folder.
    pub fn file(self) -> &'static str {
        match self {
            BackwardPass::Dkdv => "kernels/backward_1_dkdv.cu",
            BackwardPass::Dq => "kernels/backward_1_dq.cu",
            BackwardPass::OnePass => "kernels/backward_2_one_pass.cu",
        }
    }

    /// The kernel's source (after [`HOPPER_CUH`] and [`BACKWARD_CUH`]).
    pub fn source(self) -> &'static str {
        match self {
            BackwardPass::Dkdv => include_str!("../kernels/backward_1_dkdv.cu"),
            BackwardPass::Dq => include_str!("../kernels/backward_1_dq.cu"),
            BackwardPass::OnePass => include_str!("../kernels/backward_2_one_pass.cu"),
        }
    }

    /// The kernel's entry point (and the module's δ, `hopper_delta`, and with one pass
    /// `hopper_dq_convert`).
    pub fn entry(self) -> &'static str {
        match self {
            BackwardPass::Dq => "hopper_dq",
            _ => "hopper_dkdv",
        }
    }
}

/// One backward kernel in one block shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardKernel {
    pub pass: BackwardPass,
    /// Consumer warpgroups per block (`WGS`), 64 rows each: keys (dK and dV), queries (dQ).
    pub warpgroups: usize,
    /// Buffers of the streamed tiles in flight (`STAGES`).
    pub stages: usize,
    /// Rows streamed past the block per step (`STREAM`): queries (dK and dV), keys (dQ).
    pub stream: usize,
    /// The grid (heads, blocks) rather than (blocks, heads) (`LONGEST_FIRST`).
    pub longest_first: bool,
}

impl BackwardKernel {
    /// Rows per block: keys (dK and dV) or queries (dQ).
    pub fn block_rows(&self) -> usize {
        64 * self.warpgroups
    }

    /// Threads per block: the consumer warpgroups and a producer warpgroup.
    pub fn threads(&self) -> u32 {
        (128 * self.warpgroups + 128) as u32
    }

    /// With one pass, the buffers of a block's dQ in shared memory: two at head dim 64, one
    /// at 128 (which leaves room for a third stage).
    pub fn dq_buffers(&self, d: usize) -> usize {
        match (self.pass, d) {
            (BackwardPass::OnePass, 64) => 2,
            (BackwardPass::OnePass, _) => 1,
            _ => 0,
        }
    }

    /// Floats in the one pass's f32 dQ sums for `shape` (none in two passes): 64 · head dim
    /// for every block of 64 queries of every head.
    pub fn dq_accum_len(&self, shape: Shape) -> usize {
        match self.pass {
            BackwardPass::OnePass => {
                shape.batch * shape.heads * shape.tokens.div_ceil(64) * 64 * shape.head_dim
            }
            _ => 0,
        }
    }

    /// The registers the producer warpgroup keeps and each consumer thread may take: with
    /// one pass the producer keeps 32, for the adding warp beside the loading one.
    fn registers(&self) -> (u32, u32) {
        let producer = match self.pass {
            BackwardPass::OnePass => 32,
            _ => producer_registers(self.warpgroups),
        };
        producer_consumer_registers(self.warpgroups, producer)
    }

    /// Dynamic shared memory at head dim `d`: the block's two tiles, `stages` pairs of
    /// streamed tiles, with one pass two buffers of both warpgroups' dS and the dQ buffers,
    /// and room to align them on the swizzle's 1,024 bytes.
    pub fn smem_bytes(&self, d: usize) -> u32 {
        let one_pass = match self.pass {
            BackwardPass::OnePass => {
                2 * self.block_rows() * 64 * 2 + self.dq_buffers(d) * 64 * d * 4
            }
            _ => 0,
        };
        ((2 * self.block_rows() + 2 * self.stages * self.stream) * d * 2 + one_pass + 1024)
            as u32
    }

    /// That the GPU can run this kernel at head dim `d`; an error that names the limit
    /// otherwise.
    pub fn check(&self, d: usize) -> Result<(), AttnError> {
        let name = self.name();
        let unsupported = |why: String| {
            Err(AttnError::Unsupported {
                what: format!("the Hopper backward's {name}: {why}"),
            })
        };
        if !HEAD_DIMS.contains(&d) {
            return unsupported(format!("head dim {d}; it takes 64 and 128"));
        }
        if !(1..=3).contains(&self.warpgroups)
            || self.stages < 2
            || ![64, 128].contains(&self.stream)
        {
            return unsupported(
                "1 to 3 warpgroups, 2 or more stages, 64 or 128 rows streamed".into(),
            );
        }
        if self.pass == BackwardPass::OnePass && (self.warpgroups != 2 || self.stream != 64)
        {
            return unsupported(
                "one pass takes two warpgroups and 64 queries streamed".into(),
            );
        }
        // the log-sum-exps and δs of each stage are static shared memory
        let smem = self.smem_bytes(d) as usize + 2 * self.stages * self.stream * 4;
        if smem > SMEM_PER_BLOCK {
            return unsupported(format!(
                "{smem} bytes of shared memory at head dim {d}: more than a block's {SMEM_PER_BLOCK}"
            ));
        }
        Ok(())
    }

    /// A short name for tables and compiled modules: the pass, warpgroups × stages × rows
    /// streamed, and "longest first".
    pub fn name(&self) -> String {
        let pass = match self.pass {
            BackwardPass::Dkdv => "dkdv",
            BackwardPass::Dq => "dq",
            BackwardPass::OnePass => "one pass",
        };
        format!(
            "{pass} {}x{}x{}{}",
            self.warpgroups,
            self.stages,
            self.stream,
            if self.longest_first {
                " longest first"
            } else {
                ""
            }
        )
    }

    /// The `-D` set the kernel is compiled with.
    pub fn defines(&self, dtype: Dtype, d: usize, rank: TmaRank) -> Vec<String> {
        let (producer, consumer) = self.registers();
        let mut defines = common_defines(dtype, d, rank);
        defines.extend([
            format!("-DWGS={}", self.warpgroups),
            format!("-DSTAGES={}", self.stages),
            format!("-DSTREAM={}", self.stream),
            format!("-DTHREADS={}", self.threads()),
            format!("-DPRODUCER_REGS={producer}"),
            format!("-DCONSUMER_REGS={consumer}"),
            format!("-DLONGEST_FIRST={}", self.longest_first as u8),
        ]);
        if self.pass == BackwardPass::OnePass {
            defines.push(format!("-DDQ_BUFS={}", self.dq_buffers(d)));
        }
        defines
    }

    /// This kernel for a dtype, a head dim and a rank of the tensor maps: what is
    /// compiled.
    pub fn build(self, dtype: Dtype, head_dim: usize, rank: TmaRank) -> Build<Self> {
        Build {
            kernel: self,
            dtype,
            head_dim,
            rank,
        }
    }

    /// The grid for `shape`: one block per block of rows of each head of each sequence; an
    /// error where the y dimension would pass its 65,535.
    pub fn grid(&self, shape: Shape) -> Result<(u32, u32, u32), AttnError> {
        ordered_grid(
            shape,
            self.block_rows(),
            self.longest_first,
            &format!("backward's {}", self.name()),
            &format!("blocks of {} rows", self.block_rows()),
        )
    }

    /// As [`ForwardKernel::check_registers`].
    pub fn check_registers(
        &self,
        f: &cudarc::driver::CudaFunction,
    ) -> Result<(), AttnError> {
        check_register_pool(
            f,
            self.warpgroups,
            self.registers(),
            self.threads(),
            self.pass.entry(),
        )
    }
}

/// A backward: its rung's kernels in their block shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardKernels {
    /// dK and dV (with one pass, dQ's sums too).
    pub dkdv: BackwardKernel,
    /// dQ, in two passes.
    pub dq: Option<BackwardKernel>,
}

impl BackwardKernels {
    /// What `cuda_hopper` runs for queries of shape `q`: one pass at every length, two
    /// warpgroups and three stages; every head's longest blocks first while the queries
    /// and dO the blocks stream fit in L2 ([`longest_first`]). dQ's last bits then depend
    /// on the order blocks finish in, and it takes an f32 buffer as large as two dQs;
    /// [`BackwardKernels::two_passes`] takes neither.
    pub fn for_shape(q: Shape) -> Self {
        BackwardKernels {
            dkdv: BackwardKernel {
                pass: BackwardPass::OnePass,
                warpgroups: 2,
                stages: 3,
                stream: 64,
                longest_first: longest_first(4 * q.len()),
            },
            dq: None,
        }
    }

    /// The same kernels with the other block order (as [`ForwardKernel::other_order`]).
    pub fn other_order(self) -> Self {
        let flip = |k: BackwardKernel| BackwardKernel {
            longest_first: !k.longest_first,
            ..k
        };
        BackwardKernels {
            dkdv: flip(self.dkdv),
            dq: self.dq.map(flip),
        }
    }

    /// Rung 1, the two passes: the same bits every run, and no buffer beyond the gradients
    /// and δ. dK and dV with three warpgroups (192 keys a block) at head dim 64, three
    /// stages up to 8,192 tokens and two beyond, or two warpgroups and three stages at 128;
    /// dQ with two warpgroups streaming 128 keys a step; every head's longest blocks first
    /// while q and dO fit in L2 ([`longest_first`]).
    pub fn two_passes(q: Shape) -> Self {
        let longest_first = longest_first(4 * q.len());
        let (warpgroups, stages) = match q.head_dim {
            64 => (3, if q.tokens <= 8192 { 3 } else { 2 }),
            _ => (2, 3),
        };
        BackwardKernels {
            dkdv: BackwardKernel {
                pass: BackwardPass::Dkdv,
                warpgroups,
                stages,
                stream: 64,
                longest_first,
            },
            dq: Some(BackwardKernel {
                pass: BackwardPass::Dq,
                warpgroups: 2,
                stages: 2,
                stream: 128,
                longest_first,
            }),
        }
    }

    /// The rung's kernels for queries of shape `q`.
    pub fn rung(rung: BackwardRung, q: Shape) -> Self {
        match rung {
            BackwardRung::TwoPasses => BackwardKernels::two_passes(q),
            BackwardRung::OnePass => BackwardKernels::for_shape(q),
        }
    }

    /// The kernels, the first launched first.
    pub fn kernels(&self) -> impl Iterator<Item = BackwardKernel> {
        [Some(self.dkdv), self.dq].into_iter().flatten()
    }

    /// A short name: the kernels' names.
    pub fn name(&self) -> String {
        self.kernels()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// IS_BF16, HEAD_DIM and TMA_RANK, which every kernel takes.
fn common_defines(dtype: Dtype, d: usize, rank: TmaRank) -> Vec<String> {
    vec![
        format!("-DIS_BF16={}", (dtype == Dtype::Bf16) as u8),
        format!("-DHEAD_DIM={d}"),
        rank.define(),
    ]
}

/// One kernel compiled for a dtype, a head dim and a rank of the tensor maps: what NVRTC is
/// given ([`KernelSpec`]), for `sm_90a`, the target with `wgmma`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Build<K> {
    pub kernel: K,
    pub dtype: Dtype,
    pub head_dim: usize,
    pub rank: TmaRank,
}

impl KernelSpec for Build<ForwardKernel> {
    fn name(&self) -> String {
        let (k, d) = (self.kernel, self.head_dim);
        format!(
            "forward_{}_{}_d{d}_{}_rank{}.cu",
            k.rung.number(),
            self.dtype.name(),
            k.name().replace(' ', "_"),
            self.rank.rank()
        )
    }

    fn source(&self) -> Cow<'_, str> {
        format!("{HOPPER_CUH}\n{FORWARD_CUH}\n{}", self.kernel.rung.source()).into()
    }

    fn defines(&self) -> Vec<String> {
        self.kernel.defines(self.dtype, self.head_dim, self.rank)
    }

    fn check(&self) -> Result<(), AttnError> {
        self.kernel.check(self.head_dim)
    }

    fn arch(&self, _device: &'static str) -> &'static str {
        "sm_90a"
    }
}

impl KernelSpec for Build<BackwardKernel> {
    fn name(&self) -> String {
        format!(
            "backward_{}_d{}_{}_rank{}.cu",
            self.dtype.name(),
            self.head_dim,
            self.kernel.name().replace(' ', "_"),
            self.rank.rank()
        )
    }

    fn source(&self) -> Cow<'_, str> {
        let pass = self.kernel.pass.source();
        format!("{HOPPER_CUH}\n{BACKWARD_CUH}\n{pass}").into()
    }

    fn defines(&self) -> Vec<String> {
        self.kernel.defines(self.dtype, self.head_dim, self.rank)
    }

    fn check(&self) -> Result<(), AttnError> {
        self.kernel.check(self.head_dim)
    }

    fn arch(&self, _device: &'static str) -> &'static str {
        "sm_90a"
    }
}

/// A grid of one block per `rows` tokens of each head of each sequence: (blocks, heads) or,
/// longest first, (heads, blocks); an error naming `kernel` (what takes the grid) and
/// `blocks` (what the y dimension counts when longest first) where y would pass its 65,535.
fn ordered_grid(
    shape: Shape,
    rows: usize,
    longest_first: bool,
    kernel: &str,
    blocks: &str,
) -> Result<(u32, u32, u32), AttnError> {
    let (n, heads) = (shape.tokens.div_ceil(rows), shape.batch * shape.heads);
    let (x, y) = if longest_first {
        (heads, n)
    } else {
        (n, heads)
    };
    if y > 65_535 {
        return Err(AttnError::Unsupported {
            what: format!(
                "{shape}: the Hopper {kernel} takes at most 65,535 {} (a grid's y dimension), this shape needs {y}",
                if longest_first {
                    blocks
                } else {
                    "sequences × heads"
                }
            ),
        });
    }
    Ok((x as u32, y as u32, 1))
}

/// The registers a producer warpgroup keeps beside `warpgroups` consumer warpgroups: what
/// it needs to start copies, in steps of 8, leaving the consumers as many as the budget
/// allows.
fn producer_registers(warpgroups: usize) -> u32 {
    match warpgroups {
        1 => 56,
        2 => 24,
        _ => 32,
    }
}

/// The registers a block of `warpgroups` consumer warpgroups and a producer warpgroup
/// starts with, a thread: what ptxas gives at one block a multiprocessor, the register file
/// shared evenly in steps of 8 (168 for 384 threads, 128 for 512, as it reports).
fn start_registers(warpgroups: usize) -> u32 {
    let threads = 128 * (warpgroups as u32 + 1);
    (65_536 / threads / 8 * 8).min(255)
}

/// The registers a producer warpgroup keeping `producer` leaves each consumer thread: what
/// the block starts with, less the producer's, shared by the consumers in steps of 8, at
/// most 240.
fn producer_consumer_registers(warpgroups: usize, producer: u32) -> (u32, u32) {
    let threads = 128 * (warpgroups as u32 + 1);
    let free = (start_registers(warpgroups) * threads - 128 * producer)
        / (128 * warpgroups as u32)
        / 8
        * 8;
    (producer, free.min(240))
}

/// A producer warpgroup hands its registers to the consumers with `setmaxnreg`, and a
/// consumer's `setmaxnreg.inc` waits until the block's pool holds what it asks for: the
/// block must start with at least what both roles end with, or it would wait forever. The
/// kernel's register count, which ptxas sets from the launch bounds, is checked here before
/// a launch.
fn check_register_pool(
    f: &cudarc::driver::CudaFunction,
    warpgroups: usize,
    (producer, consumer): (u32, u32),
    threads: u32,
    what: &str,
) -> Result<(), AttnError> {
    let regs = f
        .num_regs()
        .map_err(step03_cuda_forward::gpu::device_error(
            "reading a kernel's register count",
        ))? as u32;
    let needed = 128 * producer + 128 * warpgroups as u32 * consumer;
    if regs * threads < needed {
        return Err(AttnError::Device {
            what: format!(
                "{what} was compiled with {regs} registers a thread for {threads} threads, fewer than the {needed} its producer ({producer} each) and consumers ({consumer} each) hold after setmaxnreg: launched, it would wait forever"
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Longest first, the grid is (heads, query blocks); a shape with more query blocks
    /// than the y dimension takes is an error that says so, and the defaults take the order
    /// only where every length they cover fits.
    #[test]
    fn longest_first_swaps_the_grid_and_names_its_limit() {
        let one = ForwardKernel::for_shape(Shape::new(4, 12, 1 << 14, 64), 12);
        assert!(!one.longest_first);
        let lf = one.other_order();
        let s = Shape::new(4, 12, 1000, 64);
        assert_eq!(one.grid(s).unwrap(), (6, 48, 1));
        assert_eq!(lf.grid(s).unwrap(), (48, 6, 1));
        let long = Shape::new(1, 1, 65_536 * 192, 64);
        assert!(one.grid(long).is_ok());
        let e = lf.grid(long).unwrap_err().to_string();
        assert!(
            e.contains("65,535 blocks of queries") && e.contains("65536"),
            "{e}"
        );
        for d in HEAD_DIMS {
            for t in [1, 4096, 4097, 8192, 8193, 1 << 16, 1 << 24] {
                let s = Shape::new(1, 1, t, d);
                let f = ForwardKernel::for_shape(s, 1);
                assert!(f.grid(s).is_ok(), "{t} d{d}: {f:?}");
                for k in BackwardKernels::for_shape(s)
                    .kernels()
                    .chain(BackwardKernels::two_passes(s).kernels())
                {
                    assert!(k.grid(s).is_ok(), "{t} d{d}: {k:?}");
                }
            }
        }
    }

    /// Every kernel a method launches fits the GPU, and every one whose producer hands its
    /// registers over starts with at least the registers its roles end with, so
    /// `setmaxnreg.inc` never waits for registers that will not come.
    #[test]
    fn every_kernel_the_methods_launch_fits_its_limits_and_the_register_file() {
        for d in HEAD_DIMS {
            for t in [1, 2048, 2049, 4096, 4097, 8192, 8193, 1 << 14, 1 << 20] {
                let s = Shape::new(4, 12, t, d);
                let forwards = ForwardRung::ALL.map(|r| r.shape(s, 12));
                for f in forwards.iter().chain([&ForwardKernel::for_shape(s, 12)]) {
                    f.check(d).unwrap_or_else(|e| panic!("{t} d{d}: {e}"));
                    if let Some((producer, consumer)) = f.registers() {
                        let needed = 128 * producer + 128 * f.warpgroups as u32 * consumer;
                        assert!(
                            needed <= start_registers(f.warpgroups) * f.threads(),
                            "{}",
                            f.name()
                        );
                        assert!(consumer % 8 == 0 && (24..=240).contains(&consumer));
                    }
                }
                for b in [BackwardRung::TwoPasses, BackwardRung::OnePass] {
                    for k in BackwardKernels::rung(b, s).kernels() {
                        k.check(d).unwrap_or_else(|e| panic!("{t} d{d}: {e}"));
                        let (producer, consumer) = k.registers();
                        let needed = 128 * producer + 128 * k.warpgroups as u32 * consumer;
                        assert!(
                            needed <= start_registers(k.warpgroups) * k.threads(),
                            "{}",
                            k.name()
                        );
                        assert!(consumer % 8 == 0 && (24..=240).contains(&consumer));
                    }
                }
            }
        }
    }

    /// The sizes the forward's launch takes are the ones `forward.cuh` fixes.
    #[test]
    fn the_forward_launch_takes_the_sizes_forward_cuh_fixes() {
        for (name, value) in [("BLOCK_N", BLOCK_N), ("STAGES", STAGES)] {
            let start = format!("#define {name} ");
            let defined: Vec<&str> = FORWARD_CUH
                .lines()
                .filter_map(|l| l.strip_prefix(&start))
                .map(|v| v.split("//").next().unwrap_or(v).trim())
                .collect();
            assert_eq!(defined, [value.to_string()], "forward.cuh's {name}");
        }
    }

    /// What the limits refuse is an error that says why.
    #[test]
    fn a_kernel_the_gpu_cannot_run_is_an_error_naming_the_limit() {
        let turns_alone = ForwardKernel {
            warpgroups: 1,
            ..ForwardRung::Turns.shape(Shape::new(4, 12, 8192, 64), 12)
        };
        let e = turns_alone.check(64).unwrap_err().to_string();
        assert!(e.contains("two or more warpgroups"), "{e}");
        let big = ForwardKernel {
            min_blocks: 3,
            ..ForwardRung::Wgmma.shape(Shape::new(4, 12, 8192, 128), 12)
        };
        let e = big.check(128).unwrap_err().to_string();
        assert!(e.contains("shared memory"), "{e}");
        let shared = ForwardKernel {
            min_blocks: 2,
            ..ForwardRung::ProducerWarpgroup.shape(Shape::new(4, 12, 8192, 64), 12)
        };
        let e = shared.check(64).unwrap_err().to_string();
        assert!(e.contains("one block a multiprocessor"), "{e}");
        let one_pass = BackwardKernel {
            warpgroups: 3,
            ..BackwardKernels::for_shape(Shape::new(4, 12, 8192, 64)).dkdv
        };
        let e = one_pass.check(64).unwrap_err().to_string();
        assert!(e.contains("two warpgroups"), "{e}");
    }
}
