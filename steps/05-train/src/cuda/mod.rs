//! The GPU trainer: the same model as [`crate::model`], on the GPU, with step 03's forward
//! kernel and step 04's backward kernels as its attention.
//!
//! Matrix products go to cuBLAS (bf16 operands, f32 accumulation, [`gemm`]); every other
//! layer is a kernel of `kernels/train.cu` ([`kernels`]); the weights, their gradients and
//! AdamW's moments live in flat `f32` buffers ([`layout`]). Every buffer a step needs is
//! allocated once, for the batch's shape, when the trainer is made; a step then only
//! launches work on one stream and reads two numbers back at its end, the loss and the
//! gradients' norm.
//!
//! ## Mixed precision
//!
//! As PyTorch's autocast to bf16 does: the master weights, their gradients, AdamW's
//! moments, the residual stream, LayerNorm's statistics, the logits and the loss are `f32`;
//! the products read bf16 operands (the weights' bf16 copy, which the AdamW kernel writes
//! with each step, and bf16 activations) and accumulate in `f32`. A product writes bf16
//! when its result feeds only another product or the attention, `f32` when it is a weight's
//! gradient or adds into the residual stream or a LayerNorm's backward.
//!
//! ## Layout
//!
//! - [`GpuTrainer`]: the buffers, [`GpuTrainer::forward`], [`GpuTrainer::backward`],
//!   [`GpuTrainer::optimizer_step`], and the [`Learner`] the training loop drives.
//! - [`gemm`]: the products, in row-major terms.
//! - [`kernels`]: `kernels/train.cu` and its launches.
//! - [`layout`]: where each weight sits in the flat buffers.
//! - [`parallel`]: one replica on each of several GPUs, their gradients averaged by NCCL. // [step 07]

pub mod gemm;
pub mod kernels;
pub mod layout;
pub mod parallel; // [step 07]

use std::time::Instant;

use flash_core::{AttnError, Shape};
use ndarray::ArrayView2;
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::cudarc::driver::sys::{
    CUevent_flags, CUmemPool_attribute, CUmemoryPool, CUresult, cuDeviceGetDefaultMemPool,
    cuMemPoolGetAttribute, cuMemPoolSetAttribute,
};
use step03_cuda_forward::gpu::cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu, alloc_error, device_error};
use step04_backward::cuda::DeviceGrads;

use crate::TrainError;
use crate::checkpoint::Checkpoint;
use crate::data::{Batch, Corpus, train_batch};
use crate::model::{Config, Params};
use crate::optim::AdamW;
use crate::train::{Hardware, Learner, PhaseRecord, Settings, StepRecord, Trainer};
use gemm::{Blas, Out, plain, transposed};
use kernels::{Kernels, NORM_BLOCKS};
use layout::Layout;
// [step 06]
use step06_hopper::kernel::ForwardKernel;
use step06_hopper::layout::{Layout as HeadLayout, Strided};

/// q, k and v where the fused projection `[B · T, 3C]` at `ptr` holds them: each third's
/// first column, a row of heads per token.
fn fused_thirds(ptr: u64, shape: Shape) -> [Strided; 3] {
    let third = (shape.heads * shape.head_dim * 2) as u64; // bytes
    [0, 1, 2].map(|i| Strided {
        ptr: ptr + i * third,
        layout: HeadLayout::fused_rows(shape),
    })
}
// [/step 06]
// [step 08]

/// [`fused_thirds`] when k and v have `kv_heads` heads each (grouped-query attention): q's
/// `C` columns, then k's and v's `kv_heads · head_dim` each, in rows of
/// [`Config::qkv_width`] columns.
fn fused_grouped(ptr: u64, shape: Shape, kv_heads: usize) -> [Strided; 3] {
    let d = shape.head_dim;
    let (c, kc) = (shape.heads * d, kv_heads * d);
    let at = |col: usize, heads: usize| Strided {
        ptr: ptr + 2 * col as u64,
        layout: HeadLayout::fused_grouped(shape, kv_heads, heads),
    };
    [at(0, shape.heads), at(c, kv_heads), at(c + kc, kv_heads)]
}
// [/step 08]

/// Which attention the model runs on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Step 03's forward kernel, which keeps each row's log-sum-exp, and step 04's backward
    /// kernels, which rebuild the probabilities from it: no `T × T` table.
    Flash,
    /// Step 03's attention by hand (cuBLAS and a softmax kernel, the whole table of scores
    /// in memory) and step 04's backward by hand (the probabilities and their gradient, two
    /// whole tables), as PyTorch's eager attention runs.
    ByHand,
    // [step 06]
    /// Step 06's kernels: the forward and the backward with Hopper's products (compute
    /// capability 9.0), the same output, log-sum-exp and gradients as `Flash`.
    Hopper,
    // [/step 06]
}

impl AttentionKind {
    /// The name the command line and the run's record use.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Flash => "flash",
            AttentionKind::ByHand => "by-hand",
            AttentionKind::Hopper => "hopper", // [step 06]
        }
    }
}

// ANCHOR: attention_calls
/// The attention's forward: `out` and `lse` into `att` (flash), or a new one (by hand).
fn attention_forward(
    gpu: &Gpu,
    kind: AttentionKind,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    att: &mut Option<DeviceAttention>,
) -> Result<(), AttnError> {
    match (kind, att.as_mut()) {
        (AttentionKind::Flash, Some(result)) => gpu.forward_into(q, k, v, result),
        _ => {
            *att = Some(match kind {
                AttentionKind::Flash => gpu.forward(q, k, v)?,
                AttentionKind::ByHand => gpu.by_hand(q, k, v)?,
                // [step 06]
                // step 06's layers keep the fused projection (AttentionActs::Fused): its
                // kernels read q, k and v there, and no layer of that kind comes here
                AttentionKind::Hopper => unreachable!("read from the fused projection"),
                // [/step 06]
            });
            Ok(())
        }
    }
}

/// The attention's backward: dq, dk, dv from q, k, v, what the forward kept (its output and
/// each row's log-sum-exp) and the output's gradient.
fn attention_backward(
    gpu: &Gpu,
    kind: AttentionKind,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    match kind {
        AttentionKind::Flash => step04_backward::cuda::backward(gpu, q, k, v, fwd, dout),
        AttentionKind::ByHand => {
            step04_backward::cuda_by_hand::backward(gpu, q, k, v, fwd, dout)
        }
        AttentionKind::Hopper => unreachable!("hopper layers read the fused projection"), // [step 06]
    }
}
// ANCHOR_END: attention_calls

/// A device buffer and its address, kept so that launches can pass addresses without
/// borrowing the buffer.
struct Buf<T> {
    _slice: CudaSlice<T>,
    ptr: u64,
}

fn dptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(
    gpu: &Gpu,
    len: usize,
    what: &str,
) -> Result<Buf<T>, TrainError> {
    let bytes = (len.max(1) * std::mem::size_of::<T>()) as u128;
    let slice = gpu
        .stream()
        .alloc_zeros::<T>(len.max(1))
        .map_err(|e| TrainError::Device(alloc_error(what, bytes)(e)))?;
    let ptr = dptr(&slice, gpu.stream());
    Ok(Buf { _slice: slice, ptr })
}

fn tensor(gpu: &Gpu, shape: Shape, what: &str) -> Result<DeviceTensor, TrainError> {
    let data = gpu
        .stream()
        .alloc_zeros::<u16>(shape.len())
        .map_err(|e| TrainError::Device(alloc_error(what, shape.len() as u128 * 2)(e)))?;
    Ok(DeviceTensor {
        data,
        shape,
        dtype: Dtype::Bf16,
    })
}

/// What one block's forward keeps for its backward.
struct LayerActs {
    /// `[rows, C]` f32: the block's input, the residual stream.
    x: Buf<f32>,
    /// `[rows, C]` bf16, and each row's mean and `1/σ`.
    ln1: Buf<u16>,
    ln1_mean: Buf<f32>,
    ln1_rstd: Buf<f32>,
    /// What the attention reads and keeps for its backward.
    attn: AttentionActs,
    /// `[rows, C]` bf16: the attention's output back in rows, the projection's input.
    att_rows: Buf<u16>,
    /// `[rows, C]` f32: `x + attention`, the MLP half's input.
    x_mid: Buf<f32>,
    ln2: Buf<u16>,
    ln2_mean: Buf<f32>,
    ln2_rstd: Buf<f32>,
    /// `[rows, 4C]` bf16: the MLP's first product (its bias not added). GELU's output is
    /// not kept: the backward computes it again from this (see [`Scratch::gelu`]).
    fc: Buf<u16>,
}

