//! Data parallelism (step 07): `train --device cuda --gpus N`, a replica of the GPU trainer
//! on each of N GPUs, the batch split over them, the gradients averaged by NCCL.
//!
//! On two GPUs, a run must be the run of one GPU on the same batches: the same losses, up
//! to the order in which bf16 products and the sums of the loss and the gradients round
//! (cuBLAS picks its algorithms by the product's shape, and each GPU sums half the rows);
//! and its replicas must stay identical bit for bit, since each takes the same AdamW step
//! from the same averaged gradients. Without GPUs, what can be checked is that bad requests
//! are refused, with a reason, before anything loads.
//!
//! The two-GPU test is `#[ignore = "needs two CUDA GPUs and NCCL"]`, and its name starts
//! with `two_gpus`: a machine without them lists it as ignored; `-- --include-ignored` runs
//! it, and run on fewer than two GPUs or without NCCL it fails, saying what it found. On a
//! machine with one GPU, run the others with `-- --include-ignored --skip two_gpus`.

mod common;
use common::{corpus, refused};

use step05_train::cuda::parallel::{DataParallel, local_batch};
use step05_train::cuda::{AttentionKind, GpuTrainer};
use step05_train::data::train_batch;
use step05_train::optim::{AdamWSettings, Schedule};
use step05_train::train::RunRecord;
use step05_train::{Config, Settings, Trainer, train};

/// A step's loss on two GPUs against one GPU's, relatively, at every step of the run: the
/// same model, weights and batches; only the rounding of bf16 products and of the sums
/// differs (measured on two H200s: 1.2e-5 at most over the 20 steps and the held-out
/// losses).
const LOSS_TOL: f64 = 2e-3;
/// The gradients' norm likewise (a norm is more sensitive than the loss to the rounding of
/// the gradients' small components; measured: 1.7e-4 at most).
const NORM_TOL: f64 = 5e-2;

// ANCHOR: refused
#[test]
fn bad_gpu_counts_and_batches_are_refused_with_a_reason() {
    refused(&["--gpus", "0"], &["--gpus 0", "at least one GPU"]);
    refused(&["--gpus", "2"], &["--gpus 2", "--device cuda"]);
    refused(
        &["--device", "cuda", "--gpus", "2", "--batch", "5"],
        &["--batch 5", "2 GPUs", "2, 4, 6, 8"],
    );
    refused(
        &["--device", "cuda", "--gpus", "3", "--batch", "4"],
        &["--batch 4", "3, 6, 9, 12"],
    );
    // more GPUs than any machine here has
    refused(
        &["--device", "cuda", "--gpus", "64", "--batch", "64"],
        &["--gpus 64"],
    );
}
// ANCHOR_END: refused

#[test]
fn the_batch_splits_evenly_over_the_gpus() {
    assert_eq!(local_batch(24, 2).unwrap(), 12);
    assert_eq!(local_batch(24, 1).unwrap(), 24);
    assert_eq!(local_batch(4, 4).unwrap(), 1);
    for (batch, gpus) in [(5, 2), (2, 4), (0, 2), (4, 0)] {
        assert!(local_batch(batch, gpus).is_err(), "{batch} over {gpus}");
    }
}

const SMALL: Config = Config {
    layers: 2,
    d_model: 64,
    heads: 2,
    kv_heads: 2, // [step 08]
    context: 64,
    vocab: 256,
};

fn settings(batch: usize, steps: usize) -> Settings {
    Settings {
        batch,
        seq_len: 64,
        steps,
        schedule: Schedule {
            max: 3e-3,
            min: 3e-4,
            warmup: 5,
            steps,
        },
        adamw: AdamWSettings::default(),
        clip: 1.0,
        seed: 1337,
        eval_every: 10,
        eval_batches: 2,
        max_seconds: None,
        documents: false, // [step 09]
    }
}

#[test]
fn a_run_record_from_before_data_parallelism_reads_as_one_gpu() {
    let settings = settings(2, 1);
    let mut cpu = Trainer::new(SMALL, &settings).unwrap();
    let run = train(&mut cpu, &corpus(), &settings, |_| {}).unwrap();
    assert_eq!((run.gpus, run.allreduce_ms.len()), (1, 0));
    let mut json = serde_json::to_value(&run).unwrap();
    let fields = json.as_object_mut().unwrap();
    fields.remove("gpus");
    fields.remove("allreduce_ms");
    let old: RunRecord = serde_json::from_value(json).unwrap();
    assert_eq!(old, run);
}

fn rel(a: f32, b: f32) -> f64 {
    ((a - b) / b).abs() as f64
}

