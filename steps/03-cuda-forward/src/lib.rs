//! # Step 03: the forward pass as a CUDA kernel
//!
//! The online softmax of step 02, moved onto a GPU's tensor cores: one thread block per 128
//! queries of a head, keys and values streamed through shared memory 128 at a time,
//! `mma.sync` products in bf16 or f16 with f32 accumulation, and each row's log-sum-exp
//! stored for the backward pass. The kernel lives in a real `.cu` file; NVRTC compiles it
//! on first use (cached per dtype and head dim) and cudarc launches it. cudarc opens
//! `libcuda` and `libnvrtc` at run time, so this crate builds and its CPU tests run on
//! machines without CUDA: there, every call returns [`AttnError::Device`] saying what is
//! missing.
//!
//! ## Kernels
//!
//! The step's kernel is the last of five rungs of a ladder ([`ladder`]): each of the first
//! four is the same causal forward one idea slower, so that the book can build the fast
//! kernel up one idea at a time.
//!
//! | kernel | what it does | H200, B=4 H=12 D=64 bf16 causal: TFLOP/s at 1k / 4k / 16k (× FA2) |
//! | --- | --- | --- |
//! | `kernels/ladder_1_rows.cu` (rung 1, `cuda_rows`) | one thread per query row, f32, keys and values read from global memory one value at a time | 4.3 / 5.1 / 7.1 (0.03× / 0.02× / 0.02×) |
//! | `kernels/ladder_2_shared.cu` (rung 2, `cuda_shared`) | rung 1 with keys and values staged through shared memory, 64 at a time, widened to f32 once | 13.2 / 20.0 / 23.9 (0.09× / 0.08× / 0.08×) |
//! | `kernels/ladder_3_mma.cu` (rung 3, `cuda_mma`) | rung 5's tiles and `mma.sync`, fragments by plain loads from tiles stored row by row (bank conflicts), copies through registers that the products wait for, blocks in grid order | 44.8 / 68.1 / 84.0 (0.31× / 0.27× / 0.27×) |
//! | `kernels/ladder_4_ldmatrix.cu` (rung 4, `cuda_ldmatrix`) | rung 3 with fragments by `ldmatrix` from swizzled tiles | 93.0 / 115.4 / 165.7 (0.65× / 0.46× / 0.54×) |
//! | `kernels/flash_forward.cu` (rung 5, `cuda_flash`) | 4 warps × 32 rows, 128 keys a step, `ldmatrix` from swizzled shared memory, `cp.async` two-stage K/V pipeline, `exp2` with log2 e folded into the scale, mask on diagonal blocks only, every head's longest query blocks first | 208.8 / 329.3 / 349.9 (1.46× / 1.31× / 1.14×), `charts/data/gpu.json` |
//! | `kernels/causal_softmax.cu` (with cuBLAS) | attention by hand: the whole table in device memory | 43 / 31 / 25 |
//!
//! The tile shape came from the lab's `forward-tune` (the tuning log,
//! `lab/logs/03-cuda-forward/README.md`): 16 rows a warp instead of 32 ran at 223 TFLOP/s
//! at 16k, 64 keys a step instead of 128 at 294, and one head after another instead of all
//! heads' longest blocks first lost 27% at 1k (145.5 against 200.5). At head dim 128 (runs
//! 14 and 16): 4 warps × 32 rows over 64 keys taken 32 at a time, one ldmatrix offset
//! register per operand, 229.5 / 338.8 / 358.5 / 352.0 at 1k / 4k / 8k / 16k against FA2's
//! 168.9 / 290.0 /
//! 330.5 / 346.0. The copies of each block take a fixed count of instructions with no test
//! per row (`load_rows`, run 16: 5–13% at both head dims). The variants that lost and left
//! the kernel are in `lab/notes/03-cuda-forward.md`.
//!
//! ## Layout
//!
//! - [`Gpu`]: the context, stream and compiled kernels; [`Gpu::forward`] on device tensors,
//!   [`Gpu::attention`] on host arrays, [`Gpu::forward_with`] in another tile shape.
//! - [`DeviceTensor`]: a `[batch, heads, tokens, head_dim]` tensor of 16-bit values on the
//!   GPU.
//! - [`ladder`]: the rungs ([`Rung`]), run by [`Gpu::ladder_forward_into`] on device
//!   tensors and [`Gpu::ladder_attention`] on host arrays.
//! - [`kernel`]: the `.cu` sources (with `kernels/tensor_cores.cuh`, the helpers every
//!   kernel shares, in front) and their NVRTC compilation: [`ForwardConfig`], the tile
//!   shape ([`ForwardConfig::for_head_dim`] the one each head dim runs), and
//!   [`ForwardKernel`](kernel::ForwardKernel), which alone turns a dtype, a head dim and a
//!   shape into the kernel's `-D` options; `flash_forward.cu` holds no defaults of its own.
//! - [`host`]: rounding to bf16/f16 and back, and attention by hand in those precisions on
//!   the CPU (the yardstick of the GPU tests).
//! - [`by_hand`]: attention by hand on the GPU (cuBLAS and `kernels/causal_softmax.cu`).
//! - [`rule`]: FlashAttention's rule ([`ForwardCheck`](rule::ForwardCheck)), which the GPU
//!   tests and the exercise checker both apply.
//! - [`banks`]: chapter 3's first CPU exercise, the turns shared memory's banks take for a
//!   warp's loads, written by the reader in `exercises/banks.rs`, and its checker.
//! - [`exercise`]: chapter 3's exercises: the swizzle written by the reader in Rust in
//!   `exercises/swizzle.rs`, checked on the CPU; rung 1's key loop in `exercises/rows.cu`,
//!   checked on the GPU. `src/bin/exercise.rs` runs any of them
//!   (`cargo run -p step03-cuda-forward --bin exercise -- banks`).
//! - [`ptxas`]: what the kernel-check binaries share; `src/bin/kernel-check.rs` compiles
//!   every kernel the library launches (and the exercise's template) with NVRTC and ptxas
//!   and fails on any spill (no GPU needed).
//! - [`tool`]: the command-line tools' flag parsers.
//! - [`methods`](mod@methods): the step's methods in the registry, [`Ladder`],
//!   [`CudaNaive`] and [`CudaFlash`].