/// What a layer's attention reads and keeps for its backward.
// one a layer: the variants' difference in size (a few hundred bytes) does not matter
#[allow(clippy::large_enum_variant)]
enum AttentionActs {
    /// q, k and v, `[B, H, T, D]` bf16 each as the attention kernels take them, moved there
    /// from the fused projection's output; the attention's output and log-sum-exp (flash),
    /// or its output and probabilities (by hand, allocated by its forward). With q, k and
    /// v, all the backward needs.
    Heads {
        q: DeviceTensor,
        k: DeviceTensor,
        v: DeviceTensor,
        att: Option<DeviceAttention>,
    },
    // [step 06]
    /// The fused projection's output itself, `[rows, qkv_width]` bf16 with its bias, and
    /// each row's log-sum-exp, `[B, H, T]` f32: step 06's kernels read q, k and v where the
    /// projection wrote them and write the output straight into the rows the output
    /// projection reads (`att_rows`), so nothing is moved.
    Fused { qkv: Buf<u16>, lse: Buf<f32> },
    // [/step 06]
}

/// Buffers used within a step and reused by every layer.
struct Scratch {
    /// `[rows, qkv_width]` bf16: the fused projection's output, before the re-layout.
    qkv: Buf<u16>,
    /// `[rows, 4C]` bf16: a layer's GELU output, the MLP's second product's input. One
    /// buffer for every layer: the forward uses it at once, and the backward's GELU kernel,
    /// which reads the layer's `fc` anyway for the gradient through GELU, writes it again
    /// for the output projection's weight gradient. Keeping it per layer instead would take
    /// `rows × 4C × 2` bytes a layer (151 MB at GPT-2-small's shape and 12 × 2,048 tokens,
    /// 1.8 GB over 12 layers) to save writing it once more a layer; llm.c recomputes GELU
    /// by default for the same reason.
    gelu: Buf<u16>,
    /// `[rows, C]` f32: a product that adds into the residual stream.
    y: Buf<f32>,
    /// `[rows, C]`: the residual stream's gradient, f32 and bf16, after an MLP half and
    /// after an attention half.
    dres: Buf<f32>,
    dres16: Buf<u16>,
    dmid: Buf<f32>,
    dmid16: Buf<u16>,
    /// `[rows, C]` f32: a LayerNorm output's gradient.
    dln: Buf<f32>,
    /// `[rows, 4C]` bf16: the gradient of the GELU's output, then of its input.
    dbig: Buf<u16>,
    /// `[rows, C]` bf16: the attention output's gradient in rows, then in heads.
    datt_rows: Buf<u16>,
    dout: DeviceTensor,
    /// `[rows, qkv_width]` bf16: dq, dk, dv back in the fused projection's columns.
    dqkv: Buf<u16>,
    // [step 08]
    /// `[rows, 3C]` bf16 with grouped heads and step 06's kernels (else empty): dq, and dk
    /// and dv for every query head, as those kernels write them, before each group's are
    /// summed into `dqkv`.
    dqkv_heads: Buf<u16>,
    // [/step 08]
    /// Partial sums of LayerNorm and bias gradients.
    ln_partial: Buf<f32>,
    col_partial: Buf<f32>,
    norm_partial: Buf<f64>,
    /// `[rows]` f32: each token's loss.
    losses: Buf<f32>,
    /// `[2]` f32: the loss and the gradients' norm, the only numbers a step reads back.
    scalars: Buf<f32>,
}

impl LayerActs {
    /// Layer `l`'s buffers for `config` at q's `shape`, with `attention`'s.
    fn alloc(
        gpu: &Gpu,
        l: usize,
        config: &Config,
        shape: Shape,
        attention: AttentionKind,
    ) -> Result<LayerActs, TrainError> {
        let rows = shape.batch * shape.tokens;
        let c = config.d_model;
        // k's and v's shape: q's
        let kv_shape = shape;
        // [step 08]
        // or q's with fewer heads, each shared by a group of q's (grouped-query attention)
        let kv_shape = Shape {
            heads: config.kv_heads,
            ..kv_shape
        };
        // [/step 08]
        let what = |x: &str| format!("layer {l}'s {x}");
        let f = |len: usize, x: &str| alloc::<f32>(gpu, len, &what(x));
        let b16 = |len: usize, x: &str| alloc::<u16>(gpu, len, &what(x));
        Ok(LayerActs {
            x: f(rows * c, "input")?,
            ln1: b16(rows * c, "first LayerNorm")?,
            ln1_mean: f(rows, "first LayerNorm's means")?,
            ln1_rstd: f(rows, "first LayerNorm's 1/σ")?,
            attn: match attention {
                // [step 06]
                AttentionKind::Hopper => AttentionActs::Fused {
                    qkv: b16(rows * config.qkv_width(), "q, k and v")?,
                    lse: f(rows * shape.heads, "attention log-sum-exps")?,
                },
                // [/step 06]
                AttentionKind::Flash | AttentionKind::ByHand => AttentionActs::Heads {
                    q: tensor(gpu, shape, &what("q"))?,
                    k: tensor(gpu, kv_shape, &what("k"))?,
                    v: tensor(gpu, kv_shape, &what("v"))?,
                    att: match attention {
                        AttentionKind::Flash => Some(
                            gpu.alloc_output(shape, Dtype::Bf16)
                                .map_err(TrainError::Device)?,
                        ),
                        _ => None,
                    },
                },
            },
            att_rows: b16(rows * c, "attention output")?,
            x_mid: f(rows * c, "residual stream between its halves")?,
            ln2: b16(rows * c, "second LayerNorm")?,
            ln2_mean: f(rows, "second LayerNorm's means")?,
            ln2_rstd: f(rows, "second LayerNorm's 1/σ")?,
            fc: b16(rows * 4 * c, "MLP pre-activation")?,
        })
    }
}

impl Scratch {
    /// The step's buffers for `config` at q's `shape`.
    fn alloc(
        gpu: &Gpu,
        config: &Config,
        shape: Shape,
        // [step 08]
        attention: AttentionKind,
        // [/step 08]
    ) -> Result<Scratch, TrainError> {
        let rows = shape.batch * shape.tokens;
        let c = config.d_model;
        let width = config.qkv_width();
        Ok(Scratch {
            qkv: alloc(gpu, rows * width, "the fused projection's output")?,
            gelu: alloc(gpu, rows * 4 * c, "the GELU output")?,
            y: alloc(gpu, rows * c, "a product's output")?,
            dres: alloc(gpu, rows * c, "the residual stream's gradient")?,
            dres16: alloc(gpu, rows * c, "the residual stream's gradient in bf16")?,
            dmid: alloc(gpu, rows * c, "the residual stream's gradient")?,
            dmid16: alloc(gpu, rows * c, "the residual stream's gradient in bf16")?,
            dln: alloc(gpu, rows * c, "a LayerNorm's gradient")?,
            dbig: alloc(gpu, rows * 4 * c, "the MLP's gradient")?,
            datt_rows: alloc(gpu, rows * c, "the attention output's gradient")?,
            dout: tensor(gpu, shape, "the attention output's gradient")?,
            dqkv: alloc(gpu, rows * width, "the fused projection's gradient")?,
            // [step 08]
            dqkv_heads: alloc(
                gpu,
                match attention == AttentionKind::Hopper && config.kv_heads != shape.heads {
                    true => rows * 3 * c,
                    false => 0,
                },
                "the attention's gradients for every query head",
            )?,
            // [/step 08]
            ln_partial: alloc(
                gpu,
                Kernels::ln_backward_blocks(rows) * 3 * c,
                "LayerNorm gradients' partial sums",
            )?,
            col_partial: alloc(
                gpu,
                Kernels::colsum_parts(rows) * 4 * c,
                "bias gradients' partial sums",
            )?,
            norm_partial: alloc(gpu, NORM_BLOCKS as usize, "the norm's partial sums")?,
            losses: alloc(gpu, rows, "the losses")?,
            scalars: alloc(gpu, 2, "the step's loss and norm")?,
        })
    }
}

/// CUDA events between the phases of a step, for `--profile`.
struct Profiler {
    enabled: bool,
    events: Vec<CudaEvent>,
    names: Vec<&'static str>,
    used: usize,
    /// Milliseconds per phase name, summed over profiled steps, in the order first seen.
    totals: Vec<(&'static str, f64)>,
    steps: usize,
    /// Steps seen: the first is left out (it compiles the attention kernels).
    seen: usize,
}

impl Profiler {
    fn mark(&mut self, gpu: &Gpu, name: &'static str) -> Result<(), TrainError> {
        if !self.enabled {
            return Ok(());
        }
        if self.used == self.events.len() {
            let e = gpu
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| TrainError::Device(device_error("creating an event")(e)))?;
            self.events.push(e);
            self.names.push(name);
        }
        self.events[self.used]
            .record(gpu.stream())
            .map_err(|e| TrainError::Device(device_error("recording an event")(e)))?;
        self.names[self.used] = name;
        self.used += 1;
        Ok(())
    }

