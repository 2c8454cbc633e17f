//! This step's methods in the registry: each rung of the forward's ladder, the backward's
//! first rung (two passes), and `cuda_hopper`, what the library runs (rung 1 or 4 of the
//! forward by the shape, the one-pass backward); on host arrays for the tests and `attend`,
//! and prepared on the device for the benchmark, as step 03's `cuda_flash` is.

use flash_core::method::{DeviceRun, DeviceRunSpec, Grads};
use flash_core::{
    Attention, AttnError, Describe, Descriptor, Device, Dtype, Method, Shape, check_qkv,
};
use ndarray::ArrayView4;
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::{DeviceTensor, Gpu, half_dtype};
use step03_cuda_forward::methods::{describe, prepare_inputs};
use step04_backward::cuda::{DeviceBackwardFn, DeviceGrads};
use step04_backward::methods::{Pair, on_host, prepare as prepare_pair};

use crate::backward;
use crate::forward;
use crate::kernel::{BackwardKernels, ForwardKernel, ForwardRung};

/// This step's methods, in the ladder's order: the forward's rungs, the backward's first,
/// then what runs.
pub fn methods() -> Vec<&'static dyn Method> {
    vec![
        &HopperRung(ForwardRung::Wgmma),
        &HopperRung(ForwardRung::ProducerWarpgroup),
        &HopperRung(ForwardRung::Turns),
        &HopperRung(ForwardRung::Overlap),
        &HopperTwoPasses,
        &CudaHopper,
    ]
}

/// A method of this step: on the GPU, in bf16 or f16.
fn on_gpu(name: &'static str, about: &'static str) -> Descriptor {
    Descriptor::new(name, "06-hopper", Device::Cuda, about)
}

/// Which forward kernel a method runs for a shape: the library's choice, or one rung's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forward {
    /// [`ForwardKernel::for_shape`]: rung 1 or 4.
    Library,
    /// The rung, in its shape for the length ([`ForwardRung::shape`]).
    Rung(ForwardRung),
}

impl Forward {
    pub fn kernel(self, q: Shape, kv_heads: usize) -> ForwardKernel {
        match self {
            Forward::Library => ForwardKernel::for_shape(q, kv_heads),
            Forward::Rung(rung) => rung.shape(q, kv_heads),
        }
    }

    /// The forward on host arrays, in bf16 or f16: inputs rounded to it, the output widened
    /// back.
    pub fn on_host(
        self,
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
        let mut result = gpu.alloc_output(q.shape, dtype)?;
        let kernel = self.kernel(q.shape, k.shape.heads);
        forward::forward_with(gpu, kernel, &q, &k, &v, &mut result)?;
        gpu.download_attention(&result)
    }

    /// Random inputs of `spec` on the device, and this forward on them ready to be timed.
    fn prepare(self, spec: &DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError> {
        let gpu = Gpu::shared()?;
        forward::check_hopper(gpu)?;
        let [q, k, v] = prepare_inputs(spec)?;
        forward::check(&q, &k, &v)?;
        let out = gpu.alloc_output(spec.shape, q.dtype)?;
        let kernel = self.kernel(spec.shape, spec.shape.heads);
        Ok(Box::new(Prepared {
            gpu,
            kernel,
            q,
            k,
            v,
            out,
        }))
    }
}

/// A rung of the forward's ladder, forward only.
#[derive(Clone, Copy, Debug)]
pub struct HopperRung(pub ForwardRung);

impl Describe for HopperRung {
    fn descriptor(&self) -> Descriptor {
        on_gpu(self.0.method(), self.0.about())
    }
}

impl Method for HopperRung {
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        Forward::Rung(self.0).on_host(q, k, v, dtype)
    }
    fn describe_device(&self) -> Result<String, AttnError> {
        describe()
    }
    fn prepare_forward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        Forward::Rung(self.0).prepare(spec)
    }
}

/// The backward's first rung, step 04's two passes, after `cuda_hopper`'s forward.
#[derive(Clone, Copy, Debug)]
pub struct HopperTwoPasses;

impl Describe for HopperTwoPasses {
    fn descriptor(&self) -> Descriptor {
        on_gpu(
            "hopper_two_passes",
            "Hopper backward rung 1: step 04's two passes (dK and dV, then dQ), the same bits every run; the forward is cuda_hopper's",
        )
    }
}