pub mod banks;
pub mod by_hand;
pub mod exercise;
pub mod gpu;
pub mod host;
pub mod kernel;
pub mod ladder;
pub mod methods;
pub mod ptxas;
pub mod rule;
pub mod tool;

pub use methods::{CudaFlash, CudaNaive, Ladder, methods};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute, CUresult};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError,
    LaunchConfig, PushKernelArg,
};
use flash_core::{Attention, AttnError, Shape, check_qkv};
use ndarray::{Array3, Array4, ArrayView4};

pub use cudarc;
pub use kernel::ForwardConfig;

use gpu::{FixedKernel, KernelSpec};
use kernel::{ForwardKernel, SoftmaxKernel};
pub use ladder::Rung;

/// The element types: the kernels take the 16-bit ones, bf16 and f16 ([`half_dtype`]).
pub use flash_core::Dtype;

/// `dtype` if the kernels take it, else an error saying which they take.
pub fn half_dtype(dtype: Dtype) -> Result<Dtype, AttnError> {
    match dtype {
        Dtype::Bf16 | Dtype::F16 => Ok(dtype),
        Dtype::F32 => Err(AttnError::Unsupported {
            what:
                "the CUDA methods compute in bf16 or f16, not f32: pass --dtype bf16 or f16"
                    .into(),
        }),
    }
}

/// A `[batch, heads, tokens, head_dim]` tensor of bf16 or f16 values in GPU memory,
/// row-major.
pub struct DeviceTensor {
    pub data: CudaSlice<u16>,
    pub shape: Shape,
    pub dtype: Dtype,
}

/// What the forward kernel writes: the output and each row's natural log-sum-exp.
pub struct DeviceAttention {
    pub out: DeviceTensor,
    /// `[batch, heads, tokens]`, f32
    pub lse: CudaSlice<f32>,
}

/// The modules compiled so far, by key, and the entry points looked up in them.
#[derive(Default)]
struct KernelCache {
    modules: HashMap<String, Arc<CudaModule>>,
    functions: HashMap<(String, String), CudaFunction>,
}