    /// After the stream has finished a step: adds the time between marks to each phase.
    fn finish_step(&mut self) -> Result<(), TrainError> {
        if !self.enabled {
            return Ok(());
        }
        self.seen += 1;
        if self.seen > 1 {
            for i in 1..self.used {
                let ms = self.events[i - 1]
                    .elapsed_ms(&self.events[i])
                    .map_err(|e| TrainError::Device(device_error("reading an event")(e)))?
                    as f64;
                let name = self.names[i];
                match self.totals.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, t)) => *t += ms,
                    None => self.totals.push((name, ms)),
                }
            }
            self.steps += 1;
        }
        self.used = 0;
        Ok(())
    }
}

// ANCHOR: gpu_trainer
/// The model, its optimizer and its activations on the GPU, for one batch shape.
pub struct GpuTrainer {
    gpu: &'static Gpu,
    kernels: Kernels,
    blas: Blas,
    pub config: Config,
    pub batch: usize,
    pub seq_len: usize,
    pub attention: AttentionKind,
    pub layout: Layout,
    /// The flat buffers of [`Layout`]: master weights, their bf16 copy, gradients, moments.
    params: Buf<f32>,
    params16: Buf<u16>,
    grads: Buf<f32>,
    m: Buf<f32>,
    v: Buf<f32>,
    adamw: crate::optim::AdamWSettings,
    /// AdamW's steps so far.
    t: u64,
    /// Training steps so far.
    pub step: usize,
    layers: Vec<LayerActs>,
    /// `[rows, C]` f32: the residual stream after the last block, and its LayerNorm.
    x_final: Buf<f32>,
    lnf: Buf<u16>,
    lnf_mean: Buf<f32>,
    lnf_rstd: Buf<f32>,
    /// `[rows, V]`: the logits (f32) and their gradient (bf16).
    logits: Buf<f32>,
    dlogits: Buf<u16>,
    s: Scratch,
    /// `[2·rows]` u8: the batch's inputs then its targets; `[rows + V + 1]` i32: the rows
    /// sorted by input token, then where each token's rows start (the embedding's
    /// backward).
    batch_u8: Buf<u8>,
    batch_i32: Buf<i32>,
    profiler: Profiler,
    /// Bytes of every buffer allocated here (the attention's own allocations aside).
    pub bytes: u64,
}
// ANCHOR_END: gpu_trainer

// [step 08]
/// That `attention` takes `config`'s heads: attention by hand on the GPU takes one key and
/// value head per query head, the other kernels grouped heads too.
pub fn check_heads(config: &Config, attention: AttentionKind) -> Result<(), TrainError> {
    if config.kv_heads != config.heads && attention == AttentionKind::ByHand {
        return Err(TrainError::Config(format!(
            "kv_heads {} of heads {}: attention by hand on the GPU takes one key and value \
             head per query head; a model with grouped heads trains with --attention flash \
             or hopper",
            config.kv_heads, config.heads
        )));
    }
    Ok(())
}
// [/step 08]

/// Bytes a trainer of `config` for `batch × seq_len` allocates: weights, gradients,
/// moments, activations and scratch (the attention's own temporaries aside).
pub fn bytes_needed(config: &Config, batch: usize, seq_len: usize) -> u64 {
    let (c, v, h) = (
        config.d_model as u64,
        config.vocab as u64,
        config.heads as u64,
    );
    let rows = (batch * seq_len) as u64;
    let width = config.qkv_width() as u64;
    let params = Layout::new(*config).len as u64 * (4 * 4 + 2);
    let per_layer = rows * c * (4 * 2 + 2 * 3 + 2 * 4)
        + rows * 4 * c * 2
        + rows * 4 * 4
        + batch as u64 * h * seq_len as u64 * 4;
    let last = rows * c * (4 + 2) + rows * 8 + rows * v * (4 + 2) + rows * 4;
    let ln_parts = Kernels::ln_backward_blocks(rows as usize) as u64;
    let col_parts = Kernels::colsum_parts(rows as usize) as u64;
    let scratch = rows * width * 2 * 2
        + rows * c * (4 + 4 + 2 + 4 + 2 + 4 + 2 + 2)
        + rows * 4 * c * 2 * 2
        + ln_parts * 3 * c * 4
        + col_parts * 4 * c * 4
        + NORM_BLOCKS as u64 * 8
        + rows * 2
        + (rows + v + 1) * 4;
    // [step 08]
    // grouped heads: step 06's dk and dv for every query head before their groups' sums
    let scratch = match config.kv_heads == config.heads {
        true => scratch,
        false => scratch + rows * 3 * c * 2,
    };
    // [/step 08]
    params + config.layers as u64 * per_layer + last + scratch
}

fn pool(gpu: &Gpu) -> Result<CUmemoryPool, TrainError> {
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the driver is loaded (a Gpu exists); writes one handle
    match unsafe { cuDeviceGetDefaultMemPool(&mut pool, gpu.context().cu_device()) } {
        CUresult::CUDA_SUCCESS => Ok(pool),
        e => Err(TrainError::Device(AttnError::Device {
            what: format!("finding the memory pool: {e:?}"),
        })),
    }
}

fn pool_attribute(
    gpu: &Gpu,
    attr: CUmemPool_attribute,
    set: Option<u64>,
) -> Result<u64, TrainError> {
    if !gpu.context().has_async_alloc() {
        return Ok(0);
    }
    let pool = pool(gpu)?;
    let mut value = set.unwrap_or(0);
    // SAFETY: reads or writes one u64 attribute of the device's default pool
    let r = unsafe {
        match set {
            Some(_) => cuMemPoolSetAttribute(pool, attr, (&mut value as *mut u64).cast()),
            None => cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast()),
        }
    };
    match r {
        CUresult::CUDA_SUCCESS => Ok(value),
        e => Err(TrainError::Device(AttnError::Device {
            what: format!("the memory pool's {attr:?}: {e:?}"),
        })),
    }
}

/// That the trainer takes `config` at `batch × seq_len` tokens a step with `attention`;
/// checked before the GPU is opened.
fn check_shape(
    config: &Config,
    batch: usize,
    seq_len: usize,
    attention: AttentionKind,
) -> Result<(), TrainError> {
    config.check()?;
    let (c, h) = (config.d_model, config.heads);
    let d = c / h;
    if seq_len > config.context || batch == 0 || seq_len == 0 {
        return Err(TrainError::Config(format!(
            "batch {batch} × seq_len {seq_len}: each must be at least 1, and seq_len at most the context {}",
            config.context
        )));
    }
    if !c.is_multiple_of(8) {
        return Err(TrainError::Config(format!(
            "d_model {c}: the GPU trainer takes a multiple of 8 (16-byte rows of bf16 for the products)"
        )));
    }
    if !d.is_multiple_of(8) {
        return Err(TrainError::Config(format!(
            "head dim {d} (d_model {c} / heads {h}): the GPU trainer moves heads 8 values at a time, so it takes a multiple of 8"
        )));
    }
    if attention == AttentionKind::Flash && !step04_backward::cuda::HEAD_DIMS.contains(&d) {
        return Err(TrainError::Config(format!(
            "head dim {d} (d_model {c} / heads {h}): step 04's backward kernels take head dims {:?}",
            step04_backward::cuda::HEAD_DIMS
        )));
    }
    // [step 06]
    if attention == AttentionKind::Hopper && !step06_hopper::kernel::HEAD_DIMS.contains(&d)
    {
        return Err(TrainError::Config(format!(
            "head dim {d} (d_model {c} / heads {h}): step 06's Hopper kernels take head dims {:?}",
            step06_hopper::kernel::HEAD_DIMS
        )));
    }
    // [/step 06]
    check_heads(config, attention)?; // [step 08]
    if Kernels::ln_backward_smem(c) > 200 * 1024 {
        return Err(TrainError::Config(format!(
            "d_model {c}: the LayerNorm backward's shared memory takes d_model up to 6400"
        )));
    }
    Ok(())
}

