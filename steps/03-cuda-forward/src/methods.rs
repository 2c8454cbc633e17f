//! This step's methods in the registry, one type each: the four lower rungs of the ladder
//! ([`Ladder`]), attention by hand on the GPU ([`CudaNaive`]) and the kernel
//! ([`CudaFlash`]). Each runs on host arrays for the tests and `attend`, and is prepared on
//! the device for the benchmark (inputs made once there, each timed run bracketed by CUDA
//! events, peak memory from the stream-ordered pool's high-water mark).

use flash_core::inputs::random_qkv;
use flash_core::method::{DeviceRun, DeviceRunSpec};
use flash_core::{
    Attention, AttnError, Describe, Descriptor, Device, Dtype, Method, check_qkv,
};
use ndarray::ArrayView4;

use crate::gpu::{DeviceTensor, Gpu, half_dtype};
use crate::{DeviceAttention, Rung};

/// This step's methods, as the benchmark and the cross-step tests run them: the ladder of
/// kernels that leads to the FlashAttention kernel, attention by hand, then the kernel
/// itself (the ladder's last rung).
pub fn methods() -> Vec<&'static dyn Method> {
    vec![
        &Ladder(Rung::Rows),
        &Ladder(Rung::Shared),
        &Ladder(Rung::Mma),
        &Ladder(Rung::Ldmatrix),
        &CudaNaive,
        &CudaFlash,
    ]
}

/// A method of this step, on the GPU: it computes in bf16 or f16.
const fn on_gpu(name: &'static str, about: &'static str) -> Descriptor {
    Descriptor::new(name, "03-cuda-forward", Device::Cuda, about)
}

/// One line about the GPU, for the benchmark's header.
pub fn describe() -> Result<String, AttnError> {
    Ok(Gpu::shared()?.describe())
}

/// A lower rung of the ladder (rungs 1 to 4; rung 5 is [`CudaFlash`]): its name and
/// description are the ladder's own.
#[derive(Clone, Copy, Debug)]
pub struct Ladder(pub Rung);

impl Describe for Ladder {
    fn descriptor(&self) -> Descriptor {
        on_gpu(self.0.name(), self.0.describe())
    }
}

impl Method for Ladder {
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        // bad shapes and dtypes are refused the same way with or without a GPU
        check_qkv(&q, &k, &v)?;
        let dtype = half_dtype(dtype)?;
        Gpu::shared()?.ladder_attention(self.0, q, k, v, dtype)
    }
    fn describe_device(&self) -> Result<String, AttnError> {
        describe()
    }
    fn prepare_forward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare(Which::Ladder(self.0), spec)
    }
}

/// `cuda_naive`: attention by hand on the GPU, cuBLAS through the whole table and a softmax
/// kernel.
#[derive(Clone, Copy, Debug)]
pub struct CudaNaive;

impl Describe for CudaNaive {
    fn descriptor(&self) -> Descriptor {
        on_gpu(
            "cuda_naive",
            "attention by hand on the GPU: cuBLAS products and a softmax kernel through the whole [b·h, T, T] table in device memory",
        )
    }
}

impl Method for CudaNaive {
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        check_qkv(&q, &k, &v)?;
        let dtype = half_dtype(dtype)?;
        Gpu::shared()?.attention_by_hand(q, k, v, dtype)
    }
    fn describe_device(&self) -> Result<String, AttnError> {
        describe()
    }
    fn prepare_forward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare(Which::ByHand, spec)
    }
}

/// `cuda_flash`: the FlashAttention forward kernel, `kernels/flash_forward.cu`: the output
/// and the log-sum-exp, nothing of size T².
#[derive(Clone, Copy, Debug)]
pub struct CudaFlash;

impl Describe for CudaFlash {
    fn descriptor(&self) -> Descriptor {
        on_gpu(
            "cuda_flash",
            "the FlashAttention forward kernel: tensor cores (mma.sync), keys and values streamed through shared memory, no T×T table",
        )
    }
}

impl Method for CudaFlash {
    /// The kernel, its tiles for head dim 64, how it loads.
    fn implementation(&self) -> String {
        format!(
            "flash_forward.cu: {} (head dim 64), mma.sync m16n8k16, cp.async two stages, NVRTC",
            crate::kernel::describe(64)
        )
    }
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        check_qkv(&q, &k, &v)?;
        let dtype = half_dtype(dtype)?;
        Gpu::shared()?.attention(q, k, v, dtype)
    }
    fn describe_device(&self) -> Result<String, AttnError> {
        describe()
    }
    fn prepare_forward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare(Which::Flash, spec)
    }
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
            Which::Ladder(rung) => {
                gpu.peak_allocated(|| gpu.ladder_forward(rung, q, k, v))?.1
            }
            Which::ByHand => gpu.peak_allocated(|| gpu.by_hand(q, k, v))?.1,
        };
        peak.ok_or_else(|| AttnError::Device {
            what: "this driver has no stream-ordered memory pool to read a peak from"
                .into(),
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