/// One GPU: its context and stream, and the kernels compiled for it so far.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: &'static str,
    kernels: Mutex<KernelCache>,
    blas: OnceLock<Result<cudarc::cublas::CudaBlas, AttnError>>,
}

/// Turns a driver error into an [`AttnError`], out-of-memory as such (with no size: the
/// driver does not say how much was asked for; [`alloc_error`] gives it where it is known).
pub fn device_error(what: &str) -> impl Fn(DriverError) -> AttnError + '_ {
    alloc_error(what, 0)
}

/// [`device_error`] for an allocation of `bytes`, which an out-of-memory error then names.
pub fn alloc_error(what: &str, bytes: u128) -> impl Fn(DriverError) -> AttnError + '_ {
    move |e| match e.0 {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => AttnError::OutOfMemory {
            what: what.to_string(),
            bytes,
        },
        _ => AttnError::Device {
            what: format!("{what}: {e}"),
        },
    }
}

impl Gpu {
    /// Opens GPU 0. Errors, each saying what is missing: no CUDA driver library, no NVRTC
    /// library, no GPU, or a GPU older than compute capability 8.0 (bf16 `mma.sync` needs
    /// it).
    pub fn new() -> Result<Gpu, AttnError> {
        Gpu::open(0)
    }

    // [step 07]
    /// Opens GPU `ordinal`, with the errors of [`Gpu::new`] (step 07 drives several).
    pub fn on(ordinal: usize) -> Result<Gpu, AttnError> {
        Gpu::open(ordinal)
    }

    /// A process-wide handle on GPU `ordinal`, opened on first use; `shared_on(0)` is
    /// [`Gpu::shared`].
    pub fn shared_on(ordinal: usize) -> Result<&'static Gpu, AttnError> {
        static GPUS: Mutex<Vec<(usize, &'static Gpu)>> = Mutex::new(Vec::new());
        if ordinal == 0 {
            return Gpu::shared();
        }
        let mut gpus = GPUS.lock().expect("GPU list poisoned");
        if let Some((_, gpu)) = gpus.iter().find(|(o, _)| *o == ordinal) {
            return Ok(gpu);
        }
        // opened once for the life of the process, like Gpu::shared's
        let gpu: &'static Gpu = Box::leak(Box::new(Gpu::open(ordinal)?));
        gpus.push((ordinal, gpu));
        Ok(gpu)
    }

    /// How many GPUs the driver sees (0 without a driver).
    pub fn count() -> usize {
        // SAFETY: only tries to open the shared library
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    }
    // [/step 07]

    // [step 08]
    /// Opens GPU `ordinal` with a stream of its own rather than the default stream, which
    /// a CUDA graph cannot be captured from (step 08 replays a generation step as one
    /// graph). Everything on it runs on that one stream, in order.
    ///
    /// # Safety
    ///
    /// cudarc's event tracking is off for this `Gpu`'s context (an event recorded outside
    /// a capture may not be waited on inside it), so nothing orders its buffers' uses on
    /// different streams: every buffer made through this `Gpu` must be used on its one
    /// stream only, [`Gpu::stream`].
    pub unsafe fn with_own_stream(ordinal: usize) -> Result<Gpu, AttnError> {
        let mut gpu = Gpu::open(ordinal)?;
        // SAFETY: the caller keeps every buffer of this context on the one stream below
        unsafe { gpu.ctx.disable_event_tracking() };
        gpu.stream = gpu
            .ctx
            .new_stream()
            .map_err(device_error("creating a stream"))?;
        Ok(gpu)
    }
    // [/step 08]