/// Sets `gpu`'s stream and memory pool up for a trainer of `config` at `batch × seq_len`
/// tokens a step, and returns the bytes it needs; an error, before anything is allocated,
/// when they are more than the GPU has free.
fn prepare_device(
    gpu: &Gpu,
    config: &Config,
    batch: usize,
    seq_len: usize,
) -> Result<u64, TrainError> {
    // SAFETY: everything here runs on one stream, in order, so cudarc need not record
    // an event per buffer per launch to order streams
    unsafe { gpu.context().disable_event_tracking() };
    // memory the step's temporaries (the backward's dq, dk, dv, attention by hand's
    // table) give back stays in the pool for the next step instead of going back to the
    // driver
    pool_attribute(
        gpu,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        Some(u64::MAX),
    )?;
    // the high-water mark from here: what this trainer allocates
    pool_attribute(
        gpu,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        Some(0),
    )?;
    let needed = bytes_needed(config, batch, seq_len);
    let (free, total) = gpu
        .context()
        .mem_get_info()
        .map_err(|e| TrainError::Device(device_error("reading free memory")(e)))?;
    if needed > free as u64 {
        // the most sequences a step that fit in what is free, for the error to suggest
        let fits = (1..batch)
            .rev()
            .find(|&b| bytes_needed(config, b, seq_len) <= free as u64);
        let suggestion = match fits {
            Some(b) => {
                format!("at most {b} sequences a step fit on this GPU at this length")
            }
            None => "not even one sequence fits on this GPU at this length".into(),
        };
        // a run that cannot be on this GPU: said before anything is allocated
        return Err(TrainError::Config(format!(
            "out of memory on the GPU: the trainer needs {:.1} GB for {config:?} with {batch} × \
                     {seq_len} tokens a step (weights, gradients, AdamW's moments, every \
                     layer's activations), and the GPU has {:.1} GB free of {:.1} GB; \
                     {suggestion}",
            needed as f64 / 1e9,
            free as f64 / 1e9,
            total as f64 / 1e9
        )));
    }
    Ok(needed)
}

/// Where a tensor of the [`Layout`] starts on the device, by its offset: in the f32
/// weights, their bf16 copy, or the f32 gradients.
#[derive(Clone, Copy)]
struct Flat {
    params: u64,
    params16: u64,
    grads: u64,
}

impl Flat {
    fn w32(self, off: usize) -> u64 {
        self.params + 4 * off as u64
    }

    fn w16(self, off: usize) -> u64 {
        self.params16 + 2 * off as u64
    }

    fn g32(self, off: usize) -> u64 {
        self.grads + 4 * off as u64
    }

    /// The bias gradient of the MLP's output projection in block `l` (0 for none).
    fn fc_proj_b_grad(self, lay: &Layout, l: Option<usize>) -> u64 {
        l.map_or(0, |l| self.g32(lay.blocks[l].fc_proj_b))
    }
}

impl GpuTrainer {
    /// A trainer on GPU 0 that starts from `start` (its weights, AdamW's moments and step),
    /// for batches of `batch × seq_len` tokens. Fails, saying what is missing, without a
    /// GPU, its driver, NVRTC or cuBLAS; and, saying how much it needs and how much is
    /// free, when the GPU's memory cannot hold it.
    pub fn new(
        start: &Trainer,
        batch: usize,
        seq_len: usize,
        attention: AttentionKind,
        profile: bool,
    ) -> Result<GpuTrainer, TrainError> {
        // [step 07]
        GpuTrainer::build(None, start, batch, seq_len, attention, profile)
    }

    /// The same trainer on `gpu` ([`Gpu::shared_on`]) rather than GPU 0: a replica of data
    /// parallelism ([`parallel`]).
    pub fn new_on(
        gpu: &'static Gpu,
        start: &Trainer,
        batch: usize,
        seq_len: usize,
        attention: AttentionKind,
        profile: bool,
    ) -> Result<GpuTrainer, TrainError> {
        GpuTrainer::build(Some(gpu), start, batch, seq_len, attention, profile)
    }

    /// [`GpuTrainer::new`] on `on`, or on GPU 0.
    fn build(
        on: Option<&'static Gpu>,
        start: &Trainer,
        batch: usize,
        seq_len: usize,
        attention: AttentionKind,
        profile: bool,
    ) -> Result<GpuTrainer, TrainError> {
        // [/step 07]
        let config = start.params.config;
        check_shape(&config, batch, seq_len, attention)?;
        let gpu = Gpu::shared().map_err(TrainError::Device)?;
        // [step 07]
        // a replica on another GPU (GPU 0 is open already: the first replica's)
        let gpu = on.unwrap_or(gpu);
        // [/step 07]
        let needed = prepare_device(gpu, &config, batch, seq_len)?;
        let c = config.d_model;
        let kernels = Kernels::load(gpu, c)?;
        let blas = Blas::new(gpu)?;
        let layout = Layout::new(config);
        let n = layout.len;
        let rows = batch * seq_len;
        let shape = Shape::new(batch, config.heads, seq_len, c / config.heads);
        let stream = gpu.stream();
        let upload = |x: &[f32], what: &str| -> Result<Buf<f32>, TrainError> {
            let b = alloc::<f32>(gpu, n, what)?;
            let mut slice = b._slice;
            stream
                .memcpy_htod(x, &mut slice)
                .map_err(|e| TrainError::Device(device_error(what)(e)))?;
            Ok(Buf {
                _slice: slice,
                ptr: b.ptr,
            })
        };
        let params = upload(&layout.pack(&start.params), "the weights")?;
        let m = upload(&layout.pack(&start.opt.m), "AdamW's first moments")?;
        let v = upload(&layout.pack(&start.opt.v), "AdamW's second moments")?;
        let params16 = alloc::<u16>(gpu, n, "the weights' bf16 copy")?;
        let grads = alloc::<f32>(gpu, n, "the gradients")?;
        let layers = (0..config.layers)
            .map(|l| LayerActs::alloc(gpu, l, &config, shape, attention))
            .collect::<Result<Vec<_>, _>>()?;
        let v_len = config.vocab;
        // [step 08]
        // one argument a line, so that the stages before step 08 leave its argument out
        #[rustfmt::skip]
        // [/step 08]
        let s = Scratch::alloc(
            gpu,
            &config,
            shape,
            // [step 08]
            attention,
            // [/step 08]
        )?;
        let trainer = GpuTrainer {
            gpu,
            kernels,
            blas,
            config,
            batch,
            seq_len,
            attention,
            layout,
            params,
            params16,
            grads,
            m,
            v,
            adamw: start.opt.settings,
            t: start.opt.t,
            step: start.step,
            layers,
            x_final: alloc(gpu, rows * c, "the last residual stream")?,
            lnf: alloc(gpu, rows * c, "the last LayerNorm")?,
            lnf_mean: alloc(gpu, rows, "the last LayerNorm's means")?,
            lnf_rstd: alloc(gpu, rows, "the last LayerNorm's 1/σ")?,
            logits: alloc(gpu, rows * v_len, "the logits")?,
            dlogits: alloc(gpu, rows * v_len, "the logits' gradient")?,
            s,
            batch_u8: alloc(gpu, 2 * rows, "the batch")?,
            batch_i32: alloc(gpu, rows + v_len + 1, "the batch's rows by token")?,
            profiler: Profiler {
                enabled: profile,
                events: Vec::new(),
                names: Vec::new(),
                used: 0,
                totals: Vec::new(),
                steps: 0,
                seen: 0,
            },
            bytes: needed,
        };
        // SAFETY: both buffers hold layout.len values
        unsafe {
            trainer
                .kernels
                .to_bf16(trainer.params.ptr, trainer.params16.ptr, n)?;
        }
        trainer.sync()?;
        Ok(trainer)
    }

    /// The flat buffers' device addresses.
    fn flat(&self) -> Flat {
        Flat {
            params: self.params.ptr,
            params16: self.params16.ptr,
            grads: self.grads.ptr,
        }
    }

    /// Waits for the stream.
    fn sync(&self) -> Result<(), TrainError> {
        self.gpu
            .stream()
            .synchronize()
            .map_err(|e| TrainError::Device(device_error("running a step")(e)))
    }

    /// The GPU's name (`NVIDIA H200`).
    pub fn device_name(&self) -> String {
        self.gpu
            .context()
            .name()
            .unwrap_or_else(|_| "unknown GPU".into())
    }

