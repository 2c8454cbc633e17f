//! Every attention method the repository has, behind one shape of function, so one test table
//! and one benchmark can run them all.

use ndarray::ArrayView4;
use step01_naive::{Attention, AttnError};

/// Where a method runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

/// One forward method: `f32` inputs `[batch, heads, tokens, head_dim]` in, output and
/// log-sum-exp out.
pub type ForwardFn =
    fn(ArrayView4<f32>, ArrayView4<f32>, ArrayView4<f32>) -> Result<Attention, AttnError>;

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
    pub forward: ForwardFn,
}

/// Every method, in the order of the steps.
pub fn all() -> Vec<Method> {
    vec![Method {
        name: "naive",
        step: "01-naive",
        device: Device::Cpu,
        about: "attention by hand: the whole [b, h, T, T] table of scores, single-threaded",
        forward: step01_naive::attention,
    }]
}

/// The method with this name, or an error listing the names there are.
pub fn by_name(name: &str) -> Result<Method, String> {
    all().into_iter().find(|m| m.name == name).ok_or_else(|| {
        let names: Vec<_> = all().iter().map(|m| m.name).collect();
        format!(
            "no method named {name:?}; the methods are: {}",
            names.join(", ")
        )
    })
}
