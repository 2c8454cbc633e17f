//! The registry: every attention method the repository has, each a type of the step that
//! adds it implementing the one trait [`Method`] (the shared core's), so one test table and
//! one benchmark run them all. Each step exports its methods; this list has one line per
//! step.

pub use flash_core::method::*;
// [step 04]
use std::any::Any;
use step04_backward::{Backward, WithBackward};
// [/step 04]

/// Every method, in the order of the steps.
pub fn all() -> Vec<&'static dyn Method> {
    let mut all = Vec::new();
    all.extend(step01_naive::methods());
    all.extend(step02_online_softmax::methods()); // [step 02]
    all.extend(step03_cuda_forward::methods()); // [step 03]
    // [step 04]
    // step 04 adds no method but a backward to four of these: each becomes the same method
    // with its backward, in the place where it stood
    give_backward(&mut all, &WithBackward(step01_naive::Naive));
    give_backward(&mut all, &WithBackward(step02_online_softmax::Online));
    give_backward(&mut all, &WithBackward(step03_cuda_forward::CudaNaive));
    give_backward(&mut all, &WithBackward(step03_cuda_forward::CudaFlash));
    // [/step 04]
    all.extend(step06_hopper::methods()); // [step 06]
    all.extend(step07_multi_gpu::methods::methods()); // [step 07]
    all
}

// [step 04]
/// Puts `with` where the method it wraps, of type `M`, stands.
fn give_backward<M: Backward>(
    all: &mut [&'static dyn Method],
    with: &'static WithBackward<M>,
) {
    let at = all.iter().position(|&m| (m as &dyn Any).is::<M>());
    let at = at.unwrap_or_else(|| panic!("{} is not in the registry", with.name()));
    all[at] = with;
}
// [/step 04]

// [step 08]
pub use step08_inference::methods::Decoder;

/// Every decoder: query rows against a cache of keys and values (step 08). They take inputs
/// of their own, so `attend` runs them and the benchmark does not (step 08's `decode-cpu`
/// and `decode-bench` measure them).
pub fn decoders() -> Vec<&'static dyn Decoder> {
    step08_inference::methods::decoders()
}

/// The decoder with this name, if there is one.
pub fn decoder_by_name(name: &str) -> Option<&'static dyn Decoder> {
    decoders().into_iter().find(|d| d.name() == name)
}
// [/step 08]

/// The method with this name, or an error listing the names there are.
pub fn by_name(name: &str) -> Result<&'static dyn Method, String> {
    let all = all();
    match all.iter().find(|m| m.name() == name) {
        Some(&m) => Ok(m),
        None => {
            let why = format!(
                "no method named {name:?}; the methods are: {}",
                all.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ")
            );
            // [step 08]
            let decoders: Vec<_> = decoders().iter().map(|d| d.name()).collect();
            let why = format!(
                "{why}; attend also takes the decoders: {}",
                decoders.join(", ")
            );
            // [/step 08]
            Err(why)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--methods`, `attend` and [`by_name`] find a method by its name: a second method of
    /// the same name could never be reached.
    #[test]
    fn every_name_is_one_method() {
        let all = all();
        for m in &all {
            let same: Vec<_> = all.iter().filter(|o| o.name() == m.name()).collect();
            assert_eq!(same.len(), 1, "{} is listed {} times", m.name(), same.len());
        }
        // [step 08]
        // nor a decoder of a method's name, or of another decoder's
        for d in decoders() {
            assert!(all.iter().all(|m| m.name() != d.name()), "{}", d.name());
            let same = decoders().iter().filter(|o| o.name() == d.name()).count();
            assert_eq!(same, 1, "{} is listed {same} times", d.name());
        }
        // [/step 08]
    }
}