    fn open(ordinal: usize) -> Result<Gpu, AttnError> {
        // SAFETY: only tries to open the shared library
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(AttnError::Device {
                what: "no CUDA driver (libcuda.so) on this machine: the CUDA methods need an NVIDIA GPU and its driver".into(),
            });
        }
        gpu::require_nvrtc()?;
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| device_error(&format!("opening GPU {ordinal}"))(e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(device_error("reading the compute capability"))?;
        // each 8.x its own sm_8x (an 8.x NVRTC has no name for compiles for sm_80, which
        // every 8.x runs); 9.x and newer sm_90, which they run through the PTX's JIT
        let arch = match (major, minor) {
            (8, 6) => "sm_86",
            (8, 7) => "sm_87",
            (8, 9) => "sm_89",
            (8, _) => "sm_80",
            (m, _) if m >= 9 => "sm_90",
            _ => {
                return Err(AttnError::Device {
                    what: format!(
                        "GPU {ordinal} has compute capability {major}.{minor}; the kernels need 8.0 or newer (bf16 mma.sync)"
                    ),
                });
            }
        };
        let stream = ctx.default_stream();
        Ok(Gpu {
            ctx,
            stream,
            arch,
            kernels: Mutex::new(KernelCache::default()),
            blas: OnceLock::new(),
        })
    }

