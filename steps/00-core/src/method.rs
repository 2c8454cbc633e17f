//! One shape of function for every method, so one test table and one benchmark run them all.
//! Each step exports its methods as [`Method`] values (its `methods()`); the root crate's
//! registry lists them, one line per step.

use std::fmt;

use ndarray::ArrayView4;
use serde::{Deserialize, Serialize};
// [step 04]
use ndarray::Array4;
// [/step 04]

use crate::{Attention, AttnError};
// [step 03]
use crate::Shape;
// [/step 03]

/// Where a method runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    // [step 03]
    Cuda,
    // [/step 03]
}

impl Device {
    /// Every device, in the order the help lists them.
    pub const ALL: &[Device] = &[
        Device::Cpu,
        // [step 03]
        Device::Cuda,
        // [/step 03]
    ];

    /// The name the benchmark's `--device` takes and the JSON rows carry as `device_kind`.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            // [step 03]
            Device::Cuda => "cuda",
            // [/step 03]
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The element type a run computes in. CPU methods take `f32`; GPU methods say which they take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    // [step 03]
    Bf16,
    F16,
    // [/step 03]
}

impl Dtype {
    /// Every dtype, in the order the help lists them.
    pub const ALL: &[Dtype] = &[
        Dtype::F32,
        // [step 03]
        Dtype::Bf16,
        Dtype::F16,
        // [/step 03]
    ];

    /// The name the benchmark's `--dtype` takes and the JSON rows carry.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            // [step 03]
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            // [/step 03]
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            // [step 03]
            Dtype::Bf16 | Dtype::F16 => 2,
            // [/step 03]
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One forward method: `f32` inputs `[batch, heads, tokens, head_dim]` in, output and
/// log-sum-exp out.
pub type ForwardFn =
    fn(ArrayView4<f32>, ArrayView4<f32>, ArrayView4<f32>) -> Result<Attention, AttnError>;

// [step 03]
/// A forward that computes in the element type it is given (a GPU method: bf16 or f16), on
/// `f32` host arrays: the inputs are rounded to it, the output widened back.
pub type ForwardDtypeFn =
    fn(ArrayView4<f32>, ArrayView4<f32>, ArrayView4<f32>, Dtype) -> Result<Attention, AttnError>;
// [/step 03]

// [step 04]
/// The gradients of a scalar loss with respect to q, k and v, each `[batch, heads, tokens,
/// head_dim]` like the input it belongs to.
#[derive(Clone, Debug, PartialEq)]
pub struct Grads {
    pub dq: Array4<f32>,
    pub dk: Array4<f32>,
    pub dv: Array4<f32>,
}

impl Grads {
    /// Zero gradients of the given shape (also the gradients of an empty call).
    pub fn zeros(shape: crate::Shape) -> Self {
        Grads {
            dq: Array4::zeros(shape.dims()),
            dk: Array4::zeros(shape.dims()),
            dv: Array4::zeros(shape.dims()),
        }
    }
}

/// One backward method: q, k, v, what the forward returned for them (its log-sum-exp is what
/// lets the backward rebuild the probabilities without a stored table), and the gradient of the
/// output `dO`, all `f32`, in; dq, dk and dv out.
pub type BackwardFn = fn(
    ArrayView4<f32>,
    ArrayView4<f32>,
    ArrayView4<f32>,
    &Attention,
    ArrayView4<f32>,
) -> Result<Grads, AttnError>;

/// [`BackwardFn`] in the element type it is given, like [`ForwardDtypeFn`].
pub type BackwardDtypeFn = fn(
    ArrayView4<f32>,
    ArrayView4<f32>,
    ArrayView4<f32>,
    &Attention,
    ArrayView4<f32>,
    Dtype,
) -> Result<Grads, AttnError>;
// [/step 04]

// [step 03]
/// What the benchmark asks a GPU method to prepare: one shape, one dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRunSpec {
    pub shape: Shape,
    pub dtype: Dtype,
    /// Seed of the random inputs (and of the output's gradient, for a backward).
    pub seed: u64,
    // [step 07]
    /// GPUs to spread one call over (`--gpus`): 1 for every method but those of step 07.
    pub gpus: usize,
    // [/step 07]
}

