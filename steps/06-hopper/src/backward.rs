//! The backward kernels' host side: step 04's two passes (dK and dV per block of keys, dQ per
//! block of queries) with Hopper's products, after step 04's δ.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use flash_core::{AttnError, Shape};
use step03_cuda_forward::kernel::{compile_error, require_nvrtc};
use step03_cuda_forward::{DeviceAttention, DeviceTensor, Dtype, Gpu, alloc_error, device_error};
use step04_backward::cuda::{DeviceGrads, check_backward_device};

use crate::forward::{
    self, HOPPER_CUH, SMEM_PER_BLOCK, SMEM_PER_SM, check_hopper, check_register_pool, tensor_map,
};
use crate::layout::{Layout, Strided, TmaRank};

/// The backward kernels' source (after [`HOPPER_CUH`]).
pub const HOPPER_BACKWARD_CU: &str = include_str!("../kernels/hopper_backward.cu");
/// The pass that gives dK and dV, a block of keys at a time.
pub const HOPPER_DKDV: &str = "hopper_dkdv";
/// The pass that gives dQ, a block of queries at a time.
pub const HOPPER_DQ: &str = "hopper_dq";
/// After a dkdv pass that added dQ into f32 (`dq_atomic`): dQ scaled and rounded.
pub const HOPPER_DQ_CONVERT: &str = "hopper_dq_convert";
/// Before both passes: δ = Σ dO·O a row (in dkdv's module).
pub const HOPPER_DELTA: &str = "hopper_delta";

/// One backward kernel's thread block, set at compile time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardConfig {
    /// Consumer warpgroups per block (`WGS`), 64 rows each: keys (dkdv) or queries (dq).
    pub warpgroups: usize,
    /// Buffers of the streamed tiles in flight (`STAGES`).
    pub stages: usize,
    /// Rows streamed past the block per step (`STREAM`): queries (dkdv) or keys (dq).
    pub stream: usize,
    /// Blocks each multiprocessor must fit (`MIN_BLOCKS`, the register budget).
    pub min_blocks: usize,
    /// The producer a warpgroup that hands its registers to the consumers (`PRODUCER_WG`).
    pub producer_warpgroup: bool,
    /// dkdv only: dQ in the same pass, added into f32 with atomics (`DQ_ATOMIC`), so that
    /// no dq pass runs; its last bits then depend on the order blocks finish in. 64 queries
    /// streamed; head dim 64, or 128 with `dq_warp` (not pipelined).
    pub dq_atomic: bool,
    /// With `dq_atomic`: the warpgroups' dS meet in shared memory, one warpgroup takes dQ
    /// over the block's keys and adds it a row at a time with bulk reductions (`DQ_ATOMIC=2`:
    /// half the sums, and an instruction per row). Two consumer warpgroups.
    pub dq_bulk: bool,
    /// With `dq_atomic`: as FlashAttention-3 does, a warp of the producer warpgroup adds dQ
    /// with one bulk reduction a step while the consumers go on; the warpgroups split dQ's
    /// product between them (`DQ_ATOMIC=3`). Two consumer warpgroups and a producer warpgroup.
    pub dq_warp: bool,
    /// With `dq_warp`: each block's dQ product issued after the next block's Sᵀ and dPᵀ, so
    /// that the warpgroups need not meet every step (`DQ_ATOMIC=4`).
    pub dq_pipelined: bool,
    /// With `dq_warp`: the buffers of a block's dQ in shared memory (`DQ_BUFS`), 2, or 1 to
    /// leave room for a third stage at head dim 128.
    pub dq_buffers: usize,
    /// With `dq_warp` (not pipelined): how the warpgroups split a block's dQ product
    /// (`DQ_SPLIT`).
    pub dq_split: DqSplit,
    /// With [`DqSplit::Rows`]: each warp frees the stage once its dV and dK have landed, before
    /// its warpgroup's dQ product, which reads k and dS, not the stage (`EARLY_FREE`).
    pub early_free: bool,
    /// dkdv only: every consumer thread arrives on a stage's "empty" barrier, releasing its
    /// own reads of the stage's log-sum-exps and δs, rather than each warp's lane 0 after
    /// `__syncwarp` (`LANE_RELEASE`). Both are sound; racecheck follows only the first when
    /// it checks the kernel alone.
    pub lane_release: bool,
    /// The grid (heads, blocks) rather than (blocks, heads) (`LONGEST_FIRST`): every head's
    /// longest block before any head's next longest.
    pub longest_first: bool,
    /// Exponentials from `exp2f` (`EXACT_EXP`), four instructions each, rather than
    /// `fast_exp2`'s one: kept to measure the difference.
    pub exact_exp: bool,
}

/// How the one pass's two warpgroups split a block's dQᵀ = kᵀ·dSᵀ (64 queries over the block's
/// 128 keys) between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DqSplit {
    /// 32 queries each: an m64n32 product for each 64 columns of the head dim, whose k-steps
    /// read more shared memory than it gives in the cycles they take.
    Queries,
    /// Head dim 128: 64 of the head dim's columns each, one m64n64 product.
    Columns,
    /// Head dim 64: every other block's whole product (m64n64) each.
    Blocks,
    /// Head dim 128: every other block's whole product each, as dQ = dS·k (one m64n128
    /// product the head dim across, which reads a quarter less shared memory a cycle than
    /// the m64n64 ones), once the warpgroup's dV and dK have landed.
    Rows,
}