impl Method for HopperTwoPasses {
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        Forward::Library.on_host(q, k, v, dtype)
    }
    fn describe_device(&self) -> Result<String, AttnError> {
        describe()
    }
    fn prepare_forward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        Forward::Library.prepare(spec)
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
        on_host(two_passes, q, k, v, fwd, dout, dtype)
    }
    fn prepare_backward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare_pair(pair(two_passes), spec)
    }
}

/// What the library runs: rung 1 or 4 of the forward by the shape, the one-pass backward.
#[derive(Clone, Copy, Debug)]
pub struct CudaHopper;

impl Describe for CudaHopper {
    fn descriptor(&self) -> Descriptor {
        on_gpu(
            "cuda_hopper",
            "FlashAttention with Hopper's instructions (TMA, wgmma, warp specialisation), no T×T table: rung 1 or 4 of the forward by the shape, the backward in one pass (compute capability 9.0, head dims 64 and 128)",
        )
    }
}

impl Method for CudaHopper {
    fn implementation(&self) -> String {
        // at 4 × 12 heads
        let f = |t, d| ForwardKernel::for_shape(Shape::new(4, 12, t, d), 12).name();
        format!(
            "forward rung 1 (kernels/forward_1_wgmma.cu) at head dim 64 up to 4k tokens ({}), rung 4 (forward_4_overlap.cu) beyond ({}) and at 128 ({}); backward in one pass (backward_2_one_pass.cu: {}); warpgroups x stages x blocks a multiprocessor; NVRTC sm_90a",
            f(4096, 64),
            f(8192, 64),
            f(8192, 128),
            BackwardKernels::for_shape(Shape::new(4, 12, 8192, 64)).name(),
        )
    }
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        Forward::Library.on_host(q, k, v, dtype)
    }
    fn describe_device(&self) -> Result<String, AttnError> {
        describe()
    }
    fn prepare_forward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        Forward::Library.prepare(spec)
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
        on_host(backward::backward, q, k, v, fwd, dout, dtype)
    }
    fn prepare_backward(
        &self,
        spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        prepare_pair(pair(backward::backward), spec)
    }
}

/// The backward's first rung, the two passes.
fn two_passes(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    let kernels = BackwardKernels::two_passes(q.shape);
    backward::backward_with(gpu, kernels, q, k, v, fwd, dout)
}

/// `cuda_hopper`'s forward with `backward`, prepared together for the benchmark's backward.
fn pair(backward: DeviceBackwardFn) -> Pair {
    Pair {
        forward: forward::forward,
        forward_into: Some(|gpu, q, k, v, out| {
            let kernel = ForwardKernel::for_shape(q.shape, k.shape.heads);
            forward::forward_with(gpu, kernel, q, k, v, out)
        }),
        backward,
    }
}

struct Prepared {
    gpu: &'static Gpu,
    kernel: ForwardKernel,
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    out: DeviceAttention,
}

impl DeviceRun for Prepared {
    fn time_ms(&mut self) -> Result<f64, AttnError> {
        let (gpu, kernel) = (self.gpu, self.kernel);
        let (q, k, v, out) = (&self.q, &self.k, &self.v, &mut self.out);
        gpu.time_ms(|| forward::forward_with(gpu, kernel, q, k, v, out))
    }

    fn peak_bytes(&mut self) -> Result<u64, AttnError> {
        let (gpu, kernel, q, k, v) = (self.gpu, self.kernel, &self.q, &self.k, &self.v);
        gpu.peak_allocated(|| {
            let mut out = gpu.alloc_output(q.shape, q.dtype)?;
            forward::forward_with(gpu, kernel, q, k, v, &mut out)?;
            Ok(out)
        })?
        .1
        .ok_or_else(|| AttnError::Device {
            what: "this driver has no stream-ordered memory pool to read a peak from"
                .into(),
        })
    }

    fn result(&mut self) -> Result<Attention, AttnError> {
        let mut out = self.gpu.alloc_output(self.q.shape, self.q.dtype)?;
        forward::forward_with(self.gpu, self.kernel, &self.q, &self.k, &self.v, &mut out)?;
        self.gpu.download_attention(&out)
    }
}