    /// Copies a batch to the GPU, with its rows sorted by input token for the embedding's
    /// backward.
    fn upload_batch(
        &mut self,
        inputs: ArrayView2<u8>,
        targets: ArrayView2<u8>,
    ) -> Result<(), TrainError> {
        let (b, t) = inputs.dim();
        if (b, t) != (self.batch, self.seq_len) || targets.dim() != (b, t) {
            return Err(TrainError::Config(format!(
                "a batch of {b} × {t} tokens (targets {:?}), but the GPU trainer was made for {} × {}",
                targets.dim(),
                self.batch,
                self.seq_len
            )));
        }
        let vocab = self.config.vocab;
        let mut bytes: Vec<u8> = inputs.iter().copied().collect();
        if let Some(&bad) = bytes.iter().find(|&&x| x as usize >= vocab) {
            return Err(TrainError::Config(format!(
                "token {bad} is outside the model's vocabulary of {vocab}"
            )));
        }
        bytes.extend(targets.iter());
        // a counting sort of the rows by token
        let rows = b * t;
        let mut offsets = vec![0i32; vocab + 1];
        for &tok in &bytes[..rows] {
            offsets[tok as usize + 1] += 1;
        }
        for i in 0..vocab {
            offsets[i + 1] += offsets[i];
        }
        let mut next = offsets.clone();
        let mut ints = vec![0i32; rows + vocab + 1];
        for (row, &tok) in bytes[..rows].iter().enumerate() {
            ints[next[tok as usize] as usize] = row as i32;
            next[tok as usize] += 1;
        }
        ints[rows..].copy_from_slice(&offsets);
        let stream = self.gpu.stream();
        let copy = |e| TrainError::Device(device_error("copying the batch to the GPU")(e));
        stream
            .memcpy_htod(&bytes, &mut self.batch_u8._slice)
            .map_err(copy)?;
        stream
            .memcpy_htod(&ints, &mut self.batch_i32._slice)
            .map_err(copy)?;
        Ok(())
    }

    // ANCHOR: gpu_forward
    /// The forward pass over the uploaded batch, keeping what the backward needs; the mean
    /// loss lands in device memory. With `train`, also the logits' gradient.
    pub fn forward(&mut self, train: bool) -> Result<(), TrainError> {
        self.forward_embedding()?;
        for l in 0..self.layers.len() {
            self.forward_layernorm_1(l)?;
            self.forward_attention(l)?;
            self.forward_mlp(l)?;
        }
        self.forward_logits(train)
    }