impl BackwardConfig {
    const fn new(warpgroups: usize, stream: usize, producer_warpgroup: bool) -> Self {
        BackwardConfig {
            warpgroups,
            stages: 2,
            stream,
            min_blocks: 1,
            producer_warpgroup,
            dq_atomic: false,
            dq_bulk: false,
            dq_warp: false,
            dq_pipelined: false,
            dq_buffers: 2,
            dq_split: DqSplit::Queries,
            early_free: false,
            lane_release: false,
            longest_first: false,
            exact_exp: false,
        }
    }

    /// The dkdv shape that gives dQ too, with atomics.
    pub const fn with_dq_atomic(self) -> Self {
        BackwardConfig {
            dq_atomic: true,
            ..self
        }
    }

    /// The dkdv shape that gives dQ too, summed in shared memory first, with bulk reductions.
    pub const fn with_dq_bulk(self) -> Self {
        BackwardConfig {
            dq_atomic: true,
            dq_bulk: true,
            ..self
        }
    }

    /// The dkdv shape that gives dQ too, added by a warp of its own with bulk reductions.
    pub const fn with_dq_warp(self) -> Self {
        BackwardConfig {
            dq_atomic: true,
            dq_warp: true,
            ..self
        }
    }

    /// `with_dq_warp`, pipelined.
    pub const fn with_dq_pipelined(self) -> Self {
        BackwardConfig {
            dq_pipelined: true,
            ..self.with_dq_warp()
        }
    }

    /// `with_dq_warp` with one buffer of dQ.
    pub const fn with_one_dq_buffer(self) -> Self {
        BackwardConfig {
            dq_buffers: 1,
            ..self.with_dq_warp()
        }
    }

    /// `with_dq_warp`, dQ's product split between the warpgroups by `split`.
    pub const fn with_dq_split(self, split: DqSplit) -> Self {
        BackwardConfig {
            dq_split: split,
            ..self.with_dq_warp()
        }
    }

    /// With the stage freed before dQ's product.
    pub const fn with_early_free(self) -> Self {
        BackwardConfig {
            early_free: true,
            ..self
        }
    }

    /// With every consumer thread releasing its own reads of a stage.
    pub const fn with_lane_release(self) -> Self {
        BackwardConfig {
            lane_release: true,
            ..self
        }
    }

    /// With every head's longest block first.
    pub const fn with_longest_first(self) -> Self {
        BackwardConfig {
            longest_first: true,
            ..self
        }
    }

    /// With exponentials from `exp2f`.
    pub const fn with_exact_exp(self) -> Self {
        BackwardConfig {
            exact_exp: true,
            ..self
        }
    }

    /// With `stages` buffers of the streamed tiles.
    pub const fn with_stages(self, stages: usize) -> Self {
        BackwardConfig { stages, ..self }
    }

    /// The value of `DQ_ATOMIC`: 0 two passes, 1 atomics, 2 bulk reductions a row, 3 a warp
    /// of its own.
    fn dq_mode(&self) -> u8 {
        match (self.dq_atomic, self.dq_bulk, self.dq_warp) {
            (false, ..) => 0,
            (true, false, false) => 1,
            (true, true, _) => 2,
            (true, false, true) => 3 + self.dq_pipelined as u8,
        }
    }

    /// Floats in dkdv's f32 dQ buffer for `shape` (none in two passes): a value per value of
    /// dQ, or with `dq_warp` 64 · head dim per block of 64 queries of every head.
    pub fn dq_accum_len(&self, shape: Shape) -> usize {
        match self.dq_mode() {
            0 => 0,
            3 | 4 => shape.batch * shape.heads * shape.tokens.div_ceil(64) * 64 * shape.head_dim,
            _ => shape.len(),
        }
    }

    /// The registers a producer warpgroup keeps (`PRODUCER_REGS`): with `dq_warp` 32, for
    /// the adding warp beside the loading one (ptxas spills at 24), else the default.
    pub fn producer_registers(&self) -> u32 {
        if self.dq_warp {
            32
        } else {
            forward::default_producer_registers(self.warpgroups)
        }
    }

    /// Rows per block: keys (dkdv) or queries (dq).
    pub fn block_rows(&self) -> usize {
        64 * self.warpgroups
    }

    /// The grid for `shape`: (blocks, heads) or, longest first, (heads, blocks); an error
    /// where the y dimension would pass its 65,535.
    pub fn grid(&self, shape: Shape) -> Result<(u32, u32, u32), AttnError> {
        forward::ordered_grid(
            shape,
            self.block_rows(),
            self.longest_first,
            &format!("backward's block shape {}", self.name()),
            &format!("blocks of {} rows", self.block_rows()),
        )
    }

    /// Threads per block: the consumer warpgroups and a producer warp (or warpgroup).
    pub fn threads(&self) -> u32 {
        let producer = if self.producer_warpgroup { 128 } else { 32 };
        (128 * self.warpgroups + producer) as u32
    }

