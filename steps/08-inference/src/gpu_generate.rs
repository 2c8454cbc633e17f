//! Generating with the key/value cache on the GPU: step 05's model as its GPU trainer runs
//! it (the weights' bf16 copy in cuBLAS's products, the LayerNorm, GELU and embedding
//! kernels of step 05's `kernels/train.cu`): the prompt in one pass (a prefill, with step
//! 03's causal kernel over its rows), then one token a step. The model's cache is one
//! [`PagedKvCache`] of all its layers, used as a reader would use it: a step reserves
//! room for its token once ([`PagedKvCache::reserve`]), each layer writes the token's keys
//! and values there (`kernels/append.cu`) and runs the [`DecodePlan`] made once with the
//! model, the decoding kernel reading the whole cache with the token's one query row per
//! head.
//!
//! The cache is in pages of [`PAGE_SIZE`] tokens, taken from a free list as the text
//! grows: a contiguous cache of `T` tokens is `T` rows a head, so a cache that grew by a
//! token a step would move every head's rows at each step; a page takes a new token where
//! it has room, and a new page comes when it has none.
//!
//! [`sample_gpu`] is the same model without the cache: step 05's GPU forward over the whole
//! window for every new token.

use flash_core::inputs::SplitMix64;
use ndarray::{Array1, ArrayView2, Axis};
use step03_cuda_forward::gpu::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use step03_cuda_forward::gpu::cudarc::driver::{
    CudaFunction, CudaGraph, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu, alloc_error, device_error};
use step05_train::TrainError;
use step05_train::cuda::GpuTrainer;
use step05_train::cuda::gemm::{Blas, Out, plain, transposed};
use step05_train::cuda::kernels::Kernels;
use step05_train::cuda::layout::Layout;
use step05_train::layers::softmax_rows;
use step05_train::model::{Config, Params};
use step05_train::train::pick;

use crate::cuda::{CacheLayout, CacheSpec, DecodeOutput, DecodePlan, NewKv, PagedKvCache};
use crate::kernel::{EMBED, append_kernel};
use crate::pages::PAGE_SIZE;

