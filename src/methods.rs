//! The registry: every attention method the repository has, behind one shape of function
//! ([`Method`], from the shared core), so one test table and one benchmark can run them all.
//! Each step exports its own methods; this list has one line per step.

pub use flash_core::method::*;

/// Every method, in the order of the steps.
pub fn all() -> Vec<Method> {
    let mut all = Vec::new();
    all.extend(step01_naive::methods());
    all.extend(step02_online_softmax::methods()); // [step 02]
    all.extend(step03_cuda_forward::methods()); // [step 03]
    step04_backward::add_backwards(&mut all); // [step 04]
    all.extend(step06_hopper::methods()); // [step 06]
    all.extend(step07_multi_gpu::methods::methods()); // [step 07]
    all
}

/// The method with this name, or an error listing the names there are.
pub fn by_name(name: &str) -> Result<Method, String> {
    let all = all();
    match all.iter().find(|m| m.name == name) {
        Some(m) => Ok(*m),
        None => Err(format!(
            "no method named {name:?}; the methods are: {}",
            all.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        )),
    }
}