    /// Dynamic shared memory at head dim `d`: the block's two tiles, `stages` pairs of
    /// streamed tiles, each warpgroup's dS with `dq_atomic`, and room to align them on the
    /// swizzle's 1,024 bytes.
    pub fn smem_bytes(&self, d: usize) -> u32 {
        let ds_tiles = self.block_rows() * 64 * 2;
        let ds = match self.dq_mode() {
            0 => 0,
            1 => ds_tiles,
            // dQ's 64 rows of 288 bytes (64 f32, 32 against bank conflicts)
            2 => ds_tiles + 64 * 288,
            // two buffers of dS, `dq_buffers` of dQ's 64 × d f32
            _ => 2 * ds_tiles + self.dq_buffers * 64 * d * 4,
        };
        ((2 * self.block_rows() + 2 * self.stages * self.stream) * d * 2 + ds + 1024) as u32
    }

    /// Whether `min_blocks` blocks fit one multiprocessor's shared memory at head dim `d`
    /// (with the log-sum-exps and δs of each stage and 1 KB the system reserves a block).
    pub fn fits(&self, d: usize) -> bool {
        let smem = self.smem_bytes(d) as usize + 2 * self.stages * self.stream * 4;
        smem <= SMEM_PER_BLOCK
            && self.min_blocks * (smem + 1024) <= SMEM_PER_SM
            && (!self.producer_warpgroup || self.min_blocks == 1)
            && (!self.dq_atomic
                || (self.stream == 64 && (d == 64 || (self.dq_warp && !self.dq_pipelined))))
            && (!self.dq_bulk || (self.dq_atomic && self.warpgroups == 2))
            && (self.dq_buffers == 2 || (self.dq_buffers == 1 && self.dq_warp))
            && match self.dq_split {
                DqSplit::Queries => true,
                DqSplit::Columns => self.dq_warp && !self.dq_pipelined && d == 128,
                DqSplit::Blocks => {
                    self.dq_warp && !self.dq_pipelined && d == 64 && self.dq_buffers == 2
                }
                DqSplit::Rows => self.dq_warp && !self.dq_pipelined && d == 128,
            }
            && (!self.early_free || self.dq_split == DqSplit::Rows)
            && (!self.dq_warp
                || (self.dq_atomic
                    && !self.dq_bulk
                    && self.warpgroups == 2
                    && self.producer_warpgroup))
    }

    /// A short name: warpgroups × stages × stream, "+pwg" (a producer warpgroup), "+dqa"
    /// (dQ with atomics), "+dqb" (dQ with bulk reductions a row), "+dqw" (dQ by a warp of its
    /// own), "+dqp" (that, pipelined), "+1dq" (one buffer of dQ), "+dqc", "+dqn" and "+dqr"
    /// (its product split by columns, by blocks, or by blocks as dQ's rows), "+ef"
    /// (`early_free`), "+lr" (`lane_release`), "+lf" (`longest_first`), "+exp2f"
    /// (`exact_exp`).
    pub fn name(&self) -> String {
        format!(
            "{}x{}x{}{}{}{}{}{}{}{}{}{}",
            self.warpgroups,
            self.stages,
            self.stream,
            if self.min_blocks > 1 {
                format!("/{}", self.min_blocks)
            } else {
                String::new()
            },
            if self.producer_warpgroup { "+pwg" } else { "" },
            ["", "+dqa", "+dqb", "+dqw", "+dqp"][self.dq_mode() as usize],
            if self.dq_buffers == 1 { "+1dq" } else { "" },
            ["", "+dqc", "+dqn", "+dqr"][self.dq_split as usize],
            if self.early_free { "+ef" } else { "" },
            if self.lane_release { "+lr" } else { "" },
            if self.longest_first { "+lf" } else { "" },
            if self.exact_exp { "+exp2f" } else { "" }
        )
    }
}

/// The two passes' block shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardConfigs {
    pub dkdv: BackwardConfig,
    pub dq: BackwardConfig,
}

impl BackwardConfigs {
    /// The shapes for a sequence length and head dim, measured fastest by `hopper-check` on the
    /// H200 (`measurements/dq-split.txt`, and at head dim 128 `measurements/dq-rows.txt`): at
    /// every length one pass, dQ added by a warp of its own (two consumer warpgroups, three
    /// stages), its product taken by each warpgroup every other block, as dQᵀ at head dim 64
    /// and as dQ's rows at 128 (with one buffer of dQ); up to 4,096 tokens every head's
    /// longest blocks first; every consumer lane releasing its own reads of a stage
    /// (`measurements/lane-release.txt`). That dQ's last bits depend on the order blocks
    /// finish in, and it takes an f32 buffer as large as two dQs;
    /// [`BackwardConfigs::deterministic`] takes neither.
    pub fn for_shape(tokens: usize, head_dim: usize) -> Self {
        let one_pass = BackwardConfig::new(2, 64, true)
            .with_stages(3)
            .with_lane_release();
        let dkdv = match head_dim {
            128 => one_pass.with_dq_split(DqSplit::Rows).with_one_dq_buffer(),
            _ => one_pass.with_dq_split(DqSplit::Blocks),
        };
        // the dq pass is not launched
        let dq = BackwardConfigs::deterministic(1 << 14, head_dim).dq;
        BackwardConfigs { dkdv, dq }.longest_first_up_to_4k(tokens)
    }

