//! `kernels/train.cu`, compiled by NVRTC once per process and GPU architecture, and a
//! launch function for each of its kernels, in the model's terms: device pointers (as
//! `u64`s) and sizes. The pointers come from buffers the trainer allocated once for its
//! batch shape.
//!
//! # Safety
//!
//! Every launch function is `unsafe` with one contract: each pointer it is given must hold
//! at least the values the sizes it is given say (see `kernels/train.cu` for each
//! argument), in device memory of the trainer's GPU, and nothing else may write them while
//! the kernel runs.
#![allow(clippy::missing_safety_doc)]

use std::borrow::Cow;
use std::sync::Arc;

use flash_core::AttnError;
use step03_cuda_forward::gpu::cudarc::driver::sys::CUfunction_attribute;
use step03_cuda_forward::gpu::cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use step03_cuda_forward::gpu::{Gpu, KernelSpec, compile, device_error};

use crate::TrainError;

/// The kernels' source, embedded so that binaries carry it wherever they run.
pub const TRAIN_CU: &str = include_str!("../../kernels/train.cu");

/// The build of [`TRAIN_CU`]: the block shapes the host launches, which the kernels' shared
/// arrays and launch bounds are sized for.
#[derive(Clone, Copy, Debug)]
pub struct TrainKernels;

impl KernelSpec for TrainKernels {
    fn name(&self) -> String {
        "train.cu".into()
    }

    fn source(&self) -> Cow<'_, str> {
        TRAIN_CU.into()
    }

    fn defines(&self) -> Vec<String> {
        vec![
            format!("-DGELU_LANES={GELU_LANES}"),
            format!("-DLN_BACKWARD_WARPS={LN_BACKWARD_WARPS}"),
        ]
    }
}

/// Warps per block of the LayerNorm backward (its shared memory holds `3·C` sums per warp).
pub const LN_BACKWARD_WARPS: u32 = 4;
/// The widths, in chunks of 4 values per lane (128 columns each), of the LayerNorm kernels
/// that hold a row in registers (`layernorm_forward_K`, `layernorm_backward_K`); wider rows
/// take `layernorm_forward` and `layernorm_backward`, which read a row once per pass.
pub const LN_REGISTER_CHUNKS: [usize; 5] = [1, 2, 4, 6, 8];
/// Rows a block of the GELU backward takes at once, one per 32 threads (given to train.cu
/// as `GELU_LANES`).
const GELU_LANES: u32 = 8;
/// Blocks of the gradients' norm's first pass.
pub const NORM_BLOCKS: u32 = 1024;

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device pointer (0 for null).
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// The compiled kernels, and the stream they run on.
pub struct Kernels {
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    embed_forward: CudaFunction,
    embed_backward_pos: CudaFunction,
    embed_backward_tok: CudaFunction,
    layernorm_forward: CudaFunction,
    layernorm_backward: CudaFunction,
    // one of each per width of LN_REGISTER_CHUNKS, in its order
    layernorm_forward_registers: Vec<CudaFunction>,
    layernorm_backward_registers: Vec<CudaFunction>,
    reduce_partials: CudaFunction,
    bias_gelu: CudaFunction,
    gelu_backward: CudaFunction,
    qkv_to_heads: CudaFunction,
    heads_rows: CudaFunction,
    heads_to_qkv: CudaFunction,
    column_sums: CudaFunction,   // [step 06]
    sum_kv_groups: CudaFunction, // [step 08]
    cross_entropy: CudaFunction,
    sum_scaled: CudaFunction,
    sumsq_partial: CudaFunction,
    norm_finish: CudaFunction,
    adamw: CudaFunction,
    to_bf16: CudaFunction,
}

fn dev(what: String) -> TrainError {
    TrainError::Device(AttnError::Device { what })
}