fn device(e: flash_core::AttnError) -> TrainError {
    TrainError::Device(e)
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(
    gpu: &Gpu,
    len: usize,
    what: &str,
) -> Result<CudaSlice<T>, TrainError> {
    let bytes = (len.max(1) * std::mem::size_of::<T>()) as u128;
    gpu.stream()
        .alloc_zeros::<T>(len.max(1))
        .map_err(|e| device(alloc_error(what, bytes)(e)))
}

// ANCHOR: gpu_model
/// Step 05's model on the GPU for generating: its weights, a paged cache of keys and values
/// for its layers, and one token's activations.
pub struct GpuModel {
    /// GPU 0 on a stream of this model's own, which a graph can be captured from.
    gpu: Gpu,
    kernels: Kernels,
    blas: Blas,
    embed: CudaFunction,
    pub config: Config,
    layout: Layout,
    /// The weights in step 05's flat layout, `f32` and the products' bf16 copy.
    weights: CudaSlice<f32>,
    weights16: CudaSlice<u16>,
    /// Every layer's keys and values of one sequence of up to `context` tokens, in pages
    /// of [`PAGE_SIZE`]; its length is the next token's position.
    cache: PagedKvCache,
    /// What an embedding reads from memory rather than from its launch's arguments: the
    /// cache's length with the step's token, and the token.
    at: CudaSlice<i32>,
    /// The decoding kernel planned for the cache and one query row a head; it chooses the
    /// split for the cache's length at each step.
    plan: DecodePlan,
    /// The same with the split of a full cache: a graph's, whatever the cache's length.
    graph_plan: DecodePlan,
    /// Whether a step replays one CUDA graph (from the second step on) or launches its
    /// kernels one by one.
    pub graphs: bool,
    /// The step as a graph, captured once.
    graph: Option<CudaGraph>,
    /// One token's activations: the residual stream before and after the attention (`f32`),
    /// a product's `f32` output, a LayerNorm's bf16 output and its statistics, the fused
    /// projection (q's heads, then k's and v's; q read from it in place), the attention's
    /// output, the MLP's two bf16 rows, the logits.
    x: CudaSlice<f32>,
    x_mid: CudaSlice<f32>,
    y: CudaSlice<f32>,
    ln: CudaSlice<u16>,
    stats: CudaSlice<f32>,
    qkv: DeviceTensor,
    att: DecodeOutput,
    fc: CudaSlice<u16>,
    gelu: CudaSlice<u16>,
    logits: CudaSlice<f32>,
}
// ANCHOR_END: gpu_model

impl GpuModel {
    /// The model of `params` on GPU 0, with empty caches as long as its context. Fails,
    /// saying what is missing, without a GPU, NVRTC or cuBLAS, and for a head dim the
    /// decoding kernel does not take.
    pub fn new(params: &Params<f32>) -> Result<GpuModel, TrainError> {
        // SAFETY: every buffer of the model is made, used and freed on this Gpu's stream
        let gpu = unsafe { Gpu::with_own_stream(0) }.map_err(device)?;
        let config = params.config;
        config.check()?;
        let (c, heads, d) = (config.d_model, config.heads, config.head_dim());
        let kv_heads = config.kv_heads;
        let kernels = Kernels::load(&gpu, c)?;
        let blas = Blas::new(&gpu)?;
        let embed = gpu
            .kernel(&append_kernel(Dtype::Bf16, d), EMBED, 0)
            .map_err(device)?;
        let layout = Layout::new(config);
        let stream = gpu.stream();
        let weights = stream.clone_htod(&layout.pack(params)).map_err(|e| {
            device(alloc_error("copying the weights", layout.len as u128 * 4)(
                e,
            ))
        })?;
        let weights16 = alloc::<u16>(&gpu, layout.len, "the weights' bf16 copy")?;
        // SAFETY: both buffers hold layout.len values
        unsafe {
            kernels.to_bf16(ptr(&gpu, &weights), ptr(&gpu, &weights16), layout.len)?;
        }
        let paged = CacheLayout::Paged {
            page_size: PAGE_SIZE,
        };
        let spec = CacheSpec {
            layers: config.layers,
            ..CacheSpec::new(1, kv_heads, config.context, d, Dtype::Bf16, paged)
        };
        let cache = PagedKvCache::new(&gpu, spec).map_err(device)?;
        let plan = DecodePlan::new(&gpu, &cache, heads, 1).map_err(device)?;
        let graph_plan = plan.clone().for_graph();
        // the output has room for the most splits the plan gives at any length, a graph's
        // (a full cache's) among them
        let att = plan.alloc_output(&gpu).map_err(device)?;
        let qkv = DeviceTensor {
            data: alloc(&gpu, config.qkv_width(), "the fused projection")?,
            shape: flash_core::Shape::new(1, heads, 1, d),
            dtype: Dtype::Bf16,
        };
        Ok(GpuModel {
            kernels,
            blas,
            embed,
            config,
            layout,
            weights,
            weights16,
            cache,
            at: alloc(&gpu, 2, "the step's position and token")?,
            plan,
            graph_plan,
            graphs: true,
            graph: None,
            x: alloc(&gpu, c, "the residual stream")?,
            x_mid: alloc(&gpu, c, "the residual stream")?,
            y: alloc(&gpu, c, "a product's output")?,
            ln: alloc(&gpu, c, "a LayerNorm's output")?,
            stats: alloc(&gpu, 2, "a LayerNorm's statistics")?,
            qkv,
            att,
            fc: alloc(&gpu, 4 * c, "the MLP's first product")?,
            gelu: alloc(&gpu, 4 * c, "the MLP's GELU")?,
            logits: alloc(&gpu, config.vocab, "the logits")?,
            gpu,
        })
    }

    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.cache.lens()[0]
    }

    /// The GPU's name (`NVIDIA H200`).
    pub fn device_name(&self) -> String {
        self.gpu
            .context()
            .name()
            .unwrap_or_else(|_| "unknown GPU".into())
    }

    /// The GPU's architecture as NVRTC names it (`sm_90`).
    pub fn arch(&self) -> &'static str {
        self.gpu.arch()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Empties the cache: its pages go back to the free list, to be taken again as new
    /// tokens come.
    pub fn reset(&mut self) -> Result<(), TrainError> {
        self.cache.release(&self.gpu, 0).map_err(device)
    }

    /// Bytes of keys and values in the cache now: what each decoding step reads.
    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes() as usize
    }

    // ANCHOR: gpu_step
    /// Reads one more token at the cache's next position and returns the logits of the
    /// token after it: step 05's GPU forward for one row, with the attention a decoding
    /// step against the cache. With [`GpuModel::graphs`] on, the first step launches its
    /// kernels and captures them as a graph; every later step replays it.
    pub fn step(&mut self, token: u8) -> Result<Array1<f32>, TrainError> {
        let cfg = self.config;
        let pos = self.len();
        if pos >= cfg.context {
            return Err(TrainError::Config(format!(
                "the cache holds {pos} tokens, the model's context: it has position \
                 embeddings for positions 0..{} only, so no more tokens fit",
                cfg.context
            )));
        }
        if token as usize >= cfg.vocab {
            return Err(TrainError::Config(format!(
                "token {token} is outside the model's vocabulary of {}: tokens 0..{} are \
                 accepted",
                cfg.vocab, cfg.vocab
            )));
        }
        let stream = self.gpu.stream().clone();
        // what changes from step to step goes to memory, where the kernels read it
        stream
            .memcpy_htod(&[pos as i32 + 1, token as i32], &mut self.at)
            .map_err(|e| device(device_error("copying the token")(e)))?;
        // room for the token in every layer, a new page when the last is full: the host's
        // work, outside the graph, which reads the table and the lengths from memory
        self.cache.reserve(&self.gpu, &[1]).map_err(device)?;
        if !self.graphs {
            // the plan chooses the fewest splits for the keys there are now
            self.launch_step(false)?;
        } else if let Some(graph) = &self.graph {
            graph
                .launch()
                .map_err(|e| device(device_error("launching the step's graph")(e)))?;
        } else {
            // once by launches (which loads every kernel), then captured for the next
            self.launch_step(true)?;
            self.graph = Some(self.capture()?);
        }
        self.read_logits("the step")
    }
    // ANCHOR_END: gpu_step

    /// The logits of the last token in, once the work queued before them (`what`) is done.
    fn read_logits(&self, what: &str) -> Result<Array1<f32>, TrainError> {
        let stream = self.gpu.stream();
        let logits = stream
            .clone_dtoh(&self.logits)
            .map_err(|e| device(device_error("reading the logits")(e)))?;
        stream
            .synchronize()
            .map_err(|e| device(device_error(&format!("waiting for {what}"))(e)))?;
        Ok(Array1::from(logits))
    }

    // ANCHOR: capture
    /// The step's launches recorded as one CUDA graph, not run: each kernel and product
    /// with the arguments it had, which a replay gives again. Every one of them is the
    /// same at every position: the position and the token are read from `at`, the
    /// cache's lengths and page table from the cache's memory, and the split is a full
    /// cache's.
    fn capture(&mut self) -> Result<CudaGraph, TrainError> {
        let stream = self.gpu.stream().clone();
        let fail = |what| move |e| device(device_error(what)(e));
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(fail("starting the step's capture"))?;
        let launched = self.launch_step(true);
        // the capture ends whatever happened in it
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        launched?;
        graph
            .map_err(fail(
                "capturing the step as a graph (`graphs` off, `generate --no-graph`, runs \
                 the step by launches instead)",
            ))?
            .ok_or_else(|| {
                device(flash_core::AttnError::Device {
                    what: "capturing the step as a graph: the capture recorded nothing"
                        .into(),
                })
            })
    }
    // ANCHOR_END: capture

    /// The kernels and products of one step, queued on the model's stream: the token in
    /// `at` at the position there, the attention's split a full cache's for a graph
    /// (`graph`), else the one the plan chooses for the cache's length.
    fn launch_step(&mut self, graph: bool) -> Result<(), TrainError> {
        let cfg = self.config;
        let (c, d) = (cfg.d_model, cfg.head_dim());
        let (width, heads, kv_heads) = (cfg.qkv_width(), cfg.heads, cfg.kv_heads);
        let GpuModel {
            gpu,
            kernels: k,
            blas,
            embed,
            layout: lay,
            weights,
            weights16,
            cache,
            at,
            qkv: q,
            att,
            logits: logits_buf,
            ..
        } = self;
        let gpu: &Gpu = gpu;
        let plan = if graph { &self.graph_plan } else { &self.plan };
        let (w32, w16) = (ptr(gpu, weights), ptr(gpu, weights16));
        let w32 = |off: usize| w32 + 4 * off as u64;
        let w16 = |off: usize| w16 + 2 * off as u64;
        let (x, x_mid, y) = (ptr(gpu, &self.x), ptr(gpu, &self.x_mid), ptr(gpu, &self.y));
        let (ln, qkv) = (ptr(gpu, &self.ln), ptr(gpu, &q.data));
        let (fc, gelu) = (ptr(gpu, &self.fc), ptr(gpu, &self.gelu));
        let (mean, rstd) = (ptr(gpu, &self.stats), ptr(gpu, &self.stats) + 4);
        let logits = ptr(gpu, logits_buf);
        // ANCHOR: gpu_step_layers
        embed_token(gpu, embed, at, w32(lay.wte), w32(lay.wpe), x, c)?;
        // SAFETY (every launch and product below): each pointer is a buffer allocated in
        // GpuModel::new for one token of this model (x, x_mid and y C values, ln C, qkv
        // qkv_width, fc and gelu 4C, logits V), or an offset into the flat weights that the
        // layout gives for a tensor of the size used; `at` holds a position below the
        // context (step checks it before writing it)
        unsafe {
            for (l, w) in lay.blocks.iter().enumerate() {
                // the block before's residual connection closes in this LayerNorm
                let (res, add, add_bias) = match l {
                    0 => (x, 0, 0),
                    _ => (x_mid, y, w32(lay.blocks[l - 1].fc_proj_b)),
                };
                let ln_1 = (w32(w.ln_1_w), w32(w.ln_1_b));
                k.layernorm_forward(res, add, add_bias, x, ln_1, ln, (mean, rstd), 1, c)?;
                let attn_w = plain(w16(w.attn_w));
                blas.matmul_bias(1, width, c, plain(ln), attn_w, w16(w.attn_b), qkv)?;
                // this token's keys and values join the cache; its q stays in qkv
                let new =
                    NewKv::from_fused(&q.data, Dtype::Bf16, [1, 1], heads, kv_heads, d)
                        .map_err(device)?;
                cache.write(gpu, l, &new).map_err(device)?;
                plan.run(gpu, cache, l, q, att).map_err(device)?;
                let out = ptr(gpu, &att.out.data);
                blas.matmul(1, c, c, plain(out), plain(w16(w.proj_w)), y, Out::F32, 0.0)?;
                let ln_2 = (w32(w.ln_2_w), w32(w.ln_2_b));
                let proj_b = w32(w.proj_b);
                k.layernorm_forward(x, y, proj_b, x_mid, ln_2, ln, (mean, rstd), 1, c)?;
                blas.matmul(
                    1,
                    4 * c,
                    c,
                    plain(ln),
                    plain(w16(w.fc_w)),
                    fc,
                    Out::Bf16,
                    0.0,
                )?;
                k.bias_gelu(fc, w32(w.fc_b), gelu, 1, 4 * c)?;
                let fc_proj = plain(w16(w.fc_proj_w));
                blas.matmul(1, c, 4 * c, plain(gelu), fc_proj, y, Out::F32, 0.0)?;
            }
            let last = w32(lay.blocks[cfg.layers - 1].fc_proj_b);
            let ln_f = (w32(lay.ln_f_w), w32(lay.ln_f_b));
            k.layernorm_forward(x_mid, y, last, x, ln_f, ln, (mean, rstd), 1, c)?;
            // the output layer is the token embedding, transposed
            let wte = transposed(w16(lay.wte));
            blas.matmul(1, cfg.vocab, c, plain(ln), wte, logits, Out::F32, 0.0)?;
        }
        // ANCHOR_END: gpu_step_layers
        Ok(())
    }

    // ANCHOR: gpu_prefill
    /// Reads a whole prompt into the empty caches at once and returns the logits of the
    /// token after it: step 05's GPU forward over the prompt's rows (the attention is step
    /// 03's causal kernel over the prompt), each layer's keys and values written to its
    /// cache as they are made. The same as a [`GpuModel::step`] a token, in one pass over
    /// the weights instead of one a token.
    pub fn prefill(&mut self, prompt: &[u8]) -> Result<Array1<f32>, TrainError> {
        self.check_prompt(prompt)?;
        let cfg = self.config;
        let n = prompt.len();
        let (c, heads, d) = (cfg.d_model, cfg.heads, cfg.head_dim());
        let (width, kv_heads) = (cfg.qkv_width(), cfg.kv_heads);
        let gpu = &self.gpu;
        let stream = gpu.stream();
        // the prompt's activations, n rows of each buffer of GpuModel::step
        let tokens = stream
            .clone_htod(prompt)
            .map_err(|e| device(device_error("copying the prompt")(e)))?;
        // room for the prompt in every layer
        self.cache.reserve(gpu, &[n]).map_err(device)?;
        let (x, x_mid, y) = (
            alloc::<f32>(gpu, n * c, "the prompt's residual stream")?,
            alloc::<f32>(gpu, n * c, "the prompt's residual stream")?,
            alloc::<f32>(gpu, n * c, "the prompt's products")?,
        );
        let ln = alloc::<u16>(gpu, n * c, "the prompt's LayerNorm output")?;
        let stats = alloc::<f32>(gpu, 2 * n, "the prompt's LayerNorm statistics")?;
        let qkv = alloc::<u16>(gpu, n * width, "the prompt's fused projection")?;
        let shape = flash_core::Shape::new(1, heads, n, d);
        let kv_shape = flash_core::Shape::new(1, kv_heads, n, d);
        let head_tensor =
            |shape: flash_core::Shape, what| -> Result<DeviceTensor, TrainError> {
                Ok(DeviceTensor {
                    data: alloc(gpu, shape.len(), what)?,
                    shape,
                    dtype: Dtype::Bf16,
                })
            };
        let (q, key, v) = (
            head_tensor(shape, "the prompt's queries")?,
            head_tensor(kv_shape, "the prompt's keys")?,
            head_tensor(kv_shape, "the prompt's values")?,
        );
        let mut att = gpu.alloc_output(shape, Dtype::Bf16).map_err(device)?;
        let att_rows = alloc::<u16>(gpu, n * c, "the prompt's attention rows")?;
        let fc = alloc::<u16>(gpu, 4 * n * c, "the prompt's MLP")?;
        let gelu = alloc::<u16>(gpu, 4 * n * c, "the prompt's MLP")?;
        let (k, blas, lay) = (&self.kernels, &self.blas, &self.layout);
        let (w32, w16) = (ptr(gpu, &self.weights), ptr(gpu, &self.weights16));
        let w32 = |off: usize| w32 + 4 * off as u64;
        let w16 = |off: usize| w16 + 2 * off as u64;
        let (xp, x_midp, yp) = (ptr(gpu, &x), ptr(gpu, &x_mid), ptr(gpu, &y));
        let (lnp, qkvp, rowsp) = (ptr(gpu, &ln), ptr(gpu, &qkv), ptr(gpu, &att_rows));
        let (fcp, gelup) = (ptr(gpu, &fc), ptr(gpu, &gelu));
        let (mean, rstd) = (ptr(gpu, &stats), ptr(gpu, &stats) + 4 * n as u64);
        let heads_of = |t: &DeviceTensor| ptr(gpu, &t.data);
        let dims = (1, heads, n, d);
        // ANCHOR: gpu_prefill_layers
        // SAFETY (every launch and product below): each pointer is a buffer allocated above
        // for n rows of this model (x, x_mid, y, ln and att_rows n·C values, qkv n·width, q
        // and att's output [1, H, n, D], key and v [1, kv_heads, n, D], fc and gelu 4n·C,
        // stats 2n), or an offset
        // into the flat weights that the layout gives for a tensor of the size used; the
        // position embeddings' rows 0..n exist (n ≤ context)
        unsafe {
            k.embed_forward(ptr(gpu, &tokens), w32(lay.wte), w32(lay.wpe), xp, n, n, c)?;
            for (l, w) in lay.blocks.iter().enumerate() {
                let (res, add, add_bias) = match l {
                    0 => (xp, 0, 0),
                    _ => (x_midp, yp, w32(lay.blocks[l - 1].fc_proj_b)),
                };
                let ln_1 = (w32(w.ln_1_w), w32(w.ln_1_b));
                k.layernorm_forward(res, add, add_bias, xp, ln_1, lnp, (mean, rstd), n, c)?;
                let attn_w = plain(w16(w.attn_w));
                blas.matmul(n, width, c, plain(lnp), attn_w, qkvp, Out::Bf16, 0.0)?;
                let qkv_heads = (heads_of(&q), heads_of(&key), heads_of(&v));
                k.qkv_to_heads(qkvp, w32(w.attn_b), qkv_heads, dims, width)?;
                // the prompt's keys and values join the cache from their [1, kv_heads, n,
                // D] tensors
                let new = NewKv::from_heads(&key, &v).map_err(device)?;
                self.cache.write(gpu, l, &new).map_err(device)?;
                gpu.forward_into(&q, &key, &v, &mut att).map_err(device)?;
                k.heads_rows(ptr(gpu, &att.out.data), rowsp, true, dims)?;
                blas.matmul(
                    n,
                    c,
                    c,
                    plain(rowsp),
                    plain(w16(w.proj_w)),
                    yp,
                    Out::F32,
                    0.0,
                )?;
                let ln_2 = (w32(w.ln_2_w), w32(w.ln_2_b));
                let proj_b = w32(w.proj_b);
                k.layernorm_forward(xp, yp, proj_b, x_midp, ln_2, lnp, (mean, rstd), n, c)?;
                let fc_w = plain(w16(w.fc_w));
                blas.matmul(n, 4 * c, c, plain(lnp), fc_w, fcp, Out::Bf16, 0.0)?;
                k.bias_gelu(fcp, w32(w.fc_b), gelup, n, 4 * c)?;
                let fc_proj = plain(w16(w.fc_proj_w));
                blas.matmul(n, c, 4 * c, plain(gelup), fc_proj, yp, Out::F32, 0.0)?;
            }
            // the last row alone goes on to the logits
            let last = |p: u64, size: usize| p + (size * (n - 1) * c) as u64;
            let fc_proj_b = w32(lay.blocks[cfg.layers - 1].fc_proj_b);
            let ln_f = (w32(lay.ln_f_w), w32(lay.ln_f_b));
            let (res, add) = (last(x_midp, 4), last(yp, 4));
            k.layernorm_forward(res, add, fc_proj_b, xp, ln_f, lnp, (mean, rstd), 1, c)?;
            let wte = transposed(w16(lay.wte));
            let logits = ptr(gpu, &self.logits);
            blas.matmul(1, cfg.vocab, c, plain(lnp), wte, logits, Out::F32, 0.0)?;
        }
        // ANCHOR_END: gpu_prefill_layers
        self.read_logits("the prefill")
    }
    // ANCHOR_END: gpu_prefill

    /// The refusals of [`GpuModel::prefill`], before anything is allocated: a prompt of 1
    /// to `context` tokens of the vocabulary, into an empty cache.
    fn check_prompt(&self, prompt: &[u8]) -> Result<(), TrainError> {
        let cfg = self.config;
        let n = prompt.len();
        if !self.is_empty() || n == 0 || n > cfg.context {
            return Err(TrainError::Config(format!(
                "a prefill of {n} tokens into a cache of {}: a prefill reads 1 to {} \
                 tokens (the model's context) into an empty cache; tokens after those go \
                 in with step",
                self.len(),
                cfg.context
            )));
        }
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= cfg.vocab) {
            return Err(TrainError::Config(format!(
                "token {t} is outside the model's vocabulary of {}: tokens 0..{} are \
                 accepted",
                cfg.vocab, cfg.vocab
            )));
        }
        Ok(())
    }
}