    /// Two passes, each block writing only its own rows: the same bits run to run, and no
    /// buffer beyond the gradients and δ. The shapes measured fastest by `hopper-check` on the
    /// H200 (`measurements/backward-shapes-d657487.txt`), every pass fed by a producer
    /// warpgroup that gives its registers to the consumers: at head dim 64 dK/dV with three
    /// consumer warpgroups (192 keys a block), three stages up to 8,192 tokens and two beyond,
    /// and dQ with two streaming 128 keys a step; at head dim 128 dK/dV with two warpgroups
    /// streaming 64 queries a step in three stages (their accumulators and a block's Pᵀ and
    /// dPᵀ take 208 of the 240 registers the producer's leave them; with two stages it ran
    /// 10% slower at 8,192 tokens beside this dQ) and dQ with two streaming 128 keys. Up to
    /// 4,096 tokens every head's longest blocks first (`measurements/dq-split.txt`, call 5);
    /// dK/dV's consumer lanes each releasing their own reads of a stage
    /// (`measurements/lane-release.txt`).
    pub fn deterministic(tokens: usize, head_dim: usize) -> Self {
        let c = BackwardConfig::new;
        let configs = match head_dim {
            128 => BackwardConfigs {
                dkdv: c(2, 64, true).with_stages(3).with_lane_release(),
                dq: c(2, 128, true),
            },
            _ => BackwardConfigs {
                dkdv: c(3, 64, true)
                    .with_stages(if tokens <= 8192 { 3 } else { 2 })
                    .with_lane_release(),
                dq: c(2, 128, true),
            },
        };
        configs.longest_first_up_to_4k(tokens)
    }

    /// Both passes with every head's longest blocks first up to 4,096 tokens, where that
    /// gained 2% to 21% in `hopper-check`; from 8,192 it tied or lost, up to 11%, and each
    /// head's blocks stay together (`measurements/dq-split.txt`, call 5).
    fn longest_first_up_to_4k(self, tokens: usize) -> Self {
        if tokens <= 4096 {
            BackwardConfigs {
                dkdv: self.dkdv.with_longest_first(),
                dq: self.dq.with_longest_first(),
            }
        } else {
            self
        }
    }

    /// Every pair [`BackwardConfigs::for_shape`] and [`BackwardConfigs::deterministic`] pick
    /// at head dim `d`, the longest sequences' first.
    pub fn defaults(d: usize) -> Vec<BackwardConfigs> {
        let mut all = Vec::new();
        for tokens in [1 << 14, 8192, 1] {
            for c in [
                BackwardConfigs::for_shape(tokens, d),
                BackwardConfigs::deterministic(tokens, d),
            ] {
                if !all.contains(&c) {
                    all.push(c);
                }
            }
        }
        all
    }