// ANCHOR: two_gpus
#[test]
#[ignore = "needs two CUDA GPUs and NCCL"]
fn two_gpus_train_as_one_on_the_same_batches() {
    let (there, nccl) = (
        step03_cuda_forward::gpu::Gpu::count(),
        step07_multi_gpu::comm::nccl_present(),
    );
    assert!(
        there >= 2 && nccl,
        "this test needs two GPUs and NCCL; this machine has {there} GPU(s), NCCL {}",
        if nccl { "found" } else { "not found" }
    );
    let (batch, steps) = (4, 20);
    let settings = settings(batch, steps);
    let corpus = corpus();
    let start = Trainer::new(SMALL, &settings).unwrap();
    let mut one = GpuTrainer::new(&start, batch, 64, AttentionKind::Flash, false).unwrap();
    let gpus = step07_multi_gpu::comm::gpus(2).unwrap();
    let mut two =
        DataParallel::new(&start, &gpus, batch, 64, AttentionKind::Flash, false).unwrap();
    let run1 = train(&mut one, &corpus, &settings, |_| {}).unwrap();
    let run2 = train(&mut two, &corpus, &settings, |_| {}).unwrap();
    let (mut worst_loss, mut worst_norm) = (0f64, 0f64);
    for (a, b) in run2.steps.iter().zip(&run1.steps) {
        let (el, en) = (rel(a.loss, b.loss), rel(a.grad_norm, b.grad_norm));
        eprintln!(
            "step {:>2}: loss 2 GPUs {:.5}, 1 GPU {:.5} (relative {el:.1e}); norm {:.4}, \
            {:.4} ({en:.1e})",
            a.step, a.loss, b.loss, a.grad_norm, b.grad_norm
        );
        worst_loss = worst_loss.max(el);
        worst_norm = worst_norm.max(en);
    }
    for (a, b) in run2.evals.iter().zip(&run1.evals) {
        eprintln!(
            "held-out after {:>2}: 2 GPUs {:.5}, 1 GPU {:.5}",
            a.step, a.loss, b.loss
        );
        worst_loss = worst_loss.max(rel(a.loss, b.loss));
    }
    eprintln!(
        "largest relative difference: loss {worst_loss:.2e}, norm {worst_norm:.2e}; \
        all-reduce {:?} ms a step",
        run2.allreduce_ms
    );
    assert_eq!(run2.steps.len(), steps);
    assert!(worst_loss < LOSS_TOL, "a loss differs by {worst_loss:.2e}");
    assert!(worst_norm < NORM_TOL, "a norm differs by {worst_norm:.2e}");
    assert_eq!((run1.gpus, run2.gpus), (1, 2));
    assert_eq!(run2.allreduce_ms.len(), 2);
    assert!(run2.allreduce_ms.iter().all(|&ms| ms > 0.0));
    assert!(run2.peak_memory_bytes.is_some_and(|b| b > 0));

    // the replicas are one model: weights, moments and steps bit for bit
    let ranks: Vec<Trainer> = two
        .replicas()
        .iter()
        .map(|r| r.to_trainer().unwrap())
        .collect();
    let bits = |p: &step05_train::Params<f32>| -> Vec<u32> {
        p.tensors()
            .iter()
            .flat_map(|(_, t)| t.iter().map(|x| x.to_bits()))
            .collect()
    };
    for (r, rank) in ranks.iter().enumerate().skip(1) {
        assert!(
            bits(&rank.params) == bits(&ranks[0].params),
            "rank {r}'s weights differ from rank 0's"
        );
        assert!(
            bits(&rank.opt.m) == bits(&ranks[0].opt.m),
            "rank {r}'s first moments differ"
        );
        assert!(
            bits(&rank.opt.v) == bits(&ranks[0].opt.v),
            "rank {r}'s second moments differ"
        );
        assert_eq!((rank.step, rank.opt.t), (ranks[0].step, ranks[0].opt.t));
    }

    // a checkpoint of rank 0 goes on, on two GPUs, with the same state: the same next loss
    let back = two.to_trainer().unwrap();
    assert_eq!(back.step, steps);
    let mut resumed =
        DataParallel::new(&back, &gpus, batch, 64, AttentionKind::Flash, false).unwrap();
    let b = train_batch(&corpus.train, batch, 64, 1337, steps);
    let x = two.loss(b.inputs.view(), b.targets.view()).unwrap();
    let y = resumed.loss(b.inputs.view(), b.targets.view()).unwrap();
    assert_eq!(x.to_bits(), y.to_bits(), "a resumed trainer's loss");
}
// ANCHOR_END: two_gpus
