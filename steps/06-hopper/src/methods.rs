//! This step's method in the registry: `cuda_hopper`, on host arrays for the tests and
//! `attend`, and prepared on the device for the benchmark, as step 03's `cuda_flash` is; its
//! backward is this step's backward kernels after its forward, as step 04 pairs `cuda_flash`'s.

use flash_core::method::{DeviceRun, DeviceRunSpec, Grads};
use flash_core::{Attention, AttnError, Device, Dtype, Method, check_qkv};
use ndarray::ArrayView4;
use step03_cuda_forward::methods::{describe, prepare_inputs};
use step03_cuda_forward::{DeviceAttention, DeviceTensor, Gpu, half_dtype};
use step04_backward::methods::{Pair, on_host, prepare as prepare_pair};

use crate::backward;
use crate::forward::{self, HopperConfig};

/// This step's methods.
pub fn methods() -> Vec<&'static dyn Method> {
    vec![&CudaHopper]
}

/// `cuda_hopper`: the forward and backward kernels of this step.
#[derive(Clone, Copy, Debug)]
pub struct CudaHopper;

impl Method for CudaHopper {
    fn name(&self) -> &'static str {
        "cuda_hopper"
    }
    fn step(&self) -> &'static str {
        "06-hopper"
    }
    fn device(&self) -> Device {
        Device::Cuda
    }
    fn about(&self) -> &'static str {
        "FlashAttention with Hopper's instructions: TMA copies by a producer warp, wgmma products by consumer warpgroups, no T×T table; the backward in one pass that adds dQ with a warp of its own, or in two (dK and dV, then dQ) that give the same bits every run (compute capability 9.0, head dims 64 and 128)"
    }
    fn implementation(&self) -> String {
        implementation()
    }
    fn dtypes(&self) -> &'static [Dtype] {
        &[Dtype::Bf16, Dtype::F16]
    }
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        hopper_forward(q, k, v, dtype)
    }
    fn describe_device(&self) -> Result<String, AttnError> {
        describe()
    }
    fn prepare_forward(&self, spec: &DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare(spec)
    }
    fn has_backward(&self) -> bool {
        true
    }
    fn backward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        fwd: &Attention,
        dout: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Grads, AttnError> {
        hopper_backward(q, k, v, fwd, dout, dtype)
    }
    fn prepare_backward(&self, spec: &DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare_pair(HOPPER_PAIR, spec)
    }
}

/// The backward kernels on host arrays, in bf16 or f16, after a forward that returned `fwd`.
pub fn hopper_backward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Grads, AttnError> {
    on_host(backward::backward, q, k, v, fwd, dout, dtype)
}

/// The forward into buffers allocated before, in the block shape for the inputs' length.
fn forward_into(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    out: &mut DeviceAttention,
) -> Result<(), AttnError> {
    let config = HopperConfig::for_shape(q.shape.tokens, q.shape.head_dim);
    forward::forward_with(gpu, config, q, k, v, out)
}

/// The forward and the backward kernels, prepared together for the benchmark's backward.
const HOPPER_PAIR: Pair = Pair {
    forward: forward::forward,
    forward_into: Some(forward_into),
    backward: backward::backward,
};

/// The kernel on host arrays, in bf16 or f16.
pub fn hopper_forward(
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
        let overlap = [
            (c.overlap, ", the softmax overlapped with P·v"),
            (
                c.early_rescale,
                ", the output rescaled before P·v is issued",
            ),
            (
                c.pingpong,
                ", the warpgroups taking turns at their products",
            ),
            (
                c.kv_barriers,
                ", the keys and the values with barriers of their own",
            ),
        ]
        .into_iter()
        .filter_map(|(on, what)| on.then_some(what))
        .collect::<String>();
        let order = if c.longest_first {
            ", every head's longest query blocks first"
        } else {
            ""
        };
        let poly = match c.poly_exp {
            0 => String::new(),
            n => format!(", {n} of 16 exponentials from a cubic on the FMA units"),
        };
        format!(
            "{}x{} tiles, {} consumer warpgroup(s) and {producer}, {} stages, {} block(s) a multiprocessor{overlap}{poly}{order}",
            c.block_m(),
            forward::BLOCK_N,
            c.warpgroups,
            c.stages,
            c.min_blocks
        )
    };
    let b = |t, d| backward::BackwardConfigs::for_shape(t, d).name();
    format!(
        "hopper_forward.cu: TMA copies, wgmma m64n128k16 and m64n64k16, ex2.approx, NVRTC sm_90a; head dim 64 up to 4k tokens {}, from 8k {}; head dim 128 up to 2k tokens {}, from 4k {}; hopper_backward.cu (warpgroups x stages x rows streamed): head dim 64 up to 4k tokens {}, from 8k {}; head dim 128 up to 4k tokens {}, from 8k {}",
        describe(HopperConfig::for_shape(4096, 64)),
        describe(HopperConfig::for_shape(8192, 64)),
        describe(HopperConfig::for_shape(2048, 128)),
        describe(HopperConfig::for_shape(4096, 128)),
        b(4096, 64),
        b(16384, 64),
        b(4096, 128),
        b(16384, 128)
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
        gpu.time_ms(|| forward_into(gpu, q, k, v, out))
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