/// A GPU method with its inputs already on the device, ready to be timed.
///
/// Preparing (compiling kernels, allocating and copying the inputs) happens once, before any
/// timing; each call below then covers the pass alone.
pub trait DeviceRun {
    /// Runs the pass once and returns its time in milliseconds, measured by events recorded on
    /// the stream just before and just after the pass's kernels.
    fn time_ms(&mut self) -> Result<f64, AttnError>;
    /// Runs the pass once and returns the device memory it allocated at its high-water mark,
    /// above what was allocated before it (the inputs): the stream-ordered pool's
    /// `USED_MEM_HIGH` (reset, run, read), or an exact count of the method's allocations.
    fn peak_bytes(&mut self) -> Result<u64, AttnError>;
    /// Runs the pass once and returns what it computed, copied to the host, so the benchmark
    /// can check it before it times it.
    fn result(&mut self) -> Result<Attention, AttnError>;
    // [step 04]
    /// For a forward and backward run: runs both once and returns the gradients, copied to
    /// the host; `None` for a forward alone.
    fn grads(&mut self) -> Result<Option<Grads>, AttnError> {
        Ok(None)
    }
    // [/step 04]
}

/// How the benchmark drives a GPU method.
#[derive(Clone, Copy, Debug)]
pub struct DeviceHooks {
    /// One line about the device: name, compute capability, driver and NVRTC versions;
    /// `AttnError::Device` when there is no usable device.
    pub describe: fn() -> Result<String, AttnError>,
    /// Makes random inputs of the spec on the device and returns the run that times one pass.
    pub prepare: fn(&DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError>,
}
// [/step 03]

/// A method and what a reader needs to know to pick it.
#[derive(Clone, Copy, Debug)]
pub struct Method {
    /// The name the benchmark's `--methods` takes.
    pub name: &'static str,
    /// The step that introduces it.
    pub step: &'static str,
    pub device: Device,
    /// One line: what it does and what it keeps in memory.
    pub about: &'static str,
    /// The forward pass on host arrays (a GPU method copies in and out): what the tests and
    /// the `attend` command call.
    pub forward: ForwardFn,
    /// What runs on this machine, when that is decided at run time: the SIMD path, the thread
    /// count, the kernel and its tiles. The benchmark prints it next to `about`.
    pub implementation: Option<fn() -> String>,
    // [step 03]
    /// For GPU methods: how the benchmark prepares the forward on the device and times it.
    pub gpu: Option<DeviceHooks>,
    /// For methods that compute in more than one element type: [`Method::forward`] in the
    /// one asked for (what `attend --dtype` calls); `forward` is this in the first of
    /// [`Method::dtypes`].
    pub forward_dtype: Option<ForwardDtypeFn>,
    // [/step 03]
    // [step 04]
    /// The backward pass on host arrays, for methods that have one.
    pub backward: Option<BackwardFn>,
    /// For GPU methods with a backward: the forward and the backward prepared and timed
    /// together on the device.
    pub gpu_backward: Option<DeviceHooks>,
    /// The backward in the element type asked for, as `forward_dtype` is the forward.
    pub backward_dtype: Option<BackwardDtypeFn>,
    // [/step 04]
    // [step 07]
    /// Whether the device hooks spread one call over several GPUs (`--gpus`).
    pub multi_gpu: bool,
    // [/step 07]
}

impl Method {
    /// A forward-only method; the `with_*` functions below add the rest.
    pub const fn new(
        name: &'static str,
        step: &'static str,
        device: Device,
        about: &'static str,
        forward: ForwardFn,
    ) -> Method {
        Method {
            name,
            step,
            device,
            about,
            forward,
            implementation: None,
            // [step 03]
            gpu: None,
            forward_dtype: None,
            // [/step 03]
            // [step 04]
            backward: None,
            gpu_backward: None,
            backward_dtype: None,
            // [/step 04]
            multi_gpu: false, // [step 07]
        }
    }

    pub const fn with_implementation(mut self, implementation: fn() -> String) -> Method {
        self.implementation = Some(implementation);
        self
    }

    // [step 03]
    pub const fn with_gpu(mut self, gpu: DeviceHooks) -> Method {
        self.gpu = Some(gpu);
        self
    }

    pub const fn with_dtype(mut self, forward_dtype: ForwardDtypeFn) -> Method {
        self.forward_dtype = Some(forward_dtype);
        self
    }

    // [step 07]
    /// Marks a method whose device hooks take [`DeviceRunSpec::gpus`] GPUs.
    pub const fn with_multi_gpu(mut self) -> Method {
        self.multi_gpu = true;
        self
    }
    // [/step 07]

    /// The element types the method computes in, its default first: f32 on the CPU, bf16
    /// and f16 for a GPU method that takes either.
    pub fn dtypes(&self) -> &'static [Dtype] {
        match (self.forward_dtype, self.device) {
            (Some(_), _) => &[Dtype::Bf16, Dtype::F16],
            (None, Device::Cpu) => &[Dtype::F32],
            (None, Device::Cuda) => &[Dtype::Bf16],
        }
    }
    // [/step 03]

    /// What runs here: the method's own report if it has one, else its one-line description.
    pub fn implementation(&self) -> String {
        match self.implementation {
            Some(report) => report(),
            None => self.about.to_string(),
        }
    }
}
