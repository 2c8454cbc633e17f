//! What the GPU tests share.

use step05_train::Corpus;

/// Text to draw batches from: this crate's own sources, embedded so the test binary carries
/// them to the GPU machine.
pub fn corpus() -> Corpus {
    let train = [
        include_str!("../../src/model.rs"),
        include_str!("../../src/layers.rs"),
        include_str!("../../src/train.rs"),
        include_str!("../../src/data.rs"),
    ]
    .concat();
    let heldout = [
        include_str!("../../src/optim.rs"),
        include_str!("../../src/checkpoint.rs"),
    ]
    .concat();
    Corpus {
        source: "step05-train's sources".into(),
        train: train.into_bytes(),
        heldout: heldout.into_bytes(),
        train_files: 4,
        heldout_files: 2,
    }
}