    /// The first block's input: each token's embedding plus its position's.
    fn forward_embedding(&mut self) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            kernels: k,
            config,
            batch,
            seq_len,
            layout: lay,
            layers,
            batch_u8,
            profiler: prof,
            ..
        } = self;
        let (t, c) = (*seq_len, config.d_model);
        let rows = *batch * t;
        let tokens = batch_u8.ptr;
        // SAFETY (every launch and product of the forward): each pointer is a buffer
        // allocated in GpuTrainer::new for this batch shape, or an offset into the flat
        // weights that the layout gives for a tensor of the size used
        unsafe {
            prof.mark(gpu, "start")?;
            k.embed_forward(
                tokens,
                f.w32(lay.wte),
                f.w32(lay.wpe),
                layers[0].x.ptr,
                rows,
                t,
                c,
            )?;
            prof.mark(gpu, "embedding")?;
        }
        Ok(())
    }

    /// Block `l`'s first LayerNorm, in which the residual connection of the block before
    /// closes: its input `x` is the block before's `x_mid` plus its MLP's output.
    fn forward_layernorm_1(&mut self, l: usize) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            kernels: k,
            config,
            batch,
            seq_len,
            layout: lay,
            layers,
            s,
            profiler: prof,
            ..
        } = self;
        let (rows, c) = (*batch * *seq_len, config.d_model);
        let w = lay.blocks[l];
        let (res, y, y_bias) = match l {
            0 => (layers[0].x.ptr, 0, 0),
            _ => (
                layers[l - 1].x_mid.ptr,
                s.y.ptr,
                f.w32(lay.blocks[l - 1].fc_proj_b),
            ),
        };
        let la = &layers[l];
        // SAFETY: as in forward_embedding
        unsafe {
            k.layernorm_forward(
                res,
                y,
                y_bias,
                la.x.ptr,
                (f.w32(w.ln_1_w), f.w32(w.ln_1_b)),
                la.ln1.ptr,
                (la.ln1_mean.ptr, la.ln1_rstd.ptr),
                rows,
                c,
            )?;
            prof.mark(gpu, "layernorm")?;
        }
        Ok(())
    }

    /// Block `l`'s attention, from its first LayerNorm `ln1`: the fused projection, then
    /// attention, its output in rows (`att_rows`).
    fn forward_attention(&mut self, l: usize) -> Result<(), TrainError> {
        let f = self.flat();
        let (ln1, att_rows) = (self.layers[l].ln1.ptr, self.layers[l].att_rows.ptr);
        match &mut self.layers[l].attn {
            // [step 06]
            AttentionActs::Fused { qkv, lse } => {
                let (qkv, lse) = (qkv.ptr, lse.ptr);
                self.forward_attention_fused(l, qkv, lse)
            }
            // [/step 06]
            AttentionActs::Heads { q, k: key, v, att } => {
                let GpuTrainer {
                    gpu,
                    kernels: k,
                    blas,
                    config,
                    batch,
                    seq_len,
                    attention,
                    layout: lay,
                    s,
                    profiler: prof,
                    ..
                } = self;
                let (b, t, c, h) = (*batch, *seq_len, config.d_model, config.heads);
                let rows = b * t;
                let heads = (b, h, t, c / h);
                let width = config.qkv_width();
                let w = lay.blocks[l];
                let stream = gpu.stream();
                // SAFETY: as in forward_embedding
                unsafe {
                    blas.matmul(
                        rows,
                        width,
                        c,
                        plain(ln1),
                        plain(f.w16(w.attn_w)),
                        s.qkv.ptr,
                        Out::Bf16,
                        0.0,
                    )?;
                    prof.mark(gpu, "matmul: qkv")?;
                    // q, k, v: the fused projection's three column blocks, each with its
                    // bias
                    let qkv = (
                        dptr(&q.data, stream),
                        dptr(&key.data, stream),
                        dptr(&v.data, stream),
                    );
                    k.qkv_to_heads(s.qkv.ptr, f.w32(w.attn_b), qkv, heads, width)?;
                    prof.mark(gpu, "qkv to heads")?;
                    attention_forward(gpu, *attention, q, key, v, att)?;
                    prof.mark(gpu, "attention")?;
                    let out = &att.as_ref().expect("the forward wrote it").out;
                    k.heads_rows(dptr(&out.data, stream), att_rows, true, heads)?;
                    prof.mark(gpu, "heads to rows")?;
                }
                Ok(())
            }
        }
    }

    // [step 06]
    /// [`GpuTrainer::forward_attention`] through step 06's kernel, writing block `l`'s
    /// fused projection into `qkv` and its log-sum-exps into `lse`.
    fn forward_attention_fused(
        &mut self,
        l: usize,
        qkv: u64,
        lse: u64,
    ) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            blas,
            config,
            batch,
            seq_len,
            layout: lay,
            layers,
            profiler: prof,
            ..
        } = self;
        let (b, t, c, h) = (*batch, *seq_len, config.d_model, config.heads);
        let rows = b * t;
        let width = config.qkv_width();
        let shape = Shape::new(b, h, t, c / h);
        let w = lay.blocks[l];
        let la = &layers[l];
        // SAFETY: as in forward_embedding
        unsafe {
            // the bias added as cuBLASLt writes the product
            blas.matmul_bias(
                rows,
                width,
                c,
                plain(la.ln1.ptr),
                plain(f.w16(w.attn_w)),
                f.w16(w.attn_b),
                qkv,
            )?;
            prof.mark(gpu, "matmul: qkv")?;
            let kernel = ForwardKernel::for_shape(shape, h);
            let thirds = fused_thirds(qkv, shape);
            // [step 08]
            // grouped heads: k's and v's columns are fewer
            let kv = config.kv_heads;
            let (kernel, thirds) = match kv == h {
                true => (kernel, thirds),
                false => (
                    ForwardKernel::for_shape(shape, kv),
                    fused_grouped(qkv, shape, kv),
                ),
            };
            // [/step 08]
            // (inside this unsafe block) qkv holds rows · width bf16 values, each third's
            // span (Layout::span) ends inside it; att_rows holds rows · C, lse rows · H f32,
            // apart from qkv and each other
            step06_hopper::forward::forward_into(
                gpu,
                kernel,
                shape,
                Dtype::Bf16,
                thirds,
                Strided {
                    ptr: la.att_rows.ptr,
                    layout: HeadLayout::rows(shape),
                },
                lse,
            )?;
            prof.mark(gpu, "attention")?;
        }
        Ok(())
    }
    // [/step 06]

    /// Block `l`'s attention output projection, its second LayerNorm (the attention half's
    /// residual connection closes in it) and its MLP; the MLP's output is left in `y`, for
    /// the next LayerNorm to add to `x_mid`.
    fn forward_mlp(&mut self, l: usize) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            kernels: k,
            blas,
            config,
            batch,
            seq_len,
            layout: lay,
            layers,
            s,
            profiler: prof,
            ..
        } = self;
        let (rows, c) = (*batch * *seq_len, config.d_model);
        let w = lay.blocks[l];
        let la = &layers[l];
        // SAFETY: as in forward_embedding
        unsafe {
            blas.matmul(
                rows,
                c,
                c,
                plain(la.att_rows.ptr),
                plain(f.w16(w.proj_w)),
                s.y.ptr,
                Out::F32,
                0.0,
            )?;
            prof.mark(gpu, "matmul: attention projection")?;
            k.layernorm_forward(
                la.x.ptr,
                s.y.ptr,
                f.w32(w.proj_b),
                la.x_mid.ptr,
                (f.w32(w.ln_2_w), f.w32(w.ln_2_b)),
                la.ln2.ptr,
                (la.ln2_mean.ptr, la.ln2_rstd.ptr),
                rows,
                c,
            )?;
            prof.mark(gpu, "layernorm")?;
            blas.matmul(
                rows,
                4 * c,
                c,
                plain(la.ln2.ptr),
                plain(f.w16(w.fc_w)),
                la.fc.ptr,
                Out::Bf16,
                0.0,
            )?;
            prof.mark(gpu, "matmul: mlp up")?;
            k.bias_gelu(la.fc.ptr, f.w32(w.fc_b), s.gelu.ptr, rows, 4 * c)?;
            prof.mark(gpu, "bias + gelu")?;
            blas.matmul(
                rows,
                c,
                4 * c,
                plain(s.gelu.ptr),
                plain(f.w16(w.fc_proj_w)),
                s.y.ptr,
                Out::F32,
                0.0,
            )?;
            prof.mark(gpu, "matmul: mlp down")?;
        }
        Ok(())
    }

    /// The last LayerNorm, the logits, and the mean cross-entropy loss into `scalars`; with
    /// `train`, the logits' gradient too.
    fn forward_logits(&mut self, train: bool) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            kernels: k,
            blas,
            config,
            batch,
            seq_len,
            layout: lay,
            layers,
            x_final,
            lnf,
            lnf_mean,
            lnf_rstd,
            logits,
            dlogits,
            s,
            batch_u8,
            profiler: prof,
            ..
        } = self;
        let (rows, c, vocab) = (*batch * *seq_len, config.d_model, config.vocab);
        let targets = batch_u8.ptr + rows as u64;
        let last = layers.last().expect("at least one layer");
        let fc_proj_b = f.w32(lay.blocks[layers.len() - 1].fc_proj_b);
        // SAFETY: as in forward_embedding
        unsafe {
            k.layernorm_forward(
                last.x_mid.ptr,
                s.y.ptr,
                fc_proj_b,
                x_final.ptr,
                (f.w32(lay.ln_f_w), f.w32(lay.ln_f_b)),
                lnf.ptr,
                (lnf_mean.ptr, lnf_rstd.ptr),
                rows,
                c,
            )?;
            prof.mark(gpu, "layernorm")?;
            // the output layer is the token embedding, transposed
            blas.matmul(
                rows,
                vocab,
                c,
                plain(lnf.ptr),
                transposed(f.w16(lay.wte)),
                logits.ptr,
                Out::F32,
                0.0,
            )?;
            prof.mark(gpu, "matmul: logits")?;
            let scale = 1.0 / rows as f32;
            let d_out = if train { dlogits.ptr } else { 0 };
            k.cross_entropy(logits.ptr, targets, s.losses.ptr, d_out, rows, vocab, scale)?;
            k.sum_scaled(s.losses.ptr, rows, scale, s.scalars.ptr)?;
            prof.mark(gpu, "cross-entropy")?;
        }
        Ok(())
    }
    // ANCHOR_END: gpu_forward

    // ANCHOR: gpu_backward
    /// The backward pass: every weight's gradient into the flat gradient buffer, each
    /// layer's backward in the reverse order of the forward, one sublayer at a time.
    pub fn backward(&mut self) -> Result<(), TrainError> {
        self.backward_logits()?;
        for l in (0..self.layers.len()).rev() {
            self.backward_mlp(l)?;
            self.backward_attention_projection(l)?;
            self.backward_attention(l)?;
            self.backward_qkv(l)?;
        }
        self.backward_embedding()
    }

    /// The output layer and the last LayerNorm: the residual gradient `dres` that the last
    /// block's backward starts from.
    fn backward_logits(&mut self) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            kernels: k,
            blas,
            config,
            batch,
            seq_len,
            layout: lay,
            layers,
            x_final,
            lnf,
            lnf_mean,
            lnf_rstd,
            dlogits,
            s,
            profiler: prof,
            ..
        } = self;
        let (rows, c, vocab) = (*batch * *seq_len, config.d_model, config.vocab);
        let last = layers.len() - 1;
        // SAFETY: as in forward
        unsafe {
            // logits = lnf · wteᵀ: dwte = dlogitsᵀ · lnf (the embedding adds its share at
            // the end), dlnf = dlogits · wte
            blas.matmul(
                vocab,
                c,
                rows,
                transposed(dlogits.ptr),
                plain(lnf.ptr),
                f.g32(lay.wte),
                Out::F32,
                0.0,
            )?;
            blas.matmul(
                rows,
                c,
                vocab,
                plain(dlogits.ptr),
                plain(f.w16(lay.wte)),
                s.dln.ptr,
                Out::F32,
                0.0,
            )?;
            prof.mark(gpu, "backward: matmul logits")?;
            // the last LayerNorm; the residual gradient it writes sums to the last block's
            // MLP output bias's gradient
            k.layernorm_backward(
                s.dln.ptr,
                x_final.ptr,
                f.w32(lay.ln_f_w),
                (lnf_mean.ptr, lnf_rstd.ptr),
                0,
                (s.dres.ptr, s.dres16.ptr),
                s.ln_partial.ptr,
                [
                    f.g32(lay.ln_f_w),
                    f.g32(lay.ln_f_b),
                    f.fc_proj_b_grad(lay, Some(last)),
                ],
                rows,
                c,
            )?;
            prof.mark(gpu, "backward: layernorm")?;
        }
        Ok(())
    }

    /// Block `l`'s MLP half, from `dres`, the gradient of the block's output: its output
    /// projection, GELU (with its input bias's gradient), its input projection, its
    /// LayerNorm (which adds the residual's share and gives dmid, the gradient of x_mid,
    /// whose column sums are the attention projection's bias gradient).
    fn backward_mlp(&mut self, l: usize) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            kernels: k,
            blas,
            config,
            batch,
            seq_len,
            layout: lay,
            layers,
            s,
            profiler: prof,
            ..
        } = self;
        let (rows, c) = (*batch * *seq_len, config.d_model);
        let w = lay.blocks[l];
        let la = &layers[l];
        // SAFETY: as in forward
        unsafe {
            // the gradient of GELU's output first: the GELU backward then writes GELU's
            // output again (not kept: see Scratch::gelu) in the pass that reads fc for the
            // gradient through GELU, and the weight gradient reads it after that
            blas.matmul(
                rows,
                4 * c,
                c,
                plain(s.dres16.ptr),
                transposed(f.w16(w.fc_proj_w)),
                s.dbig.ptr,
                Out::Bf16,
                0.0,
            )?;
            prof.mark(gpu, "backward: matmul mlp down")?;
            k.gelu_backward(
                s.dbig.ptr,
                la.fc.ptr,
                f.w32(w.fc_b),
                s.gelu.ptr,
                s.col_partial.ptr,
                f.g32(w.fc_b),
                rows,
                4 * c,
            )?;
            prof.mark(gpu, "backward: gelu")?;
            blas.matmul(
                4 * c,
                c,
                rows,
                transposed(s.gelu.ptr),
                plain(s.dres16.ptr),
                f.g32(w.fc_proj_w),
                Out::F32,
                0.0,
            )?;
            prof.mark(gpu, "backward: matmul mlp down")?;
            blas.matmul(
                c,
                4 * c,
                rows,
                transposed(la.ln2.ptr),
                plain(s.dbig.ptr),
                f.g32(w.fc_w),
                Out::F32,
                0.0,
            )?;
            blas.matmul(
                rows,
                c,
                4 * c,
                plain(s.dbig.ptr),
                transposed(f.w16(w.fc_w)),
                s.dln.ptr,
                Out::F32,
                0.0,
            )?;
            prof.mark(gpu, "backward: matmul mlp up")?;
            k.layernorm_backward(
                s.dln.ptr,
                la.x_mid.ptr,
                f.w32(w.ln_2_w),
                (la.ln2_mean.ptr, la.ln2_rstd.ptr),
                s.dres.ptr,
                (s.dmid.ptr, s.dmid16.ptr),
                s.ln_partial.ptr,
                [f.g32(w.ln_2_w), f.g32(w.ln_2_b), f.g32(w.proj_b)],
                rows,
                c,
            )?;
            prof.mark(gpu, "backward: layernorm")?;
        }
        Ok(())
    }

    /// Block `l`'s attention half, the same way, starting with the attention's output
    /// projection: its weight's gradient, and the attention output's gradient `datt_rows`.
    fn backward_attention_projection(&mut self, l: usize) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            blas,
            config,
            batch,
            seq_len,
            layout: lay,
            layers,
            s,
            profiler: prof,
            ..
        } = self;
        let (rows, c) = (*batch * *seq_len, config.d_model);
        let w = lay.blocks[l];
        let la = &layers[l];
        // SAFETY: as in forward
        unsafe {
            blas.matmul(
                c,
                c,
                rows,
                transposed(la.att_rows.ptr),
                plain(s.dmid16.ptr),
                f.g32(w.proj_w),
                Out::F32,
                0.0,
            )?;
            blas.matmul(
                rows,
                c,
                c,
                plain(s.dmid16.ptr),
                transposed(f.w16(w.proj_w)),
                s.datt_rows.ptr,
                Out::Bf16,
                0.0,
            )?;
            prof.mark(gpu, "backward: matmul attention projection")?;
        }
        Ok(())
    }

    /// Block `l`'s attention: from `datt_rows`, the fused projection's gradient `dqkv` and
    /// its bias's gradient.
    fn backward_attention(&mut self, l: usize) -> Result<(), TrainError> {
        match &self.layers[l].attn {
            // [step 06]
            AttentionActs::Fused { qkv, lse } => {
                let (qkv, lse) = (qkv.ptr, lse.ptr);
                self.backward_attention_fused(l, qkv, lse)
            }
            // [/step 06]
            AttentionActs::Heads { q, k: key, v, att } => {
                let f = self.flat();
                let GpuTrainer {
                    gpu,
                    kernels: k,
                    config,
                    batch,
                    seq_len,
                    attention,
                    layout: lay,
                    s,
                    profiler: prof,
                    ..
                } = self;
                let (b, t, c, h) = (*batch, *seq_len, config.d_model, config.heads);
                let heads = (b, h, t, c / h);
                let width = config.qkv_width();
                let w = lay.blocks[l];
                let stream = gpu.stream();
                // SAFETY: as in forward
                unsafe {
                    k.heads_rows(
                        s.datt_rows.ptr,
                        dptr(&s.dout.data, stream),
                        false,
                        heads,
                    )?;
                    prof.mark(gpu, "backward: rows to heads")?;
                    let fwd = att.as_ref().expect("the forward ran");
                    let g = attention_backward(gpu, *attention, q, key, v, fwd, &s.dout)?;
                    prof.mark(gpu, "backward: attention")?;
                    let dqkv = (
                        dptr(&g.dq.data, stream),
                        dptr(&g.dk.data, stream),
                        dptr(&g.dv.data, stream),
                    );
                    k.heads_to_qkv(
                        dqkv,
                        s.dqkv.ptr,
                        s.col_partial.ptr,
                        f.g32(w.attn_b),
                        heads,
                        width,
                    )?;
                    // freed in stream order, after the kernel above has read them
                    drop(g);
                    prof.mark(gpu, "backward: heads to qkv")?;
                }
                Ok(())
            }
        }
    }

    // [step 06]
    /// [`GpuTrainer::backward_attention`] through step 06's kernels, from the forward's
    /// fused projection `qkv` and log-sum-exps `lse` of block `l`.
    fn backward_attention_fused(
        &mut self,
        l: usize,
        qkv: u64,
        lse: u64,
    ) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            kernels: k,
            config,
            batch,
            seq_len,
            layout: lay,
            layers,
            s,
            profiler: prof,
            ..
        } = self;
        let (b, t, c, h) = (*batch, *seq_len, config.d_model, config.heads);
        let (rows, d) = (b * t, c / h);
        let width = config.qkv_width();
        let shape = Shape::new(b, h, t, d);
        let w = lay.blocks[l];
        let la = &layers[l];
        // step 06's kernels read q, k, v where the forward's product wrote them, the output
        // and its gradient in rows, and write dq, dk and dv straight into the fused
        // projection's gradient: nothing to move, only the bias's column sums to take
        let [q, key, v] = fused_thirds(qkv, shape);
        // [step 08]
        // grouped heads: k's and v's columns are fewer
        let grouped = config.kv_heads != h;
        let [q, key, v] = match grouped {
            false => [q, key, v],
            true => fused_grouped(qkv, shape, config.kv_heads),
        };
        // [/step 08]
        let in_rows = |ptr| Strided {
            ptr,
            layout: HeadLayout::rows(shape),
        };
        let inputs = step06_hopper::backward::BackwardInputs {
            q,
            k: key,
            v,
            out: in_rows(la.att_rows.ptr),
            dout: in_rows(s.datt_rows.ptr),
            lse,
        };
        // two passes: a step's gradients the same bits every run, so that a run can be
        // repeated and resumed exactly (one pass adds dQ in whatever order its blocks
        // finish)
        let kernels = step06_hopper::kernel::BackwardKernels::two_passes(shape);
        let grads_at = s.dqkv.ptr;
        // [step 08]
        // and the kernels write dk and dv for every query head, as if k and v had been
        // repeated, in rows of 3C; each group's sum goes to dqkv after
        let grads_at = if grouped { s.dqkv_heads.ptr } else { grads_at };
        // [/step 08]
        let grads = fused_thirds(grads_at, shape).map(|g| g.ptr);
        // SAFETY: as in forward; grads_at holds rows · 3C bf16 values, apart from every
        // input, and each third's span ends inside it; the thirds' columns are apart
        unsafe {
            step06_hopper::backward::backward_into(
                gpu,
                kernels,
                shape,
                Dtype::Bf16,
                inputs,
                grads,
                HeadLayout::fused_rows(shape),
            )?;
            prof.mark(gpu, "backward: attention")?;
            // [step 08]
            if grouped {
                let heads = (h, config.kv_heads, d);
                k.sum_kv_groups(s.dqkv_heads.ptr, s.dqkv.ptr, rows, heads)?;
                prof.mark(gpu, "backward: sum kv groups")?;
            }
            // [/step 08]
            k.column_sums(s.dqkv.ptr, s.col_partial.ptr, f.g32(w.attn_b), rows, width)?;
            prof.mark(gpu, "backward: qkv bias")?;
        }
        Ok(())
    }
    // [/step 06]

    /// Block `l`'s fused projection and first LayerNorm, from `dqkv`: the block's input is
    /// the block before's output, so the residual gradient `dres` written here sums to that
    /// block's MLP output bias's gradient.
    fn backward_qkv(&mut self, l: usize) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            kernels: k,
            blas,
            config,
            batch,
            seq_len,
            layout: lay,
            layers,
            s,
            profiler: prof,
            ..
        } = self;
        let (rows, c) = (*batch * *seq_len, config.d_model);
        let width = config.qkv_width();
        let w = lay.blocks[l];
        let la = &layers[l];
        // SAFETY: as in forward
        unsafe {
            blas.matmul(
                c,
                width,
                rows,
                transposed(la.ln1.ptr),
                plain(s.dqkv.ptr),
                f.g32(w.attn_w),
                Out::F32,
                0.0,
            )?;
            blas.matmul(
                rows,
                c,
                width,
                plain(s.dqkv.ptr),
                transposed(f.w16(w.attn_w)),
                s.dln.ptr,
                Out::F32,
                0.0,
            )?;
            prof.mark(gpu, "backward: matmul qkv")?;
            k.layernorm_backward(
                s.dln.ptr,
                la.x.ptr,
                f.w32(w.ln_1_w),
                (la.ln1_mean.ptr, la.ln1_rstd.ptr),
                s.dmid.ptr,
                (s.dres.ptr, s.dres16.ptr),
                s.ln_partial.ptr,
                [
                    f.g32(w.ln_1_w),
                    f.g32(w.ln_1_b),
                    f.fc_proj_b_grad(lay, l.checked_sub(1)),
                ],
                rows,
                c,
            )?;
            prof.mark(gpu, "backward: layernorm")?;
        }
        Ok(())
    }

    /// The embeddings' gradients: `dres` is now the gradient of x = wte[token] + wpe[t].
    fn backward_embedding(&mut self) -> Result<(), TrainError> {
        let f = self.flat();
        let GpuTrainer {
            gpu,
            kernels: k,
            config,
            batch,
            seq_len,
            layout: lay,
            s,
            batch_i32,
            profiler: prof,
            ..
        } = self;
        let (b, t, c) = (*batch, *seq_len, config.d_model);
        let rows = b * t;
        let (order, offsets) = (batch_i32.ptr, batch_i32.ptr + 4 * rows as u64);
        // SAFETY: as in forward
        unsafe {
            k.embed_backward_pos(s.dres.ptr, f.g32(lay.wpe), (b, t, c), config.context)?;
            k.embed_backward_tok(
                s.dres.ptr,
                order,
                offsets,
                f.g32(lay.wte),
                config.vocab,
                c,
            )?;
            prof.mark(gpu, "backward: embedding")?;
        }
        Ok(())
    }
    // ANCHOR_END: gpu_backward

    // ANCHOR: gpu_optimizer
    /// The gradients' global norm, then one AdamW step of every weight at rate `lr`, the
    /// gradients clipped to norm `clip`: two reductions and one kernel, and no trip to the
    /// host (the AdamW kernel reads the norm where the reduction left it).
    pub fn optimizer_step(&mut self, lr: f32, clip: f32) -> Result<(), TrainError> {
        self.t += 1;
        let a = self.adamw;
        // the bias corrections, as optim.rs computes them
        let c1 = 1.0 - a.beta1.powi(self.t as i32);
        let c2 = 1.0 - a.beta2.powi(self.t as i32);
        let n = self.layout.len;
        let norm = self.s.scalars.ptr + 4;
        // SAFETY: the flat buffers hold layout.len values; norm_partial NORM_BLOCKS
        unsafe {
            self.kernels
                .grad_norm(self.grads.ptr, n, self.s.norm_partial.ptr, norm)?;
            self.profiler.mark(self.gpu, "grad norm")?;
            self.kernels.adamw(
                (
                    self.params.ptr,
                    self.grads.ptr,
                    self.m.ptr,
                    self.v.ptr,
                    self.params16.ptr,
                ),
                n,
                self.layout.decay_end,
                norm,
                clip,
                lr,
                (a.beta1, a.beta2, a.eps, a.weight_decay),
                (c1, c2),
            )?;
            self.profiler.mark(self.gpu, "adamw")?;
        }
        Ok(())
    }
    // ANCHOR_END: gpu_optimizer

    /// The loss and the gradients' norm of the last step, copied back (this waits for the
    /// GPU).
    fn read_scalars(&mut self) -> Result<[f32; 2], TrainError> {
        let mut out = [0f32; 2];
        self.gpu
            .stream()
            .memcpy_dtoh(&self.s.scalars._slice, &mut out)
            .map_err(|e| TrainError::Device(device_error("reading the loss")(e)))?;
        self.sync()?;
        Ok(out)
    }

    /// Forward and backward on one batch, leaving the gradients on the GPU; returns the
    /// loss.
    pub fn forward_backward(
        &mut self,
        inputs: ArrayView2<u8>,
        targets: ArrayView2<u8>,
    ) -> Result<f32, TrainError> {
        self.upload_batch(inputs, targets)?;
        self.forward(true)?;
        self.backward()?;
        Ok(self.read_scalars()?[0])
    }

    /// The loss of one batch, without gradients.
    pub fn loss(
        &mut self,
        inputs: ArrayView2<u8>,
        targets: ArrayView2<u8>,
    ) -> Result<f32, TrainError> {
        self.upload_batch(inputs, targets)?;
        self.forward(false)?;
        Ok(self.read_scalars()?[0])
    }

    // [step 08]
    /// Row `row` of the last forward's logits, `[vocab]`, copied back: the distribution of
    /// the token after the first `row + 1` tokens of the batch's first sequence (step 08
    /// generates without a cache from it).
    pub fn logits_row(&self, row: usize) -> Result<Vec<f32>, TrainError> {
        let (rows, vocab) = (self.batch * self.seq_len, self.config.vocab);
        if row >= rows {
            return Err(TrainError::Config(format!(
                "logits row {row}: the batch has rows 0..{rows}"
            )));
        }
        let mut out = vec![0f32; vocab];
        let stream = self.gpu.stream();
        stream
            .memcpy_dtoh(
                &self.logits._slice.slice(row * vocab..(row + 1) * vocab),
                &mut out,
            )
            .map_err(|e| TrainError::Device(device_error("reading the logits")(e)))?;
        stream
            .synchronize()
            .map_err(|e| TrainError::Device(device_error("waiting for the GPU")(e)))?;
        Ok(out)
    }
    // [/step 08]

    /// The gradients of the last backward, copied back.
    pub fn grads(&self) -> Result<Params<f32>, TrainError> {
        self.download(&self.grads)
    }

    /// Replaces the gradients (to test the optimizer alone).
    pub fn set_grads(&mut self, g: &Params<f32>) -> Result<(), TrainError> {
        let flat = self.layout.pack(g);
        self.gpu
            .stream()
            .memcpy_htod(&flat, &mut self.grads._slice)
            .map_err(|e| TrainError::Device(device_error("copying gradients")(e)))
    }

    /// The gradients' norm that the last [`GpuTrainer::optimizer_step`] clipped with.
    pub fn last_grad_norm(&mut self) -> Result<f32, TrainError> {
        Ok(self.read_scalars()?[1])
    }

    fn download(&self, b: &Buf<f32>) -> Result<Params<f32>, TrainError> {
        let flat = self
            .gpu
            .stream()
            .clone_dtoh(&b._slice)
            .map_err(|e| TrainError::Device(device_error("copying from the GPU")(e)))?;
        Ok(self.layout.unpack(&flat))
    }

    /// The weights, AdamW's state and the step, copied back: a CPU [`Trainer`], which saves
    /// checkpoints and samples.
    pub fn to_trainer(&self) -> Result<Trainer, TrainError> {
        Ok(Trainer {
            params: self.download(&self.params)?,
            opt: AdamW {
                settings: self.adamw,
                m: self.download(&self.m)?,
                v: self.download(&self.v)?,
                t: self.t,
            },
            step: self.step,
        })
    }
}