    /// The pairs `hopper-check` compares at head dim `d`: every one fits and compiles without
    /// spills (`hopper-kernel-check`).
    pub fn candidates(d: usize) -> Vec<BackwardConfigs> {
        let mut all = BackwardConfigs::defaults(d);
        // every dkdv shape beside every dq shape, each pair once
        let mut pairs = |dkdv: &[BackwardConfig], dq: &[BackwardConfig]| {
            for &a in dkdv {
                for &b in dq {
                    let c = BackwardConfigs { dkdv: a, dq: b };
                    if !all.contains(&c) {
                        all.push(c);
                    }
                }
            }
        };
        let c = BackwardConfig::new;
        if d == 128 {
            // the shapes of the defaults before commit d657487 (dkdv 2x2x32+pwg from 8,192
            // tokens, 1x2x64 below, dq 2x2x64+pwg), then each pass's further shapes beside
            // them: 64 queries a step for two warpgroups with the producer's registers, third
            // stages, three warpgroups streaming 32 keys, 128 keys a step; then dkdv 2x2x64+pwg
            // beside dq 2x2x128+pwg (the defaults take that pair with a third stage for dkdv)
            pairs(
                &[c(2, 32, true), c(1, 64, false)],
                &[c(2, 64, true), c(2, 32, false), c(1, 64, false)],
            );
            pairs(
                &[
                    c(2, 64, true),
                    c(2, 64, true).with_stages(3),
                    c(2, 32, true).with_stages(3),
                    c(1, 64, true),
                    c(1, 64, false).with_stages(3),
                ],
                &[c(2, 64, true)],
            );
            pairs(
                &[c(2, 32, true), c(1, 64, false)],
                &[
                    c(2, 128, true),
                    c(2, 64, true).with_stages(3),
                    c(3, 32, true),
                ],
            );
            pairs(&[c(2, 64, true)], &[c(2, 128, true)]);
        } else {
            pairs(
                &[
                    c(2, 64, false),
                    c(2, 64, true),
                    c(3, 64, true),
                    c(2, 32, false),
                ],
                &[c(2, 64, false), c(2, 128, true), c(3, 64, false)],
            );
            // a third stage, 32 queries a step, and the dq shapes beside both dkdv defaults
            pairs(&[c(3, 32, true)], &[c(2, 128, true)]);
            pairs(
                &[c(3, 64, true), c(3, 64, true).with_stages(3)],
                &[
                    c(2, 128, true).with_stages(3),
                    c(3, 64, true),
                    c(2, 64, true),
                ],
            );
        }
        if d == 128 {
            // one pass, dQ added by a warp of its own (the dq shape is not used), also with
            // one buffer of dQ, which leaves room for a third stage; pipelined, as at head
            // dim 64, ptxas spills (dQᵀ's accumulators would be live beside the next block's
            // Sᵀ and dPᵀ)
            let dq = BackwardConfigs::deterministic(1 << 14, d).dq;
            // then dQ's product split by columns (the defaults before dq-rows.txt), and by
            // blocks as dQ's rows (the defaults since)
            let columns = c(2, 64, true).with_dq_split(DqSplit::Columns);
            let rows = c(2, 64, true)
                .with_dq_split(DqSplit::Rows)
                .with_one_dq_buffer()
                .with_stages(3);
            pairs(
                &[
                    c(2, 64, true).with_dq_warp(),
                    c(2, 64, true).with_one_dq_buffer(),
                    c(2, 64, true).with_one_dq_buffer().with_stages(3),
                    columns,
                    columns.with_one_dq_buffer().with_stages(3),
                    rows,
                    c(2, 64, true).with_dq_split(DqSplit::Rows),
                    // the stage freed before dQ's product
                    rows.with_lane_release().with_early_free(),
                    c(2, 64, true)
                        .with_dq_split(DqSplit::Rows)
                        .with_lane_release()
                        .with_early_free(),
                ],
                &[dq],
            );
            // the defaults before dq-rows.txt up to 4,096 tokens, and the stage freed early
            // there (the unused dq shape as the defaults pair it, longest first too: one-pass
            // pairs are named by dkdv alone)
            pairs(
                &[
                    columns
                        .with_one_dq_buffer()
                        .with_stages(3)
                        .with_longest_first(),
                    rows.with_lane_release()
                        .with_early_free()
                        .with_longest_first(),
                ],
                &[dq.with_longest_first()],
            );
        }
        if d == 64 {
            // one pass: the dq shape is not used
            let dq = BackwardConfigs::deterministic(1 << 14, d).dq;
            // (with three warpgroups, or without the producer's registers, ptxas spills or
            // serialises the products); then dQ's product taken by each warpgroup every other
            // block
            let blocks = c(2, 64, true).with_dq_split(DqSplit::Blocks);
            pairs(
                &[
                    c(2, 64, true).with_dq_atomic(),
                    c(2, 64, true).with_dq_bulk(),
                    c(2, 64, true).with_dq_warp(),
                    c(2, 64, true).with_dq_pipelined(),
                    blocks,
                    blocks.with_stages(3),
                ],
                &[dq],
            );
        }
        // the defaults up to 4,096 tokens with each head's blocks together; then every default
        // shape, blocks together, with the exponentials as exp2f computes them
        let together = |c: BackwardConfig| BackwardConfig {
            longest_first: false,
            ..c
        };
        // every default pair with each warp's lane 0 releasing a stage (the defaults before
        // lane-release.txt)
        for c in BackwardConfigs::defaults(d) {
            pairs(
                &[BackwardConfig {
                    lane_release: false,
                    ..c.dkdv
                }],
                &[c.dq],
            );
        }
        for exact_exp in [false, true] {
            for c in BackwardConfigs::defaults(d) {
                pairs(
                    &[BackwardConfig {
                        exact_exp,
                        ..together(c.dkdv)
                    }],
                    &[BackwardConfig {
                        exact_exp,
                        ..together(c.dq)
                    }],
                );
            }
        }
        all.retain(|c| c.dkdv.fits(d) && c.dq.fits(d));
        all
    }

    /// Every distinct kernel shape among [`BackwardConfigs::candidates`], for the kernel check.
    pub fn shapes(d: usize) -> Vec<(&'static str, BackwardConfig)> {
        let mut shapes = Vec::new();
        for c in Self::candidates(d) {
            for s in [(HOPPER_DKDV, c.dkdv), (HOPPER_DQ, c.dq)] {
                if !shapes.contains(&s) {
                    shapes.push(s);
                }
            }
        }
        shapes
    }

    /// A short name: dkdv's shape, then dq's (none when dkdv gives dQ too).
    pub fn name(&self) -> String {
        if self.dkdv.dq_atomic {
            format!("dkdv {} (one pass)", self.dkdv.name())
        } else {
            format!("dkdv {} dq {}", self.dkdv.name(), self.dq.name())
        }
    }
}