    /// A process-wide GPU, opened on first use.
    pub fn shared() -> Result<&'static Gpu, AttnError> {
        static GPU: OnceLock<Result<Gpu, AttnError>> = OnceLock::new();
        GPU.get_or_init(Gpu::new).as_ref().map_err(Clone::clone)
    }

    /// The `--gpu-architecture` NVRTC compiles for on this GPU (`sm_90` on an H200).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Name, compute capability and driver version, for the benchmark's header.
    pub fn describe(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sms = self
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap_or(0);
        let mut version = 0;
        // SAFETY: the driver library is loaded (Gpu::new checked) and writes one int
        let driver = match unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        {
            CUresult::CUDA_SUCCESS => {
                format!("{}.{}", version / 1000, (version % 1000) / 10)
            }
            _ => "?".into(),
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: NVRTC's library is loaded (Gpu::new checked) and writes two ints
        let nvrtc = match unsafe {
            cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor)
        } {
            cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS => format!("{major}.{minor}"),
            _ => "?".into(),
        };
        format!(
            "{name} ({}, {sms} SMs, CUDA driver {driver}, NVRTC {nvrtc})",
            self.arch
        )
    }

    /// The kernel `entry` of the module `spec` describes, compiled ([`gpu::compile`]) and
    /// loaded once per [`KernelSpec::key`] (every entry of one module under one key: one
    /// compile, one check of the build's limits); `smem` is the dynamic shared memory it
    /// will be launched with. Every step's kernels are compiled through this cache.
    pub fn kernel(
        &self,
        spec: &impl KernelSpec,
        entry: &str,
        smem: u32,
    ) -> Result<CudaFunction, AttnError> {
        let mut kernels = self.kernels.lock().expect("kernel cache poisoned");
        let name = (spec.key(), entry.to_string());
        if let Some(f) = kernels.functions.get(&name) {
            return Ok(f.clone());
        }
        let module = match kernels.modules.get(&name.0) {
            Some(m) => m.clone(),
            None => {
                let m = self
                    .ctx
                    .load_module(gpu::compile(spec, self.arch)?)
                    .map_err(device_error("loading a compiled kernel"))?;
                kernels.modules.insert(name.0.clone(), m.clone());
                m
            }
        };
        let f = module
            .load_function(entry)
            .map_err(device_error("finding a kernel's entry point"))?;
        // more than 48 KiB of dynamic shared memory must be asked for
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(device_error("raising a kernel's shared-memory limit"))?;
        kernels.functions.insert(name, f.clone());
        Ok(f)
    }

    fn forward_kernel(
        &self,
        dtype: Dtype,
        head_dim: usize,
        config: ForwardConfig,
    ) -> Result<CudaFunction, AttnError> {
        self.kernel(
            &ForwardKernel::new(dtype, head_dim, config),
            kernel::FLASH_FORWARD,
            config.smem_bytes(head_dim),
        )
    }

    /// Keeps the GPU busy for about `micros` microseconds (at 2 GHz), queued on the stream:
    /// see [`kernel::SPIN_CU`].
    pub fn spin(&self, micros: u64) -> Result<(), AttnError> {
        let spin = FixedKernel {
            name: "spin.cu",
            source: kernel::SPIN_CU,
        };
        let f = self.kernel(&spin, "spin", 0)?;
        let cycles = (micros * 2000) as i64;
        let config = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(&cycles);
        // SAFETY: the kernel takes one integer and touches no memory
        unsafe { launch.launch(config) }.map_err(device_error("launching spin"))?;
        Ok(())
    }

    pub(crate) fn softmax_kernel(&self, dtype: Dtype) -> Result<CudaFunction, AttnError> {
        self.kernel(&SoftmaxKernel { dtype }, kernel::CAUSAL_SOFTMAX, 0)
    }

    pub(crate) fn blas(&self) -> Result<&cudarc::cublas::CudaBlas, AttnError> {
        self.blas
            .get_or_init(|| {
                // SAFETY: only tries to open the shared library
                if !unsafe { cudarc::cublas::sys::is_culib_present() } {
                    return Err(AttnError::Device {
                        what:
                            "no cuBLAS (libcublas.so) found: attention by hand on the GPU needs it"
                                .into(),
                    });
                }
                cudarc::cublas::CudaBlas::new(self.stream.clone()).map_err(|e| AttnError::Device {
                    what: format!("creating a cuBLAS handle: {e:?}"),
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Runs `f` and returns what it returned with the device memory it allocated at its
    /// high-water mark, above what was allocated before: the stream-ordered pool's
    /// `USED_MEM_HIGH`, reset before and read after (the analogue of PyTorch's
    /// `max_memory_allocated`). None when the driver allocates without a pool.
    pub fn peak_allocated<R>(
        &self,
        f: impl FnOnce() -> Result<R, AttnError>,
    ) -> Result<(R, Option<u64>), AttnError> {
        use cudarc::driver::sys::{
            CUmemPool_attribute, CUmemoryPool, cuDeviceGetDefaultMemPool,
            cuMemPoolGetAttribute, cuMemPoolSetAttribute,
        };
        let call = |r: CUresult, what: &str| match r {
            CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(AttnError::Device {
                what: format!("{what}: {e:?}"),
            }),
        };
        if !self.ctx.has_async_alloc() {
            return Ok((f()?, None));
        }
        self.stream
            .synchronize()
            .map_err(device_error("synchronising"))?;
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        let (mut before, mut high, mut zero) = (0u64, 0u64, 0u64);
        // SAFETY: the driver is loaded (a Gpu exists); each call reads or writes one u64
        unsafe {
            call(
                cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()),
                "finding the memory pool",
            )?;
            call(
                cuMemPoolGetAttribute(
                    pool,
                    CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                    (&mut before as *mut u64).cast(),
                ),
                "reading the pool",
            )?;
            // setting the high-water mark to 0 resets it to what is in use now
            call(
                cuMemPoolSetAttribute(
                    pool,
                    CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&mut zero as *mut u64).cast(),
                ),
                "resetting the pool's high-water mark",
            )?;
        }
        let result = f()?;
        self.stream
            .synchronize()
            .map_err(device_error("synchronising"))?;
        // SAFETY: as above
        unsafe {
            call(
                cuMemPoolGetAttribute(
                    pool,
                    CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&mut high as *mut u64).cast(),
                ),
                "reading the pool's high-water mark",
            )?;
        }
        Ok((result, Some(high.saturating_sub(before))))
    }

    /// Runs `f` once and returns how long its work took on the GPU, in milliseconds: CUDA
    /// events recorded on the stream just before and just after it, with a 0.5 ms spin
    /// kernel in front so that the GPU is still busy while the host launches `f`'s kernels
    /// (the time is theirs, not the launch's). Whatever `f` returns is dropped after its
    /// end is recorded. Every GPU timing of the repository goes through here and the core's
    /// timing loop.
    pub fn time_ms<T>(
        &self,
        f: impl FnOnce() -> Result<T, AttnError>,
    ) -> Result<f64, AttnError> {
        use cudarc::driver::sys::CUevent_flags;
        let event = || {
            self.ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(device_error("creating an event"))
        };
        let (start, end) = (event()?, event()?);
        self.spin(500)?;
        start
            .record(&self.stream)
            .map_err(device_error("recording an event"))?;
        let result = f()?;
        end.record(&self.stream)
            .map_err(device_error("recording an event"))?;
        end.synchronize().map_err(device_error("the timed call"))?;
        drop(result);
        Ok(start
            .elapsed_ms(&end)
            .map_err(device_error("reading an elapsed time"))? as f64)
    }

    /// Copies an `f32` array to the GPU, rounding each value to `dtype` (to nearest, ties
    /// to even).
    pub fn upload(
        &self,
        x: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<DeviceTensor, AttnError> {
        let (b, h, t, d) = x.dim();
        let dtype = half_dtype(dtype)?;
        let bits = host::to_bits(x, dtype);
        let data = self
            .stream
            .clone_htod(&bits)
            .map_err(alloc_error("copying to the GPU", bits.len() as u128 * 2))?;
        Ok(DeviceTensor {
            data,
            shape: Shape::new(b, h, t, d),
            dtype,
        })
    }

    /// Copies a tensor back, widening each value to `f32` (exactly).
    pub fn download(&self, x: &DeviceTensor) -> Result<Array4<f32>, AttnError> {
        let bits = self
            .stream
            .clone_dtoh(&x.data)
            .map_err(device_error("copying from the GPU"))?;
        Ok(host::from_bits(&bits, x.shape, x.dtype))
    }

    /// Allocates what [`Gpu::forward_into`] writes, for a given input.
    pub fn alloc_output(
        &self,
        shape: Shape,
        dtype: Dtype,
    ) -> Result<DeviceAttention, AttnError> {
        let dtype = half_dtype(dtype)?;
        let out = self
            .stream
            .alloc_zeros::<u16>(shape.len())
            .map_err(alloc_error(
                "allocating the output",
                shape.len() as u128 * 2,
            ))?;
        let rows = shape.batch * shape.heads * shape.tokens;
        let lse = self
            .stream
            .alloc_zeros::<f32>(rows)
            .map_err(alloc_error("allocating the log-sum-exp", rows as u128 * 4))?;
        Ok(DeviceAttention {
            out: DeviceTensor {
                data: out,
                shape,
                dtype,
            },
            lse,
        })
    }

    // ANCHOR: forward
    /// Causal attention on the GPU: `out = softmax(mask(q·kᵀ/√d))·v` and each row's
    /// log-sum-exp.
    pub fn forward(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
    ) -> Result<DeviceAttention, AttnError> {
        let mut result = self.alloc_output(q.shape, q.dtype)?;
        self.forward_into(q, k, v, &mut result)?;
        Ok(result)
    }

    /// [`Gpu::forward`] into buffers allocated before (the benchmark times this alone).
    pub fn forward_into(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        result: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        self.forward_with(
            ForwardConfig::for_head_dim(q.shape.head_dim),
            q,
            k,
            v,
            result,
        )
    }

    /// [`Gpu::forward_into`] with a kernel of another tile shape (for tuning).
    pub fn forward_with(
        &self,
        config: ForwardConfig,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        result: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        let shape = check_device(q, k, v)?;
        check_output(shape, q.dtype, result)?;
        if shape.is_empty() {
            return Ok(());
        }
        let f = self.forward_kernel(q.dtype, shape.head_dim, config)?;
        self.launch_forward(&f, config, q, k, v, result)
    }
    // ANCHOR_END: forward

    // [step 07]
    /// [`Gpu::forward_with`] without the causal mask: every query sees every key. Step 07's
    /// ring computes so the blocks of keys that lie wholly before their queries.
    pub fn forward_full_with(
        &self,
        config: ForwardConfig,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        result: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        let shape = check_device(q, k, v)?;
        check_output(shape, q.dtype, result)?;
        if shape.is_empty() {
            return Ok(());
        }
        let head_dim = shape.head_dim;
        let full = ForwardKernel {
            causal: false,
            ..ForwardKernel::new(q.dtype, head_dim, config)
        };
        let f = self.kernel(&full, kernel::FLASH_FORWARD, config.smem_bytes(head_dim))?;
        self.launch_forward(&f, config, q, k, v, result)
    }
    // [/step 07]

    // ANCHOR: launch_forward
    /// Launches a compiled forward kernel on checked, non-empty inputs.
    fn launch_forward(
        &self,
        f: &CudaFunction,
        config: ForwardConfig,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        result: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        let shape = q.shape;
        let heads = shape.batch * shape.heads;
        let blocks = grid_blocks(shape, config.block_m())?;
        let launch_config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (config.threads(), 1, 1),
            shared_mem_bytes: config.smem_bytes(shape.head_dim),
        };
        let (tokens, heads_arg) = (shape.tokens as i32, heads as i32);
        let head_group = config.head_group(heads) as i32;
        let scale_log2 = shape.scale_log2();
        // [step 08]
        // query heads a head of k and v serves (1 unless they are grouped)
        let q_per_kv = (shape.heads / k.shape.heads) as i32;
        // [/step 08]
        let mut launch = self.stream.launch_builder(f);
        launch
            .arg(&q.data)
            .arg(&k.data)
            .arg(&v.data)
            .arg(&mut result.out.data)
            .arg(&mut result.lse)
            .arg(&tokens)
            .arg(&heads_arg)
            .arg(&head_group)
            .arg(&q_per_kv) // [step 08]
            .arg(&scale_log2);
        // SAFETY: check_device proved q, k, v hold batch·heads·tokens·head_dim values of
        // one dtype, the output was checked to match, lse holds batch·heads·tokens; the
        // grid covers tokens in blocks of BLOCK_M and batch·heads heads, and the kernel
        // writes only rows below `tokens`; the dynamic shared memory is what the kernel's
        // tiles take.
        // [step 08]
        // With grouped heads, k and v hold batch·(heads / q_per_kv)·tokens·head_dim values
        // and query head bh reads their head bh / q_per_kv.
        // [/step 08]
        unsafe { launch.launch(launch_config) }
            .map_err(device_error("launching flash_forward"))?;
        Ok(())
    }
    // ANCHOR_END: launch_forward

    /// Host-side entry point: rounds `f32` inputs to `dtype`, runs [`Gpu::forward`] and
    /// returns the output widened back to `f32`.
    pub fn attention(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        self.on_host(q, k, v, dtype, |q, k, v| self.forward(q, k, v))
    }

    /// Host-side entry point for [`Gpu::by_hand`].
    pub fn attention_by_hand(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        self.on_host(q, k, v, dtype, |q, k, v| self.by_hand(q, k, v))
    }

    fn on_host(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
        run: impl FnOnce(
            &DeviceTensor,
            &DeviceTensor,
            &DeviceTensor,
        ) -> Result<DeviceAttention, AttnError>,
    ) -> Result<Attention, AttnError> {
        let shape = check_qkv(&q, &k, &v)?;
        check_head_dim(shape.head_dim)?;
        if shape.is_empty() {
            return Ok(Attention::empty(shape));
        }
        let (q, k, v) = (
            self.upload(q, dtype)?,
            self.upload(k, dtype)?,
            self.upload(v, dtype)?,
        );
        let result = run(&q, &k, &v)?;
        self.download_attention(&result)
    }

    /// Copies a result back: the output widened to `f32`, the log-sum-exp as it is.
    pub fn download_attention(
        &self,
        result: &DeviceAttention,
    ) -> Result<Attention, AttnError> {
        let shape = result.out.shape;
        let out = self.download(&result.out)?;
        let lse = self
            .stream
            .clone_dtoh(&result.lse)
            .map_err(device_error("copying from the GPU"))?;
        let lse = Array3::from_shape_vec((shape.batch, shape.heads, shape.tokens), lse)
            .expect("b·h·T values");
        Ok(Attention { out, lse })
    }
}

fn check_head_dim(head_dim: usize) -> Result<(), AttnError> {
    if kernel::HEAD_DIMS.contains(&head_dim) {
        Ok(())
    } else {
        Err(kernel::unsupported_head_dim(head_dim))
    }
}

/// That the output buffers were allocated for inputs of this shape and dtype.
pub(crate) fn check_output(
    shape: Shape,
    dtype: Dtype,
    result: &DeviceAttention,
) -> Result<(), AttnError> {
    if result.out.shape != shape
        || result.out.dtype != dtype
        || result.lse.len() != shape.batch * shape.heads * shape.tokens
    {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the output buffers are for {} {}, the inputs are {shape} {}",
                result.out.shape,
                result.out.dtype.name(),
                dtype.name()
            ),
        });
    }
    Ok(())
}

