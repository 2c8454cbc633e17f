//! This step's methods in the registry: the kernel and attention by hand on the GPU, on host
//! arrays for the tests and `attend`, and prepared on the device for the benchmark (inputs
//! made once there, each timed run bracketed by CUDA events, peak memory from the
//! stream-ordered pool's high-water mark).

use flash_core::inputs::random_qkv;
use flash_core::method::{DeviceHooks, DeviceRun, DeviceRunSpec, ForwardDtypeFn};
use flash_core::{Attention, AttnError, Device, Dtype, ForwardFn, Method, check_qkv};
use ndarray::ArrayView4;

use crate::{DeviceAttention, DeviceTensor, ForwardConfig, Gpu, Rung, half_dtype};

/// This step's methods, as the benchmark and the cross-step tests run them.
pub fn methods() -> Vec<Method> {
    // the ladder of kernels that leads to the FlashAttention kernel, rung by rung: each rung's
    // name and description are the ladder's own (the last rung is cuda_flash, below)
    let ladder = (0..3).map(|i| {
        let rung = Rung::ALL[i];
        Method::new(
            rung.name(),
            "03-cuda-forward",
            Device::Cuda,
            rung.describe(),
            LADDER_FORWARD[i],
        )
        .with_dtype(LADDER_FORWARD_DTYPE[i])
        .with_gpu(LADDER_HOOKS[i])
    });
    ladder
        .chain([
        Method::new(
            "cuda_naive",
            "03-cuda-forward",
            Device::Cuda,
            "attention by hand on the GPU: cuBLAS products and a softmax kernel through the whole [b·h, T, T] table in device memory",
            naive_forward,
        )
        .with_dtype(naive_forward_dtype)
        .with_gpu(NAIVE_HOOKS),
        Method::new(
            "cuda_flash",
            "03-cuda-forward",
            Device::Cuda,
            "the FlashAttention forward kernel: tensor cores (mma.sync), keys and values streamed through shared memory, no T×T table",
            flash_forward,
        )
        .with_dtype(flash_forward_dtype)
        .with_implementation(flash_implementation)
        .with_gpu(FLASH_HOOKS),
        ])
        .collect()
}

/// Rungs 1 to 3 on host arrays, in bf16 and in the dtype asked for.
const LADDER_FORWARD: [ForwardFn; 3] = [
    ladder_forward::<0>,
    ladder_forward::<1>,
    ladder_forward::<2>,
];
const LADDER_FORWARD_DTYPE: [ForwardDtypeFn; 3] = [
    ladder_forward_dtype::<0>,
    ladder_forward_dtype::<1>,
    ladder_forward_dtype::<2>,
];

/// One line about the GPU, for the benchmark's header.
pub fn describe() -> Result<String, AttnError> {
    Ok(Gpu::shared()?.describe())
}

/// The kernel on host arrays, in bf16: `out` and the log-sum-exp, nothing of size T².
pub fn flash_forward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    flash_forward_dtype(q, k, v, Dtype::Bf16)
}