/// A grid of `n` threads in blocks of `threads`.
fn grid(n: u64, threads: u32) -> Result<LaunchConfig, TrainError> {
    let blocks = n.div_ceil(threads as u64);
    let blocks = u32::try_from(blocks.max(1))
        .map_err(|_| dev(format!("{n} threads: more blocks than a grid takes")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A block per row, each thread moving `chunks` 16-byte chunks of the row among as many
/// threads as there are chunks (in warps), at most 256.
fn per_row(rows: usize, chunks: usize) -> Result<LaunchConfig, TrainError> {
    let blocks = u32::try_from(rows.max(1))
        .map_err(|_| dev(format!("{rows} rows: more blocks than a grid takes")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (chunks.next_multiple_of(32).clamp(32, 256) as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl Kernels {
    /// Compiles and loads the kernels on `gpu`; the LayerNorm backward may take the shared
    /// memory a residual stream `d_model` wide needs.
    pub fn load(gpu: &Gpu, d_model: usize) -> Result<Kernels, TrainError> {
        let ptx = compile(&TrainKernels, gpu.arch()).map_err(TrainError::Device)?;
        let module = gpu
            .context()
            .load_module(ptx)
            .map_err(|e| TrainError::Device(device_error("loading train.cu")(e)))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| TrainError::Device(device_error(name)(e)))
        };
        // the LayerNorm backwards may take the shared memory d_model asks for
        let with_smem = |name: &str| {
            let k = f(name)?;
            k.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                Self::ln_backward_smem(d_model) as i32,
            )
            .map_err(|e| {
                TrainError::Device(device_error(&format!(
                    "allowing {name} its shared memory (d_model too wide?)"
                ))(e))
            })?;
            Ok::<_, TrainError>(k)
        };
        let layernorm_backward = with_smem("layernorm_backward")?;
        let mut layernorm_forward_registers = Vec::new();
        let mut layernorm_backward_registers = Vec::new();
        for k in LN_REGISTER_CHUNKS {
            layernorm_forward_registers.push(f(&format!("layernorm_forward_{k}"))?);
            layernorm_backward_registers
                .push(with_smem(&format!("layernorm_backward_{k}"))?);
        }
        Ok(Kernels {
            stream: gpu.stream().clone(),
            embed_forward: f("embed_forward")?,
            embed_backward_pos: f("embed_backward_pos")?,
            embed_backward_tok: f("embed_backward_tok")?,
            layernorm_forward: f("layernorm_forward")?,
            layernorm_backward,
            layernorm_forward_registers,
            layernorm_backward_registers,
            reduce_partials: f("reduce_partials")?,
            bias_gelu: f("bias_gelu")?,
            gelu_backward: f("gelu_backward")?,
            qkv_to_heads: f("qkv_to_heads")?,
            heads_rows: f("heads_rows")?,
            heads_to_qkv: f("heads_to_qkv")?,
            column_sums: f("column_sums")?,     // [step 06]
            sum_kv_groups: f("sum_kv_groups")?, // [step 08]
            cross_entropy: f("cross_entropy")?,
            sum_scaled: f("sum_scaled")?,
            sumsq_partial: f("sumsq_partial")?,
            norm_finish: f("norm_finish")?,
            adamw: f("adamw")?,
            to_bf16: f("to_bf16")?,
            _module: module,
        })
    }

    /// Dynamic shared memory of the LayerNorm backward: `3·C` f32 sums per warp.
    pub fn ln_backward_smem(d_model: usize) -> u32 {
        (LN_BACKWARD_WARPS as usize * 3 * d_model * 4) as u32
    }

    /// The position in [`LN_REGISTER_CHUNKS`] of the narrowest LayerNorm kernels that hold
    /// a row `c` wide in registers; `None` past the widest.
    pub fn ln_registers(c: usize) -> Option<usize> {
        LN_REGISTER_CHUNKS.iter().position(|&k| c <= 128 * k)
    }

    /// Launches `f` with `args`.
    ///
    /// # Safety
    /// The arguments must be what the kernel takes, every pointer holding what the sizes
    /// say.
    unsafe fn launch(
        &self,
        f: &CudaFunction,
        name: &str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), TrainError> {
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(x) => b.arg(x),
                Arg::I32(x) => b.arg(x),
                Arg::I64(x) => b.arg(x),
                Arg::F32(x) => b.arg(x),
            };
        }
        // SAFETY: the caller's
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| TrainError::Device(device_error(name)(e)))
    }

    // Each function below launches the kernel of its name; see kernels/train.cu for what
    // each argument holds, and the module's doc for the contract.

    /// `x = wte[tokens] + wpe[t]`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn embed_forward(
        &self,
        tokens: u64,
        wte: u64,
        wpe: u64,
        x: u64,
        rows: usize,
        t: usize,
        c: usize,
    ) -> Result<(), TrainError> {
        let total = (rows * c) as u64;
        let args = [
            Arg::Ptr(tokens),
            Arg::Ptr(wte),
            Arg::Ptr(wpe),
            Arg::Ptr(x),
            Arg::I32(t as i32),
            Arg::I32(c as i32),
            Arg::I64(total as i64),
        ];
        unsafe {
            self.launch(
                &self.embed_forward,
                "embed_forward",
                grid(total, 256)?,
                &args,
            )
        }
    }

    /// `dwpe[t] = Σ_b dx[b·T + t]`, zero past `t`.
    pub unsafe fn embed_backward_pos(
        &self,
        dx: u64,
        dwpe: u64,
        (b, t, c): (usize, usize, usize),
        context: usize,
    ) -> Result<(), TrainError> {
        let total = (context * c) as u64;
        let args = [
            Arg::Ptr(dx),
            Arg::Ptr(dwpe),
            Arg::I32(b as i32),
            Arg::I32(t as i32),
            Arg::I32(c as i32),
            Arg::I64(total as i64),
        ];
        unsafe {
            self.launch(
                &self.embed_backward_pos,
                "embed_backward_pos",
                grid(total, 256)?,
                &args,
            )
        }
    }

    /// `dwte[v] += Σ dx[rows of token v]`.
    pub unsafe fn embed_backward_tok(
        &self,
        dx: u64,
        order: u64,
        offsets: u64,
        dwte: u64,
        vocab: usize,
        c: usize,
    ) -> Result<(), TrainError> {
        let cfg = LaunchConfig {
            grid_dim: (c.div_ceil(32) as u32, vocab as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::Ptr(dx),
            Arg::Ptr(order),
            Arg::Ptr(offsets),
            Arg::Ptr(dwte),
            Arg::I32(c as i32),
        ];
        unsafe { self.launch(&self.embed_backward_tok, "embed_backward_tok", cfg, &args) }
    }

    /// LayerNorm of `res` (+ `y` + `y_bias` when `y` is not 0, kept in `x`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn layernorm_forward(
        &self,
        res: u64,
        y: u64,
        y_bias: u64,
        x: u64,
        (w, b): (u64, u64),
        out: u64,
        (mean, rstd): (u64, u64),
        rows: usize,
        c: usize,
    ) -> Result<(), TrainError> {
        let args = [
            Arg::Ptr(res),
            Arg::Ptr(y),
            Arg::Ptr(y_bias),
            Arg::Ptr(x),
            Arg::Ptr(w),
            Arg::Ptr(b),
            Arg::Ptr(out),
            Arg::Ptr(mean),
            Arg::Ptr(rstd),
            Arg::I32(rows as i32),
            Arg::I32(c as i32),
        ];
        let (f, name) = match Self::ln_registers(c) {
            Some(i) => (
                &self.layernorm_forward_registers[i],
                format!("layernorm_forward_{}", LN_REGISTER_CHUNKS[i]),
            ),
            None => (&self.layernorm_forward, "layernorm_forward".to_string()),
        };
        // a warp per row, 8 a block
        unsafe { self.launch(f, &name, grid(rows as u64 * 32, 256)?, &args) }
    }

    /// The blocks [`Kernels::layernorm_backward`] runs for `rows` rows: the rows of its
    /// `partial` buffer.
    pub fn ln_backward_blocks(rows: usize) -> usize {
        // about 16 rows a warp, so that the sums each warp then hands on are few; on an
        // H200 GPT-2-small's 24,576 rows are 384 blocks, which all fit on its 132 SMs at
        // once
        rows.div_ceil(LN_BACKWARD_WARPS as usize * 16)
            .clamp(1, 1024)
    }

    /// LayerNorm's backward: `dres_out = dres_in + dx` (f32 and bf16); the column sums of
    /// `dw`, `db` and `dres_out` (the gradient of the bias of the product that joined the
    /// residual stream at `x`), through `partial` (`[ln_backward_blocks(rows), 3C]`),
    /// written to `outs` (0: not wanted).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn layernorm_backward(
        &self,
        dy: u64,
        x: u64,
        w: u64,
        (mean, rstd): (u64, u64),
        dres_in: u64,
        (dres_out, dres_out_bf16): (u64, u64),
        partial: u64,
        outs: [u64; 3],
        rows: usize,
        c: usize,
    ) -> Result<(), TrainError> {
        let cfg = LaunchConfig {
            grid_dim: (Self::ln_backward_blocks(rows) as u32, 1, 1),
            block_dim: (LN_BACKWARD_WARPS * 32, 1, 1),
            shared_mem_bytes: Self::ln_backward_smem(c),
        };
        let args = [
            Arg::Ptr(dy),
            Arg::Ptr(x),
            Arg::Ptr(w),
            Arg::Ptr(mean),
            Arg::Ptr(rstd),
            Arg::Ptr(dres_in),
            Arg::Ptr(dres_out),
            Arg::Ptr(dres_out_bf16),
            Arg::Ptr(partial),
            Arg::I32(rows as i32),
            Arg::I32(c as i32),
        ];
        let parts = Self::ln_backward_blocks(rows);
        let (f, name) = match Self::ln_registers(c) {
            Some(i) => (
                &self.layernorm_backward_registers[i],
                format!("layernorm_backward_{}", LN_REGISTER_CHUNKS[i]),
            ),
            None => (&self.layernorm_backward, "layernorm_backward".to_string()),
        };
        unsafe {
            self.launch(f, &name, cfg, &args)?;
            self.reduce_partials(partial, parts, 3 * c, c, outs)
        }
    }

    /// Rows of partial sums (chunks of rows) the kernels that sum gradients' columns along
    /// the way use for `rows` rows.
    pub fn colsum_parts(rows: usize) -> usize {
        rows.div_ceil(64).clamp(1, 256)
    }

    /// A grid of `block`-shaped blocks that each take `columns` of the `k` columns, by
    /// [`Kernels::colsum_parts`] chunks of rows; and the chunk. Every kernel that sums
    /// columns along the way takes its rows in these chunks, so `partial` has the same rows
    /// for all.
    fn column_grid(
        rows: usize,
        k: usize,
        columns: usize,
        block: (u32, u32, u32),
    ) -> (LaunchConfig, usize) {
        let parts = Self::colsum_parts(rows);
        let cfg = LaunchConfig {
            grid_dim: (k.div_ceil(columns) as u32, parts as u32, 1),
            block_dim: block,
            shared_mem_bytes: 0,
        };
        (cfg, rows.div_ceil(parts))
    }

    /// `out_j[c] = Σ_p partial[p, j·width + c]` for the runs of `width` columns of `k`, to
    /// `outs[j]` (0: skipped).
    pub unsafe fn reduce_partials(
        &self,
        partial: u64,
        parts: usize,
        k: usize,
        width: usize,
        outs: [u64; 3],
    ) -> Result<(), TrainError> {
        let args = [
            Arg::Ptr(partial),
            Arg::I32(parts as i32),
            Arg::I32(k as i32),
            Arg::I32(width as i32),
            Arg::Ptr(outs[0]),
            Arg::Ptr(outs[1]),
            Arg::Ptr(outs[2]),
        ];
        let cfg = LaunchConfig {
            grid_dim: (k.div_ceil(32) as u32, 1, 1),
            block_dim: (32, 16, 1),
            shared_mem_bytes: 0,
        };
        unsafe { self.launch(&self.reduce_partials, "reduce_partials", cfg, &args) }
    }

    /// `out = gelu(fc + bias)` over `[rows, k]`, `k` a multiple of 8.
    pub unsafe fn bias_gelu(
        &self,
        fc: u64,
        bias: u64,
        out: u64,
        rows: usize,
        k: usize,
    ) -> Result<(), TrainError> {
        let args = [
            Arg::Ptr(fc),
            Arg::Ptr(bias),
            Arg::Ptr(out),
            Arg::I32(k as i32),
        ];
        unsafe { self.launch(&self.bias_gelu, "bias_gelu", per_row(rows, k / 8)?, &args) }
    }

    /// In one pass over `[rows, k]`: `d ← d ∘ gelu'(fc + bias)`, `out = gelu(fc + bias)`
    /// (what [`Kernels::bias_gelu`] writes), and the new `d`'s column sums into `bias_grad`
    /// through `partial` (`[colsum_parts(rows), k]`); `k` a multiple of 8.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gelu_backward(
        &self,
        d: u64,
        fc: u64,
        bias: u64,
        out: u64,
        partial: u64,
        bias_grad: u64,
        rows: usize,
        k: usize,
    ) -> Result<(), TrainError> {
        // blocks of 32 × GELU_LANES threads, 8 columns a thread: 256 columns by a chunk of
        // rows
        let (cfg, chunk) = Self::column_grid(rows, k, 256, (32, GELU_LANES, 1));
        let args = [
            Arg::Ptr(d),
            Arg::Ptr(fc),
            Arg::Ptr(bias),
            Arg::Ptr(out),
            Arg::Ptr(partial),
            Arg::I32(rows as i32),
            Arg::I32(k as i32),
            Arg::I32(chunk as i32),
        ];
        unsafe {
            self.launch(&self.gelu_backward, "gelu_backward", cfg, &args)?;
            self.reduce_partials(partial, Self::colsum_parts(rows), k, k, [bias_grad, 0, 0])
        }
    }

    /// The fused projection's `[B·T, width]` output plus its bias to q in `[B, H, T, D]`
    /// and k and v in `[B, kv, T, D]`: q's `C = H·D` columns, then k's and v's `(width −
    /// C) / 2` each (`kv` heads, as [`Config::qkv_width`](crate::model::Config::qkv_width)
    /// gives the width).
    pub unsafe fn qkv_to_heads(
        &self,
        qkv: u64,
        bias: u64,
        (q, k, v): (u64, u64, u64),
        (b, h, t, d): (usize, usize, usize, usize),
        width: usize,
    ) -> Result<(), TrainError> {
        let args = [
            Arg::Ptr(qkv),
            Arg::Ptr(bias),
            Arg::Ptr(q),
            Arg::Ptr(k),
            Arg::Ptr(v),
            Arg::I32(t as i32),
            Arg::I32(h as i32),
            Arg::I32(d as i32),
            Arg::I32(width as i32),
        ];
        let cfg = per_row(b * t, width / 8)?;
        unsafe { self.launch(&self.qkv_to_heads, "qkv_to_heads", cfg, &args) }
    }

    /// `[B, H, T, D]` to `[B·T, C]` rows (`to_rows`), or back.
    pub unsafe fn heads_rows(
        &self,
        src: u64,
        dst: u64,
        to_rows: bool,
        (b, h, t, d): (usize, usize, usize, usize),
    ) -> Result<(), TrainError> {
        let args = [
            Arg::Ptr(src),
            Arg::Ptr(dst),
            Arg::I32(to_rows as i32),
            Arg::I32(t as i32),
            Arg::I32(h as i32),
            Arg::I32(d as i32),
        ];
        let cfg = per_row(b * t, h * d / 8)?;
        unsafe { self.launch(&self.heads_rows, "heads_rows", cfg, &args) }
    }

    /// dq (`[B, H, T, D]`), dk and dv (k's and v's heads) to the fused projection's `[B·T,
    /// width]` gradient, and its column sums into `bias_grad` through `partial`
    /// (`[colsum_parts(rows), width]`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn heads_to_qkv(
        &self,
        (dq, dk, dv): (u64, u64, u64),
        dqkv: u64,
        partial: u64,
        bias_grad: u64,
        (b, h, t, d): (usize, usize, usize, usize),
        width: usize,
    ) -> Result<(), TrainError> {
        let rows = b * t;
        // 128 threads a block, a pair of columns each
        let (cfg, chunk) = Self::column_grid(rows, width, 256, (128, 1, 1));
        let args = [
            Arg::Ptr(dq),
            Arg::Ptr(dk),
            Arg::Ptr(dv),
            Arg::Ptr(dqkv),
            Arg::Ptr(partial),
            Arg::I32(t as i32),
            Arg::I32(h as i32),
            Arg::I32(d as i32),
            Arg::I32(width as i32),
            Arg::I32(rows as i32),
            Arg::I32(chunk as i32),
        ];
        unsafe {
            self.launch(&self.heads_to_qkv, "heads_to_qkv", cfg, &args)?;
            let parts = Self::colsum_parts(rows);
            self.reduce_partials(partial, parts, width, width, [bias_grad, 0, 0])
        }
    }

    // [step 06]
    /// The column sums of a bf16 `[rows, k]` matrix (`k` a multiple of 8) into `out`
    /// through `partial` (`[colsum_parts(rows), k]`): the fused projection's bias gradient
    /// when the attention's backward wrote `dqkv` itself.
    pub unsafe fn column_sums(
        &self,
        d: u64,
        partial: u64,
        out: u64,
        rows: usize,
        k: usize,
    ) -> Result<(), TrainError> {
        // 128 threads a block, 8 columns each
        let (cfg, chunk) = Self::column_grid(rows, k, 1024, (128, 1, 1));
        let args = [
            Arg::Ptr(d),
            Arg::Ptr(partial),
            Arg::I32(rows as i32),
            Arg::I32(k as i32),
            Arg::I32(chunk as i32),
        ];
        unsafe {
            self.launch(&self.column_sums, "column_sums", cfg, &args)?;
            self.reduce_partials(partial, Self::colsum_parts(rows), k, k, [out, 0, 0])
        }
    }
    // [/step 06]

    // [step 08]
    /// From step 06's backward's `[B·T, 3C]` gradient (dk and dv for every query head) to
    /// the fused projection's `[B·T, C + 2·kv·D]`, each group's dk and dv summed into its
    /// kv head.
    pub unsafe fn sum_kv_groups(
        &self,
        full: u64,
        dqkv: u64,
        rows: usize,
        (h, kv, d): (usize, usize, usize),
    ) -> Result<(), TrainError> {
        let args = [
            Arg::Ptr(full),
            Arg::Ptr(dqkv),
            Arg::I32(h as i32),
            Arg::I32(kv as i32),
            Arg::I32(d as i32),
        ];
        let cfg = per_row(rows, (h + 2 * kv) * d / 8)?;
        unsafe { self.launch(&self.sum_kv_groups, "sum_kv_groups", cfg, &args) }
    }
    // [/step 08]

    /// Per-row losses and (when `dlogits` is not 0) the logits' gradient, scaled by
    /// `scale`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn cross_entropy(
        &self,
        logits: u64,
        targets: u64,
        losses: u64,
        dlogits: u64,
        rows: usize,
        vocab: usize,
        scale: f32,
    ) -> Result<(), TrainError> {
        let args = [
            Arg::Ptr(logits),
            Arg::Ptr(targets),
            Arg::Ptr(losses),
            Arg::Ptr(dlogits),
            Arg::I32(rows as i32),
            Arg::I32(vocab as i32),
            Arg::F32(scale),
        ];
        unsafe {
            self.launch(
                &self.cross_entropy,
                "cross_entropy",
                grid(rows as u64 * 32, 256)?,
                &args,
            )
        }
    }

    /// `out[0] = scale · Σ x[..n]`.
    pub unsafe fn sum_scaled(
        &self,
        x: u64,
        n: usize,
        scale: f32,
        out: u64,
    ) -> Result<(), TrainError> {
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::Ptr(x),
            Arg::I32(n as i32),
            Arg::F32(scale),
            Arg::Ptr(out),
        ];
        unsafe { self.launch(&self.sum_scaled, "sum_scaled", cfg, &args) }
    }

    /// `out[0] = √(Σ g²)` over `n` values, through `partial` (`[NORM_BLOCKS]` f64).
    pub unsafe fn grad_norm(
        &self,
        g: u64,
        n: usize,
        partial: u64,
        out: u64,
    ) -> Result<(), TrainError> {
        let first = LaunchConfig {
            grid_dim: (NORM_BLOCKS, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let second = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe {
            self.launch(
                &self.sumsq_partial,
                "sumsq_partial",
                first,
                &[Arg::Ptr(g), Arg::I64(n as i64), Arg::Ptr(partial)],
            )?;
            self.launch(
                &self.norm_finish,
                "norm_finish",
                second,
                &[
                    Arg::Ptr(partial),
                    Arg::I32(NORM_BLOCKS as i32),
                    Arg::Ptr(out),
                ],
            )
        }
    }

    /// One AdamW step over the flat buffers; see `kernels/train.cu`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn adamw(
        &self,
        (p, g, m, v, p16): (u64, u64, u64, u64, u64),
        n: usize,
        decay_end: usize,
        norm: u64,
        max_norm: f32,
        lr: f32,
        (beta1, beta2, eps, weight_decay): (f32, f32, f32, f32),
        (c1, c2): (f32, f32),
    ) -> Result<(), TrainError> {
        let args = [
            Arg::Ptr(p),
            Arg::Ptr(g),
            Arg::Ptr(m),
            Arg::Ptr(v),
            Arg::Ptr(p16),
            Arg::I64(n as i64),
            Arg::I64(decay_end as i64),
            Arg::Ptr(norm),
            Arg::F32(max_norm),
            Arg::F32(lr),
            Arg::F32(beta1),
            Arg::F32(beta2),
            Arg::F32(eps),
            Arg::F32(weight_decay),
            Arg::F32(c1),
            Arg::F32(c2),
        ];
        // four values a thread: a grid a quarter of the buffer
        unsafe {
            self.launch(
                &self.adamw,
                "adamw",
                grid((n as u64).div_ceil(4), 256)?,
                &args,
            )
        }
    }

    /// `y = bf16(x)` over `n` values.
    pub unsafe fn to_bf16(&self, x: u64, y: u64, n: usize) -> Result<(), TrainError> {
        let args = [Arg::Ptr(x), Arg::Ptr(y), Arg::I64(n as i64)];
        unsafe { self.launch(&self.to_bf16, "to_bf16", grid(n as u64, 256)?, &args) }
    }
}