/// Compiles one pass (`entry`: [`HOPPER_DKDV`] or [`HOPPER_DQ`]) for `sm_90a` in one block
/// shape.
pub fn compile(
    dtype: Dtype,
    head_dim: usize,
    entry: &str,
    config: BackwardConfig,
    rank: TmaRank,
) -> Result<Ptx, AttnError> {
    require_nvrtc()?;
    let options = CompileOptions {
        arch: Some("sm_90a"),
        options: vec![
            format!("-DPASS={}", (entry == HOPPER_DQ) as u8),
            format!("-DIS_BF16={}", (dtype == Dtype::Bf16) as u8),
            format!("-DHEAD_DIM={head_dim}"),
            format!("-DWGS={}", config.warpgroups),
            format!("-DSTAGES={}", config.stages),
            format!("-DSTREAM={}", config.stream),
            format!("-DMIN_BLOCKS={}", config.min_blocks),
            format!("-DPRODUCER_WG={}", config.producer_warpgroup as u8),
            format!("-DPRODUCER_REGS={}", config.producer_registers()),
            format!("-DDQ_ATOMIC={}", config.dq_mode()),
            format!("-DDQ_BUFS={}", config.dq_buffers),
            format!("-DDQ_SPLIT={}", config.dq_split as u8),
            format!("-DEARLY_FREE={}", config.early_free as u8),
            format!("-DLANE_RELEASE={}", config.lane_release as u8),
            format!("-DLONGEST_FIRST={}", config.longest_first as u8),
            format!("-DEXACT_EXP={}", config.exact_exp as u8),
            rank.define(),
            "--std=c++17".into(),
            // the pipelined one-pass loop's step is a lambda, which NVRTC 13.0 takes for a
            // host function unless told otherwise
            "-default-device".into(),
        ],
        name: Some(format!(
            "{entry}_{}_d{head_dim}_{}_rank{}.cu",
            dtype.name(),
            config.name(),
            rank.rank()
        )),
        ..Default::default()
    };
    compile_ptx_with_opts(format!("{HOPPER_CUH}\n{HOPPER_BACKWARD_CU}"), options)
        .map_err(|e| compile_error(entry, e))
}

/// The gradients of q, k and v with the Hopper kernels, given the forward's output and
/// log-sum-exp and the output's gradient `dout`, in the fastest block shapes
/// ([`BackwardConfigs::for_shape`]): one pass, whose dq may differ run to run in its last
/// bits; [`backward_with`] and [`BackwardConfigs::deterministic`] give the same bits every
/// time.
pub fn backward(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    let configs = BackwardConfigs::for_shape(q.shape.tokens, q.shape.head_dim);
    backward_with(gpu, configs, q, k, v, fwd, dout)
}