/// [`flash_forward`] in bf16 or f16.
pub fn flash_forward_dtype(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Attention, AttnError> {
    // bad shapes and dtypes are refused the same way with or without a GPU
    check_qkv(&q, &k, &v)?;
    let dtype = half_dtype(dtype)?;
    Gpu::shared()?.attention(q, k, v, dtype)
}

/// A rung of the ladder (`Rung::ALL[R]`) on host arrays, in bf16.
pub fn ladder_forward<const R: usize>(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    ladder_forward_dtype::<R>(q, k, v, Dtype::Bf16)
}

/// [`ladder_forward`] in bf16 or f16.
pub fn ladder_forward_dtype<const R: usize>(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Attention, AttnError> {
    check_qkv(&q, &k, &v)?;
    let dtype = half_dtype(dtype)?;
    Gpu::shared()?.ladder_attention(Rung::ALL[R], q, k, v, dtype)
}

/// Attention by hand on the GPU on host arrays, in bf16: cuBLAS, the whole table, a softmax
/// kernel.
pub fn naive_forward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    naive_forward_dtype(q, k, v, Dtype::Bf16)
}

/// [`naive_forward`] in bf16 or f16.
pub fn naive_forward_dtype(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Attention, AttnError> {
    check_qkv(&q, &k, &v)?;
    let dtype = half_dtype(dtype)?;
    Gpu::shared()?.attention_by_hand(q, k, v, dtype)
}

/// What `cuda_flash` runs: the kernel, its tiles for head dim 64, how it loads.
pub fn flash_implementation() -> String {
    let c = ForwardConfig::for_head_dim(64);
    format!(
        "flash_forward.cu: {} (head dim 64), mma.sync m16n8k16, cp.async two stages, NVRTC",
        c.describe()
    )
}

#[derive(Clone, Copy)]
enum Which {
    Flash,
    ByHand,
    Ladder(Rung),
}

/// A forward prepared on the device: its inputs, and for the kernel its output buffers,
/// allocated once so that a timed run is the kernel alone.
struct Prepared {
    gpu: &'static Gpu,
    which: Which,
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    out: Option<DeviceAttention>,
}

/// Random inputs of the spec on the GPU, from the spec's seed: q, k and v.
pub fn prepare_inputs(spec: &DeviceRunSpec) -> Result<[DeviceTensor; 3], AttnError> {
    let gpu = Gpu::shared()?;
    let dtype = half_dtype(spec.dtype)?;
    spec.shape.checked_len()?;
    let [q, k, v] = random_qkv(spec.shape, spec.seed);
    Ok([
        gpu.upload(q.view(), dtype)?,
        gpu.upload(k.view(), dtype)?,
        gpu.upload(v.view(), dtype)?,
    ])
}

fn prepare(which: Which, spec: &DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError> {
    let gpu = Gpu::shared()?;
    let [q, k, v] = prepare_inputs(spec)?;
    let out = match which {
        Which::Flash | Which::Ladder(_) => Some(gpu.alloc_output(spec.shape, q.dtype)?),
        Which::ByHand => None,
    };
    Ok(Box::new(Prepared {
        gpu,
        which,
        q,
        k,
        v,
        out,
    }))
}

impl DeviceRun for Prepared {
    fn time_ms(&mut self) -> Result<f64, AttnError> {
        let (gpu, q, k, v) = (self.gpu, &self.q, &self.k, &self.v);
        match (self.which, &mut self.out) {
            (Which::Flash, Some(out)) => gpu.time_ms(|| gpu.forward_into(q, k, v, out)),
            (Which::Ladder(rung), Some(out)) => {
                gpu.time_ms(|| gpu.ladder_forward_into(rung, q, k, v, out))
            }
            _ => gpu.time_ms(|| gpu.by_hand(q, k, v)),
        }
    }

    fn peak_bytes(&mut self) -> Result<u64, AttnError> {
        // the whole call as a user makes it, output allocation included
        let (gpu, q, k, v) = (self.gpu, &self.q, &self.k, &self.v);
        let peak = match self.which {
            Which::Flash => gpu.peak_allocated(|| gpu.forward(q, k, v))?.1,
            Which::Ladder(rung) => gpu.peak_allocated(|| gpu.ladder_forward(rung, q, k, v))?.1,
            Which::ByHand => gpu.peak_allocated(|| gpu.by_hand(q, k, v))?.1,
        };
        peak.ok_or_else(|| AttnError::Device {
            what: "this driver has no stream-ordered memory pool to read a peak from".into(),
        })
    }

    fn result(&mut self) -> Result<Attention, AttnError> {
        let (gpu, q, k, v) = (self.gpu, &self.q, &self.k, &self.v);
        let r = match self.which {
            Which::Flash => gpu.forward(q, k, v)?,
            Which::Ladder(rung) => gpu.ladder_forward(rung, q, k, v)?,
            Which::ByHand => gpu.by_hand(q, k, v)?,
        };
        gpu.download_attention(&r)
    }
}

pub const FLASH_HOOKS: DeviceHooks = DeviceHooks {
    describe,
    prepare: |spec| prepare(Which::Flash, spec),
};
/// Rungs 1 to 3 of the ladder, in order.
pub const LADDER_HOOKS: [DeviceHooks; 3] = [
    DeviceHooks {
        describe,
        prepare: |spec| prepare(Which::Ladder(Rung::ALL[0]), spec),
    },
    DeviceHooks {
        describe,
        prepare: |spec| prepare(Which::Ladder(Rung::ALL[1]), spec),
    },
    DeviceHooks {
        describe,
        prepare: |spec| prepare(Which::Ladder(Rung::ALL[2]), spec),
    },
];
pub const NAIVE_HOOKS: DeviceHooks = DeviceHooks {
    describe,
    prepare: |spec| prepare(Which::ByHand, spec),
};