/// The embedding of the token in `at` at the position there into `x`.
fn embed_token(
    gpu: &Gpu,
    embed: &CudaFunction,
    at: &CudaSlice<i32>,
    wte: u64,
    wpe: u64,
    x: u64,
    c: usize,
) -> Result<(), TrainError> {
    let config = LaunchConfig {
        grid_dim: ((c as u32).div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let c_i = c as i32;
    let mut launch = gpu.stream().launch_builder(embed);
    launch.arg(at).arg(&wte).arg(&wpe).arg(&x).arg(&c_i);
    // SAFETY: wte, wpe and x are the model's token and position embeddings and a buffer of
    // C values; at holds a token below the vocabulary and a length from 1 to the context
    // (step checks both before writing them)
    unsafe { launch.launch(config) }
        .map(|_| ())
        .map_err(|e| device(device_error("launching embed_token")(e)))
}

/// A buffer's device address.
fn ptr<T>(gpu: &Gpu, s: &CudaSlice<T>) -> u64 {
    s.device_ptr(gpu.stream()).0
}

// ANCHOR: generate_gpu
/// `count` tokens after `prompt` from the model on the GPU with the cache: the prompt read
/// in one [`GpuModel::prefill`], then one [`GpuModel::step`] a token, each drawn as step 05's `sample`
/// draws it (its probabilities, its rule, the same stream of `seed`).
pub fn generate_gpu(
    model: &mut GpuModel,
    prompt: &[u8],
    count: usize,
    temperature: f32,
    seed: u64,
) -> Result<Vec<u8>, TrainError> {
    let context = model.config.context;
    if prompt.is_empty() || prompt.len() + count > context {
        return Err(TrainError::Config(format!(
            "a prompt of {} tokens and {count} new ones: with a cache, the prompt must hold \
             at least one token, and the prompt and the new tokens together must fit in the \
             model's context (at most {context})",
            prompt.len()
        )));
    }
    model.reset()?;
    if count == 0 {
        return Ok(Vec::new());
    }
    let mut logits = model.prefill(prompt)?;
    let mut rng = SplitMix64::new(seed);
    let mut out = Vec::with_capacity(count);
    loop {
        let next = draw(logits, temperature, &mut rng);
        out.push(next);
        if out.len() == count {
            return Ok(out);
        }
        logits = model.step(next)?;
    }
}
// ANCHOR_END: generate_gpu

/// The next token from logits: their softmax as step 05's forward makes it, then its rule.
fn draw(logits: Array1<f32>, temperature: f32, rng: &mut SplitMix64) -> u8 {
    let mut probs = logits.insert_axis(Axis(0));
    softmax_rows(&mut probs);
    pick(probs.as_slice().expect("one row"), temperature, rng)
}

/// The same tokens without a cache: for every new token, step 05's GPU forward over the
/// window of the last `trainer.seq_len` tokens (padded with zeros past the text, which the
/// causal mask hides from the row read), and that row's logits.
pub fn sample_gpu(
    trainer: &mut GpuTrainer,
    prompt: &[u8],
    count: usize,
    temperature: f32,
    seed: u64,
) -> Result<Vec<u8>, TrainError> {
    if prompt.is_empty() {
        return Err(TrainError::Config(
            "an empty prompt: the model needs at least one token to predict the next"
                .into(),
        ));
    }
    let t = trainer.seq_len;
    let mut rng = SplitMix64::new(seed);
    let mut tokens = prompt.to_vec();
    let mut inputs = vec![0u8; t];
    let targets = vec![0u8; t];
    for _ in 0..count {
        let window = &tokens[tokens.len().saturating_sub(t)..];
        inputs[..window.len()].copy_from_slice(window);
        inputs[window.len()..].fill(0);
        let inputs_2d = ArrayView2::from_shape((1, t), &inputs[..]).expect("one row of t");
        let targets_2d =
            ArrayView2::from_shape((1, t), &targets[..]).expect("one row of t");
        trainer.loss(inputs_2d, targets_2d)?;
        let logits = trainer.logits_row(window.len() - 1)?;
        tokens.push(draw(Array1::from(logits), temperature, &mut rng));
    }
    Ok(tokens[prompt.len()..].to_vec())
}