/// The checks [`Gpu::forward`] makes before a launch: one shape and dtype for q, k and v, a
/// supported head dim, buffers that hold what the shape says, and sizes the grid can take.
pub fn check_device(
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
) -> Result<Shape, AttnError> {
    // the shape k and v must have: q's
    let kv = q.shape;
    // [step 08]
    // or q's with fewer heads, each shared by a group of q's (grouped-query attention)
    let kv = flash_core::check::grouped_kv(kv, k.shape.heads)?;
    // [/step 08]
    if k.shape != kv || v.shape != kv {
        return Err(AttnError::ShapeMismatch {
            what: format!("q is {}, k is {}, v is {}", q.shape, k.shape, v.shape),
        });
    }
    if q.dtype != k.dtype || q.dtype != v.dtype {
        return Err(AttnError::Unsupported {
            what: format!(
                "q is {}, k is {}, v is {}: all three must have one dtype",
                q.dtype.name(),
                k.dtype.name(),
                v.dtype.name()
            ),
        });
    }
    let shape = q.shape;
    if shape.head_dim == 0 {
        return Err(AttnError::ZeroHeadDim);
    }
    check_head_dim(shape.head_dim)?;
    for (name, x) in [("q", q), ("k", k), ("v", v)] {
        if x.data.len() != x.shape.len() {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "{name}'s buffer holds {} values but its shape {} needs {}",
                    x.data.len(),
                    x.shape,
                    x.shape.len()
                ),
            });
        }
    }
    grid_blocks(shape, ForwardConfig::for_head_dim(shape.head_dim).block_m())?;
    Ok(shape)
}

