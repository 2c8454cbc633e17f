//! The registry: every attention method the repository has, each a type of the step that
//! adds it implementing the one trait [`Method`] (the shared core's), so one test table and
//! one benchmark run them all. Each step exports its methods; this list has one line per
//! step. A name on the command line resolves once, here ([`resolve`]), to an [`Entry`]: a
//! method, or from step 08 on a decoder; what is resolved is what the benchmark and
//! `attend` are given.

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
// [/step 08]

/// What a name on the command line resolves to, once: a method, or one of step 08's
/// decoders (query rows against a cache, inputs of their own: `attend` runs them, the
/// benchmark does not). Both are described the same way ([`Describe`]).
#[derive(Clone, Copy)]
pub enum Entry {
    Method(&'static dyn Method),
    // [step 08]
    Decoder(&'static dyn Decoder),
    // [/step 08]
}

impl Describe for Entry {
    fn descriptor(&self) -> Descriptor {
        match self {
            Entry::Method(m) => m.descriptor(),
            Entry::Decoder(d) => d.descriptor(), // [step 08]
        }
    }
}

impl Entry {
    /// What the messages call it: `method` or `decoder`.
    pub fn kind(self) -> &'static str {
        match self {
            Entry::Method(_) => "method",
            Entry::Decoder(_) => "decoder", // [step 08]
        }
    }
}

/// An entry prints as its name, which names one entry of the registry.
impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Every entry: the methods in the order of the steps, then the decoders.
pub fn entries() -> Vec<Entry> {
    let entries = all().into_iter().map(Entry::Method);
    // [step 08]
    let decoders = step08_inference::methods::decoders();
    let entries = entries.chain(decoders.into_iter().map(Entry::Decoder));
    // [/step 08]
    entries.collect()
}

/// The entry with this name, or an error listing the names there are: the one place a
/// name is looked up.
pub fn resolve(name: &str) -> Result<Entry, String> {
    let entries = entries();
    if let Some(&entry) = entries.iter().find(|e| e.name() == name) {
        return Ok(entry);
    }
    let names = |kind: &str| {
        let of_kind = entries.iter().filter(|e| e.kind() == kind);
        of_kind.map(|e| e.name()).collect::<Vec<_>>().join(", ")
    };
    let why = format!(
        "no method named {name:?}; the methods are: {}",
        names("method")
    );
    // [step 08]
    let why = format!(
        "{why}; attend also takes the decoders: {}",
        names("decoder")
    );
    // [/step 08]
    Err(why)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--methods` and `attend` find a method or a decoder by its name ([`resolve`]): a
    /// second entry of the same name could never be reached.
    #[test]
    fn every_name_is_one_entry() {
        let entries = entries();
        for e in &entries {
            let same = entries.iter().filter(|o| o.name() == e.name()).count();
            assert_eq!(same, 1, "{} is listed {same} times", e.name());
            assert_eq!(resolve(e.name()).map(|r| r.name()), Ok(e.name()));
        }
        // an unknown name is refused with the names there are
        let why = resolve("nope").unwrap_err();
        assert!(why.contains("\"nope\"") && why.contains("naive"), "{why}");
    }
}