impl Learner for GpuTrainer {
    fn config(&self) -> Config {
        self.config
    }

    fn steps_done(&self) -> usize {
        self.step
    }

    fn params_count(&self) -> usize {
        self.layout.slots.iter().map(|s| s.len()).sum()
    }

    // ANCHOR: gpu_train_step
    fn train_step(
        &mut self,
        corpus: &Corpus,
        settings: &Settings,
    ) -> Result<StepRecord, TrainError> {
        let started = Instant::now();
        let Batch {
            inputs,
            targets,
            .. // [step 09]
        } = train_batch(
            &corpus.train,
            settings.batch,
            settings.seq_len,
            settings.seed,
            self.step,
        );
        self.upload_batch(inputs.view(), targets.view())?;
        self.forward(true)?;
        self.backward()?;
        let lr = settings.schedule.lr(self.step);
        self.optimizer_step(lr, settings.clip)?;
        // the step's one wait for the GPU
        let [loss, grad_norm] = self.read_scalars()?;
        self.profiler.finish_step()?;
        self.step += 1;
        let seconds = started.elapsed().as_secs_f64();
        Ok(StepRecord::timed(
            self.step,
            loss,
            lr,
            grad_norm,
            seconds,
            settings.batch * settings.seq_len,
        ))
    }
    // ANCHOR_END: gpu_train_step

