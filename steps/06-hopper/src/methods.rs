//! This step's method in the registry: `cuda_hopper`, on host arrays for the tests and
//! `attend`, and prepared on the device for the benchmark, as step 03's `cuda_flash` is.

use flash_core::method::{DeviceHooks, DeviceRun, DeviceRunSpec};
use flash_core::{Attention, AttnError, Device, Dtype, Method, check_qkv};
use ndarray::ArrayView4;
use step03_cuda_forward::methods::{describe, prepare_inputs};
use step03_cuda_forward::{DeviceAttention, DeviceTensor, Gpu, half_dtype};

use crate::forward::{self, HopperConfig};

/// This step's methods.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "cuda_hopper",
            "06-hopper",
            Device::Cuda,
            "the FlashAttention forward with Hopper's instructions: TMA copies by a producer warp, wgmma products by consumer warpgroups, no T×T table (compute capability 9.0, head dims 64 and 128)",
            hopper_forward,
        )
        .with_dtype(hopper_forward_dtype)
        .with_implementation(implementation)
        .with_gpu(HOPPER_HOOKS),
    ]
}

/// The kernel on host arrays, in bf16.
pub fn hopper_forward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    hopper_forward_dtype(q, k, v, Dtype::Bf16)
}

/// [`hopper_forward`] in bf16 or f16.
pub fn hopper_forward_dtype(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Attention, AttnError> {
    check_qkv(&q, &k, &v)?;
    let dtype = half_dtype(dtype)?;
    let gpu = Gpu::shared()?;
    let up = |x: ArrayView4<f32>| gpu.upload(x, dtype);
    let (q, k, v) = (up(q)?, up(k)?, up(v)?);
    let result = forward::forward(gpu, &q, &k, &v)?;
    gpu.download_attention(&result)
}

/// What `cuda_hopper` runs.
pub fn implementation() -> String {
    let describe = |c: HopperConfig| {
        let producer = if c.producer_warpgroup {
            "a producer warpgroup that hands its registers over (setmaxnreg)"
        } else {
            "a producer warp"
        };
        let overlap = if c.overlap {
            ", the softmax overlapped with P·v"
        } else {
            ""
        };
        format!(
            "{}x{} tiles, {} consumer warpgroup(s) and {producer}, {} stages, {} block(s) a multiprocessor{overlap}",
            c.block_m(),
            forward::BLOCK_N,
            c.warpgroups,
            c.stages,
            c.min_blocks
        )
    };
    format!(
        "hopper_forward.cu: TMA copies, wgmma m64n128k16 and m64n64k16, NVRTC sm_90a; head dim 64 up to 8k tokens {}, from 16k {}; head dim 128 {}",
        describe(HopperConfig::for_shape(8192, 64)),
        describe(HopperConfig::for_shape(16384, 64)),
        describe(HopperConfig::for_shape(16384, 128))
    )
}

struct Prepared {
    gpu: &'static Gpu,
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    out: DeviceAttention,
}

fn prepare(spec: &DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError> {
    let gpu = Gpu::shared()?;
    forward::check_hopper(gpu)?;
    let [q, k, v] = prepare_inputs(spec)?;
    forward::check(&q, &k, &v)?;
    let out = gpu.alloc_output(spec.shape, q.dtype)?;
    Ok(Box::new(Prepared { gpu, q, k, v, out }))
}

impl DeviceRun for Prepared {
    fn time_ms(&mut self) -> Result<f64, AttnError> {
        let (gpu, q, k, v, out) = (self.gpu, &self.q, &self.k, &self.v, &mut self.out);
        let config = HopperConfig::for_shape(q.shape.tokens, q.shape.head_dim);
        gpu.time_ms(|| forward::forward_with(gpu, config, q, k, v, out))
    }

    fn peak_bytes(&mut self) -> Result<u64, AttnError> {
        let (gpu, q, k, v) = (self.gpu, &self.q, &self.k, &self.v);
        gpu.peak_allocated(|| forward::forward(gpu, q, k, v))?
            .1
            .ok_or_else(|| AttnError::Device {
                what: "this driver has no stream-ordered memory pool to read a peak from".into(),
            })
    }

    fn result(&mut self) -> Result<Attention, AttnError> {
        let r = forward::forward(self.gpu, &self.q, &self.k, &self.v)?;
        self.gpu.download_attention(&r)
    }
}

/// `cuda_hopper` on the device, for the benchmark.
pub const HOPPER_HOOKS: DeviceHooks = DeviceHooks { describe, prepare };