// [step 08]
/// `Ok` when k has as many heads as q; otherwise an error saying that `method` takes one
/// head of k and v for each head of q, not grouped-query attention's fewer.
pub fn same_heads(
    q: &DeviceTensor,
    k: &DeviceTensor,
    method: &str,
) -> Result<(), AttnError> {
    if q.shape.heads == k.shape.heads {
        return Ok(());
    }
    Err(AttnError::Unsupported {
        what: format!(
            "q has {} heads and k and v {}: {method} takes one head of k and v for each \
             head of q (grouped heads are for flash_forward, step 04's backward and step \
             06's kernels)",
            q.shape.heads, k.shape.heads
        ),
    })
}
// [/step 08]

/// The thread blocks of a forward grid, one per `block_m` queries of each head, if the grid
/// can take them: at most 2^31 − 1 blocks (a grid's x dimension), and at most 2^30 tokens
/// (the kernels index rows with 32-bit integers).
pub fn grid_blocks(shape: Shape, block_m: usize) -> Result<u32, AttnError> {
    let blocks = shape
        .tokens
        .div_ceil(block_m)
        .checked_mul(shape.batch)
        .and_then(|n| n.checked_mul(shape.heads))
        .filter(|&n| n <= i32::MAX as usize && shape.tokens <= 1 << 30);
    blocks.map(|n| n as u32).ok_or_else(|| AttnError::Unsupported {
        what: format!(
            "{shape}: the kernel takes at most 2^31 - 1 blocks of {block_m} queries (sequences × heads × tokens / {block_m}) and 2^30 tokens"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_limits_name_the_block_the_kernel_uses() {
        let block_m = ForwardConfig::for_head_dim(64).block_m();
        assert_eq!(
            grid_blocks(Shape::new(4, 12, 1000, 64), block_m),
            Ok(4 * 12 * 8)
        );
        let huge = Shape::new(1 << 20, 1 << 20, 1024, 64);
        let err = grid_blocks(huge, block_m).unwrap_err().to_string();
        assert!(
            err.contains(&format!("blocks of {block_m} queries")),
            "{err}"
        );
        assert!(grid_blocks(Shape::new(1, 1, (1 << 30) + 1, 64), block_m).is_err());
    }

    #[test]
    fn an_out_of_memory_without_a_size_says_so() {
        let e = AttnError::OutOfMemory {
            what: "launching flash_forward".into(),
            bytes: 0,
        }
        .to_string();
        assert!(
            e.contains("the device said out of memory") && !e.contains("MB"),
            "{e}"
        );
    }
}