    fn heldout_loss(&mut self, batches: &[Batch]) -> Result<f32, TrainError> {
        let mut sum = 0.0;
        for b in batches {
            sum += self.loss(b.inputs.view(), b.targets.view())? as f64;
        }
        // a held-out pass leaves marks of its own: not a step's
        self.profiler.used = 0;
        Ok((sum / batches.len() as f64) as f32)
    }

    fn checkpoint(&self) -> Result<Checkpoint, TrainError> {
        Ok(self.to_trainer()?.into())
    }

    fn hardware(&self) -> Hardware {
        Hardware {
            device: "cuda".into(),
            device_name: self.device_name(),
            attention: self.attention.name().into(),
            precision: "bf16-mixed".into(),
        }
    }

    fn peak_memory_bytes(&self) -> Result<Option<u64>, TrainError> {
        if !self.gpu.context().has_async_alloc() {
            return Ok(None);
        }
        pool_attribute(
            self.gpu,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            None,
        )
        .map(Some)
    }

    fn profile(&self) -> Vec<PhaseRecord> {
        let steps = self.profiler.steps.max(1) as f64;
        self.profiler
            .totals
            .iter()
            .map(|(name, ms)| PhaseRecord {
                name: name.to_string(),
                ms: ms / steps,
            })
            .collect()
    }
}