/// What both entry points check before anything is allocated or launched: a Hopper GPU, the
/// backward's inputs of one shape on the device, and the forward's checks (a head dim the
/// kernels take, at most 65,535 heads). The shape.
fn check_inputs(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<Shape, AttnError> {
    check_hopper(gpu)?;
    let shape = check_backward_device(q, k, v, fwd, dout)?;
    forward::check_shape(shape)?;
    Ok(shape)
}

/// [`backward`] with the given block shapes.
pub fn backward_with(
    gpu: &Gpu,
    configs: BackwardConfigs,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    let shape = check_inputs(gpu, q, k, v, fwd, dout)?;
    // SAFETY: both passes together (or dkdv and hopper_dq_convert, with `dq_atomic`) write
    // every row of dq, dk and dv before anything reads them (an empty shape has none)
    let mut grads = unsafe { DeviceGrads::alloc(gpu, shape, q.dtype) }?;
    if shape.is_empty() {
        return Ok(grads);
    }
    let stream = gpu.stream();
    let layout = Layout::heads(shape);
    let tensor = |x: &DeviceTensor| Strided {
        ptr: x.data.device_ptr(stream).0,
        layout,
    };
    let inputs = BackwardInputs {
        q: tensor(q),
        k: tensor(k),
        v: tensor(v),
        out: tensor(&fwd.out),
        dout: tensor(dout),
        lse: fwd.lse.device_ptr(stream).0,
    };
    let (dq, _dq) = grads.dq.data.device_ptr_mut(stream);
    let (dk, _dk) = grads.dk.data.device_ptr_mut(stream);
    let (dv, _dv) = grads.dv.data.device_ptr_mut(stream);
    // SAFETY: the inputs were checked to hold the shape's values in one dtype, contiguous;
    // the three gradients were just allocated for the shape in q's dtype, apart, and live
    // (with their guards) until the launches are queued; every allocation is 256-byte aligned
    unsafe {
        launch_passes(gpu, configs, shape, q.dtype, inputs, [dq, dk, dv], layout)?;
    }
    drop((_dq, _dk, _dv));
    Ok(grads)
}

/// The backward's inputs, wherever they are: q, k, v, the forward's output and its gradient
/// dO, and the forward's log-sum-exp (`[batch · heads, tokens]` f32).
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs {
    pub q: Strided,
    pub k: Strided,
    pub v: Strided,
    pub out: Strided,
    pub dout: Strided,
    pub lse: u64,
}

/// [`backward_with`] reading its inputs where their layouts say and writing dq, dk and dv
/// where `layout` says, from the device addresses `[dq, dk, dv]`: for example from the
/// trainer's fused projection and the rows of its output projection, and straight into the
/// fused projection's gradient.
///
/// TMA reads q, k, v and dO: their addresses and strides must be multiples of 16 bytes; the
/// kernels read the output and write the gradients in pairs of values: 4 bytes. All are
/// checked, with each layout's heads and token stride.
///
/// # Safety
/// Each address must point into a live allocation on this GPU's context, in `dtype`, with
/// [`Layout::span`] values for `shape` from it inside that allocation (`lse`: `batch · heads ·
/// tokens` f32), alive until the stream has run the kernels; the values `layout` reaches from
/// the three gradients' addresses must not overlap one another or any input.
pub unsafe fn backward_into(
    gpu: &Gpu,
    configs: BackwardConfigs,
    shape: Shape,
    dtype: Dtype,
    inputs: BackwardInputs,
    grads: [u64; 3],
    layout: Layout,
) -> Result<(), AttnError> {
    check_hopper(gpu)?;
    forward::check_shape(shape)?;
    let i = inputs;
    for (x, name) in [(i.q, "q"), (i.k, "k"), (i.v, "v"), (i.dout, "dout")] {
        x.layout.check(shape, x.ptr, 16, name)?;
    }
    i.out
        .layout
        .check(shape, i.out.ptr, 4, "the forward's output")?;
    for (ptr, name) in grads.iter().zip(["dq", "dk", "dv"]) {
        layout.check(shape, *ptr, 4, name)?;
    }
    forward::check_lse(i.lse)?;
    if shape.is_empty() {
        return Ok(());
    }
    // SAFETY: the caller's promise
    unsafe { launch_passes(gpu, configs, shape, dtype, inputs, grads, layout) }
}

/// δ, then the passes, writing to `grads` as `layout` says: the body of [`backward_with`] and
/// [`backward_into`], after their checks (every layout fits the shape; it is not empty).
///
/// # Safety
/// As [`backward_into`].
unsafe fn launch_passes(
    gpu: &Gpu,
    configs: BackwardConfigs,
    shape: Shape,
    dtype: Dtype,
    inputs: BackwardInputs,
    [dq, dk, dv]: [u64; 3],
    layout: Layout,
) -> Result<(), AttnError> {
    let d = shape.head_dim;
    for (entry, c) in [(HOPPER_DKDV, configs.dkdv), (HOPPER_DQ, configs.dq)] {
        if entry == HOPPER_DQ && configs.dkdv.dq_atomic {
            continue;
        }
        if !c.fits(d) {
            return Err(AttnError::Unsupported {
                what: format!(
                    "{entry}'s block shape {} takes {} bytes of shared memory at head dim {d}: more than a multiprocessor's {SMEM_PER_SM}",
                    c.name(),
                    c.smem_bytes(d)
                ),
            });
        }
        // the grid's limit, before anything is launched
        c.grid(shape)?;
    }
    let i = inputs;
    let rank = TmaRank::of(&[i.q.layout, i.k.layout, i.v.layout, i.dout.layout], shape);
    // a module per pass, shape and rank; δ's kernel, and the convert kernel with `dq_atomic`, are in
    // dkdv's module, under the same key, so the module is compiled once
    let kernel = |entry: &'static str, c: BackwardConfig| {
        let pass = if entry == HOPPER_DQ {
            HOPPER_DQ
        } else {
            HOPPER_DKDV
        };
        gpu.kernel(
            format!(
                "hopper backward {pass} {dtype:?} d{d} {} {rank:?}",
                c.name()
            ),
            entry,
            c.smem_bytes(d),
            || compile(dtype, d, pass, c, rank),
        )
    };
    let stream = gpu.stream();
    let rows = shape.batch * shape.heads * shape.tokens;
    let tokens = shape.tokens as i32;

    // δ, a warp a row, eight rows of one head a block
    let delta = {
        let f = kernel(HOPPER_DELTA, configs.dkdv)?;
        // SAFETY: the kernel writes every row's δ before the passes read it
        let mut delta = unsafe { stream.alloc::<f32>(rows) }
            .map_err(alloc_error("the backward's δ", rows as u128 * 4))?;
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&inputs.out.ptr)
            .arg(&inputs.out.layout)
            .arg(&inputs.dout.ptr)
            .arg(&inputs.dout.layout)
            .arg(&mut delta)
            .arg(&tokens);
        let config = LaunchConfig {
            grid_dim: (
                shape.tokens.div_ceil(8) as u32,
                (shape.batch * shape.heads) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the output and dO hold the shape's values where their layouts say (the
        // caller's promise); each warp reads one row of each and writes that row's δ, for
        // tokens below `tokens`; the grid's y is at most 65,535 (check_shape), its x at most
        // 2^27 (check_shape's 2^30 tokens)
        unsafe { launch.launch(config) }.map_err(device_error("launching hopper_delta"))?;
        delta
    };

    let scale = 1.0 / (d as f32).sqrt();
    let scale_log2 = shape.scale_log2();
    let launch_config = |c: BackwardConfig| {
        Ok::<_, AttnError>(LaunchConfig {
            grid_dim: c.grid(shape)?,
            block_dim: (c.threads(), 1, 1),
            shared_mem_bytes: c.smem_bytes(d),
        })
    };
    // a pass's kernel, with the register check of a producer warpgroup, and the maps of q,
    // k, v and dO, in boxes of `qdo_rows` rows (q, dO) and `kv_rows` rows (k, v)
    let pass = |entry: &'static str, c: BackwardConfig, qdo_rows: usize, kv_rows: usize| {
        let f = kernel(entry, c)?;
        if c.producer_warpgroup {
            check_register_pool(&f, c.warpgroups, c.producer_registers(), c.threads(), entry)?;
        }
        // SAFETY: the caller's promise
        let maps = unsafe {
            [
                tensor_map(i.q, dtype, shape, qdo_rows, rank)?,
                tensor_map(i.k, dtype, shape, kv_rows, rank)?,
                tensor_map(i.v, dtype, shape, kv_rows, rank)?,
                tensor_map(i.dout, dtype, shape, qdo_rows, rank)?,
            ]
        };
        Ok::<_, AttnError>((f, maps))
    };

    // dK and dV: the block's keys and values, the queries and dO streamed
    let c = configs.dkdv;
    let (f, maps) = pass(HOPPER_DKDV, c, c.stream, c.block_rows())?;
    // dkdv's f32 dQ sums with `dq_atomic` (starting at zero), else no buffer
    let dq_accum = if c.dq_atomic {
        let n = c.dq_accum_len(shape);
        Some(
            stream
                .alloc_zeros::<f32>(n)
                .map_err(alloc_error("the backward's f32 dq sums", n as u128 * 4))?,
        )
    } else {
        None
    };
    let no_buffer: u64 = 0;
    let mut launch = stream.launch_builder(&f);
    for map in &maps {
        launch.arg(map);
    }
    launch.arg(&inputs.lse).arg(&delta);
    launch.arg(&dk).arg(&dv).arg(&layout);
    match &dq_accum {
        Some(buf) => launch.arg(buf),
        None => launch.arg(&no_buffer),
    };
    launch.arg(&tokens).arg(&scale_log2).arg(&scale);
    let config = launch_config(c)?;
    // SAFETY: the maps read within q, k, v and dO (rows past a head's end read as zeros),
    // lse and δ hold a value a row; each block writes dk and dv for its own keys below
    // `tokens` only, where layout puts them (within its span: the caller's promise); the grid
    // is one block per block of keys of each head, its y at most 65,535 (checked above)
    unsafe { launch.launch(config) }.map_err(device_error("launching hopper_dkdv"))?;

    if let Some(acc) = &dq_accum {
        let f = kernel(HOPPER_DQ_CONVERT, c)?;
        // a thread takes two values of dQ, or with `dq_warp` eight
        let items = match c.dq_mode() {
            3 | 4 => c.dq_accum_len(shape) / 8,
            _ => shape.len() / 2,
        } as i64;
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(acc)
            .arg(&dq)
            .arg(&layout)
            .arg(&tokens)
            .arg(&items)
            .arg(&scale);
        let config = LaunchConfig {
            grid_dim: ((items as u64).div_ceil(256).min(65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: acc holds dq_accum_len values in f32: a value per value of dQ, or with
        // `dq_warp` 64 rows of every block of 64 queries, eight values for each of `items`
        // threads (the head dim is 64 or 128); each thread reads its own values and writes
        // them to dq where layout puts them, for rows below `tokens` only, within its span
        // (the caller's promise)
        unsafe { launch.launch(config) }.map_err(device_error("launching hopper_dq_convert"))?;
        return Ok(());
    }

    // dQ: the block's queries and dO, the keys and values streamed
    let c = configs.dq;
    let (f, maps) = pass(HOPPER_DQ, c, c.block_rows(), c.stream)?;
    let mut launch = stream.launch_builder(&f);
    for map in &maps {
        launch.arg(map);
    }
    launch.arg(&inputs.lse).arg(&delta);
    launch.arg(&dq).arg(&layout);
    launch.arg(&tokens).arg(&scale_log2).arg(&scale);
    let config = launch_config(c)?;
    // SAFETY: as for dkdv; each block writes dq for its own queries below `tokens` only
    unsafe { launch.launch(config) }.map_err(device_error("launching hopper_dq"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `for_shape` and `deterministic` pick at any length is a candidate pair, so the GPU
    /// tests, `hopper-check` and `hopper-kernel-check` cover it; and no two pairs share a name.
    #[test]
    fn the_defaults_are_candidates_with_names_of_their_own() {
        for d in forward::HEAD_DIMS {
            let all = BackwardConfigs::candidates(d);
            for t in [1, 2048, 4096, 4097, 8192, 8193, 1 << 14, 1 << 20] {
                for c in [
                    BackwardConfigs::for_shape(t, d),
                    BackwardConfigs::deterministic(t, d),
                ] {
                    assert!(
                        all.contains(&c),
                        "{t} d{d}: {} is not a candidate",
                        c.name()
                    );
                }
            }
            let names: std::collections::HashSet<_> = all.iter().map(|c| c.name()).collect();
            assert_eq!(names.len(), all.len(), "d{d}: two pairs share a name");
        }
    }

    #[test]
    fn longest_first_swaps_the_grid_and_names_its_limit() {
        let one = BackwardConfigs::for_shape(1 << 14, 64).dkdv;
        let lf = BackwardConfigs::for_shape(1000, 64).dkdv;
        assert_eq!(lf, one.with_longest_first());
        let s = Shape::new(4, 12, 1000, 64);
        assert_eq!(one.grid(s).unwrap(), (8, 48, 1));
        assert_eq!(lf.grid(s).unwrap(), (48, 8, 1));
        let long = Shape::new(1, 1, 65_536 * 128, 64);
        assert!(one.grid(long).is_ok());
        let e = lf.grid(long).unwrap_err().to_string();
        assert!(
            e.contains("65,535 blocks of 128 rows") && e.contains("65536"),
            "{e}"
        );
    }
}
