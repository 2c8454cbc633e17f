//! # The GPU runtime
//!
//! What every step's kernels run on, from step 03 on: one GPU's context and stream
//! ([`Gpu`]), tensors in its memory ([`DeviceTensor`]), NVRTC compilation with one set of
//! options for any kernel described by a [`KernelSpec`] ([`compile`]), the cache of what
//! was compiled ([`Gpu::kernel`]), timing with CUDA events ([`Gpu::time_ms`]), peak device
//! memory ([`Gpu::peak_allocated`]) and copies to and from the host ([`Gpu::upload`],
//! [`Gpu::download`]). Step 03's forward is its first user; later steps import it from
//! here, not from step 03's forward.
//!
//! cudarc opens `libcuda` and `libnvrtc` at run time, so everything here builds on machines
//! without CUDA: there [`Gpu::new`] returns an [`AttnError::Device`] saying what is missing.
//!
//! ## Layout
//!
//! - [`Gpu`]: opening a GPU, the kernel cache, the spin kernel that timing queues first,
//!   timing, peak memory, copies.
//! - [`DeviceTensor`]: a `[batch, heads, tokens, head_dim]` tensor of 16-bit values.
//! - `compile.rs`: [`KernelSpec`], the typed description each kernel implements, and
//!   [`compile`], the one call to NVRTC.
//! - [`check_tensors`], [`grid_blocks`]: what any launch checks of its inputs and of a grid
//!   over queries; each kernel checks its own limits in its [`KernelSpec::check`].
//! - [`device_error`], [`alloc_error`]: driver errors as [`AttnError`]s.

mod compile;

pub use compile::{
    FixedKernel, KernelSpec, OPTIONS, compile, missing_nvrtc, nvrtc_present, require_nvrtc,
};
pub use cudarc;
/// The element types: the kernels take the 16-bit ones, bf16 and f16 ([`half_dtype`]).
pub use flash_core::Dtype;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute, CUresult};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError,
    LaunchConfig, PushKernelArg,
};
use flash_core::{AttnError, Shape};
use ndarray::{Array4, ArrayView4};

use crate::host;

/// A kernel that keeps the GPU busy for a given number of clock cycles. Queued before a
/// timed call, it lets the host finish launching the call while the GPU is still busy, so
/// the measured time is the call's kernels alone, not the host's work to start them.
pub const SPIN_CU: &str = r#"
extern "C" __global__ void spin(long long cycles) {  // cycles: how long to stay busy
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
"#;

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

/// A `--dtype` flag for the GPU's kernels, as clap's `value_parser` takes it: `bf16` or
/// `f16`, anything else an error saying so.
pub fn parse_half_dtype(s: &str) -> Result<Dtype, String> {
    match s {
        "bf16" => Ok(Dtype::Bf16),
        "f16" => Ok(Dtype::F16),
        _ => Err(format!("{s:?}: the GPU's kernels compute in bf16 or f16")),
    }
}

/// A `[batch, heads, tokens, head_dim]` tensor of bf16 or f16 values in GPU memory,
/// row-major.
pub struct DeviceTensor {
    pub data: CudaSlice<u16>,
    pub shape: Shape,
    pub dtype: Dtype,
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
        require_nvrtc()?;
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

    /// The kernel `entry` of the module `spec` describes, compiled ([`compile`]) and
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
                    .load_module(compile(spec, self.arch)?)
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

    /// Keeps the GPU busy for about `micros` microseconds (at 2 GHz), queued on the stream:
    /// see [`SPIN_CU`].
    pub fn spin(&self, micros: u64) -> Result<(), AttnError> {
        let spin = FixedKernel {
            name: "spin.cu",
            source: SPIN_CU,
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
}

/// That q, k and v are one attention's inputs on the device, whatever kernel takes them:
/// one shape (k and v with fewer heads under grouped-query attention), one dtype, a head
/// dim above 0, and buffers that hold what their shapes say. The shape. Each kernel then
/// checks its own limits (head dims, grid) itself.
pub fn check_tensors(
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
    Ok(shape)
}

/// The thread blocks of a grid of one block per `block_m` queries of each head, if the grid
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
