//! `kernels/train.cu`, compiled by NVRTC once per process and GPU architecture, and a launch
//! function for each of its kernels, in the model's terms: device pointers (as `u64`s) and
//! sizes. The pointers come from buffers the trainer allocated once for its batch shape.
//!
//! # Safety
//!
//! Every launch function is `unsafe` with one contract: each pointer it is given must hold at
//! least the values the sizes it is given say (see `kernels/train.cu` for each argument), in
//! device memory of the trainer's GPU, and nothing else may write them while the kernel runs.
#![allow(clippy::missing_safety_doc)]

use std::sync::Arc;

use flash_core::AttnError;
use step03_cuda_forward::Gpu;
use step03_cuda_forward::cudarc::driver::sys::CUfunction_attribute;
use step03_cuda_forward::cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use step03_cuda_forward::cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use step03_cuda_forward::device_error;
use step03_cuda_forward::kernel::compile_error;

use crate::TrainError;

/// The kernels' source, embedded so that binaries carry it wherever they run.
pub const TRAIN_CU: &str = include_str!("../../kernels/train.cu");

/// Compiles [`TRAIN_CU`] for `arch` (`sm_90` on an H200).
pub fn compile(arch: &'static str) -> Result<Ptx, AttnError> {
    let options = CompileOptions {
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        name: Some("train.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(TRAIN_CU, options).map_err(|e| compile_error("train.cu", e))
}

/// Warps per block of the LayerNorm backward (its shared memory holds `2·C` sums per warp).
pub const LN_BACKWARD_WARPS: u32 = 4;
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
    colsum_partial_bf16: CudaFunction,
    colsum_partial_f32: CudaFunction,
    reduce_partials: CudaFunction,
    bias_gelu: CudaFunction,
    gelu_backward: CudaFunction,
    rows_to_heads: CudaFunction,
    heads_to_rows: CudaFunction,
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

impl Kernels {
    /// Compiles and loads the kernels on `gpu`; the LayerNorm backward may take the shared
    /// memory a residual stream `d_model` wide needs.
    pub fn load(gpu: &Gpu, d_model: usize) -> Result<Kernels, TrainError> {
        let ptx = compile(gpu.arch()).map_err(TrainError::Device)?;
        let module = gpu
            .context()
            .load_module(ptx)
            .map_err(|e| TrainError::Device(device_error("loading train.cu")(e)))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| TrainError::Device(device_error(name)(e)))
        };
        let layernorm_backward = f("layernorm_backward")?;
        layernorm_backward
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                Self::ln_backward_smem(d_model) as i32,
            )
            .map_err(|e| {
                TrainError::Device(device_error(
                    "allowing layernorm_backward its shared memory (d_model too wide?)",
                )(e))
            })?;
        Ok(Kernels {
            stream: gpu.stream().clone(),
            embed_forward: f("embed_forward")?,
            embed_backward_pos: f("embed_backward_pos")?,
            embed_backward_tok: f("embed_backward_tok")?,
            layernorm_forward: f("layernorm_forward")?,
            layernorm_backward,
            colsum_partial_bf16: f("colsum_partial_bf16")?,
            colsum_partial_f32: f("colsum_partial_f32")?,
            reduce_partials: f("reduce_partials")?,
            bias_gelu: f("bias_gelu")?,
            gelu_backward: f("gelu_backward")?,
            rows_to_heads: f("rows_to_heads")?,
            heads_to_rows: f("heads_to_rows")?,
            cross_entropy: f("cross_entropy")?,
            sum_scaled: f("sum_scaled")?,
            sumsq_partial: f("sumsq_partial")?,
            norm_finish: f("norm_finish")?,
            adamw: f("adamw")?,
            to_bf16: f("to_bf16")?,
            _module: module,
        })
    }

    /// Dynamic shared memory of the LayerNorm backward: `2·C` f32 sums per warp.
    pub fn ln_backward_smem(d_model: usize) -> u32 {
        (LN_BACKWARD_WARPS as usize * 2 * d_model * 4) as u32
    }

    /// Launches `f` with `args`.
    ///
    /// # Safety
    /// The arguments must be what the kernel takes, every pointer holding what the sizes say.
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

    // Each function below launches the kernel of its name; see kernels/train.cu for what each
    // argument holds, and the module's doc for the contract.

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
        // a warp per row, 8 a block
        unsafe {
            self.launch(
                &self.layernorm_forward,
                "layernorm_forward",
                grid(rows as u64 * 32, 256)?,
                &args,
            )
        }
    }

    /// The blocks [`Kernels::layernorm_backward`] runs for `rows` rows: the rows of its
    /// `partial` buffer.
    pub fn ln_backward_blocks(rows: usize) -> usize {
        // at least 8 rows a warp, at most 512 blocks
        rows.div_ceil(LN_BACKWARD_WARPS as usize * 8).clamp(1, 512)
    }

    /// LayerNorm's backward: `dres_out = dres_in + dx` (f32 and bf16), and per-block sums of
    /// `dw` and `db` into `partial` (`[ln_backward_blocks(rows), 2C]`).
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
        unsafe { self.launch(&self.layernorm_backward, "layernorm_backward", cfg, &args) }
    }

    /// Rows of partial sums [`Kernels::colsum`] uses for `rows` rows.
    pub fn colsum_parts(rows: usize) -> usize {
        rows.div_ceil(64).clamp(1, 256)
    }

    /// `out[c] = Σ_rows m[row, c]` of a `[rows, k]` matrix (bf16 or f32), through `partial`
    /// (`[colsum_parts(rows), k]`). Overwrites `out`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn colsum(
        &self,
        m: u64,
        bf16: bool,
        rows: usize,
        k: usize,
        partial: u64,
        out: u64,
    ) -> Result<(), TrainError> {
        let parts = Self::colsum_parts(rows);
        let chunk = rows.div_ceil(parts);
        let cfg = LaunchConfig {
            grid_dim: (k.div_ceil(256) as u32, parts as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::Ptr(m),
            Arg::Ptr(partial),
            Arg::I32(rows as i32),
            Arg::I32(k as i32),
            Arg::I32(chunk as i32),
        ];
        let (f, name) = if bf16 {
            (&self.colsum_partial_bf16, "colsum_partial_bf16")
        } else {
            (&self.colsum_partial_f32, "colsum_partial_f32")
        };
        unsafe {
            self.launch(f, name, cfg, &args)?;
            self.reduce_partials(partial, parts, k, k, out, 0)
        }
    }

    /// `out_a[c] = Σ_p partial[p, c]` for `c < split`, `out_b[c − split]` for the rest.
    pub unsafe fn reduce_partials(
        &self,
        partial: u64,
        parts: usize,
        k: usize,
        split: usize,
        out_a: u64,
        out_b: u64,
    ) -> Result<(), TrainError> {
        let args = [
            Arg::Ptr(partial),
            Arg::I32(parts as i32),
            Arg::I32(k as i32),
            Arg::I32(split as i32),
            Arg::Ptr(out_a),
            Arg::Ptr(out_b),
        ];
        unsafe {
            self.launch(
                &self.reduce_partials,
                "reduce_partials",
                grid(k as u64, 256)?,
                &args,
            )
        }
    }

    /// `fc += bias` in place, `out = gelu(fc)`.
    pub unsafe fn bias_gelu(
        &self,
        fc: u64,
        bias: u64,
        out: u64,
        rows: usize,
        k: usize,
    ) -> Result<(), TrainError> {
        let pairs = (rows * k / 2) as u64;
        let args = [
            Arg::Ptr(fc),
            Arg::Ptr(bias),
            Arg::Ptr(out),
            Arg::I64(pairs as i64),
            Arg::I32(k as i32),
        ];
        unsafe { self.launch(&self.bias_gelu, "bias_gelu", grid(pairs, 256)?, &args) }
    }

    /// `d ← d ∘ gelu'(fc)` over `len` values.
    pub unsafe fn gelu_backward(&self, d: u64, fc: u64, len: usize) -> Result<(), TrainError> {
        let pairs = (len / 2) as u64;
        let args = [Arg::Ptr(d), Arg::Ptr(fc), Arg::I64(pairs as i64)];
        unsafe {
            self.launch(
                &self.gelu_backward,
                "gelu_backward",
                grid(pairs, 256)?,
                &args,
            )
        }
    }

    /// `[B·T, stride]` rows (from `rows`, plus `bias` if not 0) to `[B, H, T, D]` heads.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rows_to_heads(
        &self,
        rows: u64,
        stride: usize,
        bias: u64,
        heads: u64,
        (b, h, t, d): (usize, usize, usize, usize),
    ) -> Result<(), TrainError> {
        let pairs = (b * h * t * d / 2) as u64;
        let args = [
            Arg::Ptr(rows),
            Arg::I32(stride as i32),
            Arg::Ptr(bias),
            Arg::Ptr(heads),
            Arg::I32(t as i32),
            Arg::I32(h as i32),
            Arg::I32(d as i32),
            Arg::I64(pairs as i64),
        ];
        unsafe {
            self.launch(
                &self.rows_to_heads,
                "rows_to_heads",
                grid(pairs, 256)?,
                &args,
            )
        }
    }

    /// `[B, H, T, D]` heads back to `[B·T, stride]` rows.
    pub unsafe fn heads_to_rows(
        &self,
        heads: u64,
        rows: u64,
        stride: usize,
        (b, h, t, d): (usize, usize, usize, usize),
    ) -> Result<(), TrainError> {
        let pairs = (b * h * t * d / 2) as u64;
        let args = [
            Arg::Ptr(heads),
            Arg::Ptr(rows),
            Arg::I32(stride as i32),
            Arg::I32(t as i32),
            Arg::I32(h as i32),
            Arg::I32(d as i32),
            Arg::I64(pairs as i64),
        ];
        unsafe {
            self.launch(
                &self.heads_to_rows,
                "heads_to_rows",
                grid(pairs, 256)?,
                &args,
            )
        }
    }

    /// Per-row losses and (when `dlogits` is not 0) the logits' gradient, scaled by `scale`.
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
