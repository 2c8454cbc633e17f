//! Data parallelism (step 07): one replica of the GPU trainer on each of several GPUs, each
//! taking its share of the batch, their gradients averaged by NCCL before each replica's
//! own clipping and AdamW step.
//!
//! A step on `N` GPUs is the step one GPU takes on the same batch. Rank `r` takes rows
//! `r·B/N .. (r+1)·B/N` of the `B` sequences step 05 draws for the step, and its backward
//! leaves the mean gradient over its rows' tokens. Every rank holds as many tokens, so the
//! mean of the `N` ranks' means, which the all-reduce leaves on every rank, is the mean
//! over the whole batch: one GPU's gradient, up to the order of the sums. From identical
//! gradients, each replica computes the same norm, clips the same way and takes the same
//! AdamW step from the same weights and moments, so the replicas stay identical without
//! ever sending a weight.
//!
//! One thread drives every GPU. A step's launches are asynchronous: the thread queues rank
//! 0's forward, then rank 1's, and so on, while the GPUs already work; the all-reduce of
//! all ranks is one NCCL group (`ncclGroupStart` … `ncclGroupEnd`), which is how a single
//! thread must call a collective over several GPUs (it would wait forever in rank 0's call
//! for rank 1's otherwise). Each rank's all-reduce sits on its replica's stream, after its
//! backward and before its optimizer step: no wait on the host between them.
//!
//! ## Layout
//!
//! - [`local_batch`]: the share of the batch each GPU takes, or why the batch does not
//!   split.
//! - [`DataParallel`]: the replicas and their communicators, [`DataParallel::all_reduce`],
//!   and the [`Learner`] the training loop drives.

use std::time::Instant;

use ndarray::{ArrayView2, s};
use step03_cuda_forward::gpu::cudarc::driver::CudaEvent;
use step03_cuda_forward::gpu::cudarc::driver::sys::CUevent_flags;
use step03_cuda_forward::gpu::cudarc::nccl::safe::{
    Comm, ReduceOp, group_end, group_start,
};
use step03_cuda_forward::gpu::{Gpu, device_error};
use step07_multi_gpu::comm::{communicators, nccl_error};

use super::{AttentionKind, GpuTrainer};
use crate::TrainError;
use crate::checkpoint::Checkpoint;
use crate::data::{Batch, Corpus, train_batch};
use crate::model::Config;
use crate::train::{Hardware, Learner, PhaseRecord, Settings, StepRecord, Trainer};

// ANCHOR: local_batch
/// Sequences each of `gpus` GPUs takes of a step's `batch`: `--batch` is the global batch,
/// so a run on two GPUs sees the batches of a run on one.
pub fn local_batch(batch: usize, gpus: usize) -> Result<usize, TrainError> {
    if gpus == 0 {
        return Err(TrainError::Config(
            "--gpus 0: a run needs at least one GPU".into(),
        ));
    }
    if batch < gpus || !batch.is_multiple_of(gpus) {
        let accepted: Vec<String> = (1..=4).map(|k| (k * gpus).to_string()).collect();
        return Err(TrainError::Config(format!(
            "--batch {batch} does not split evenly over {gpus} GPUs: --batch is the sequences of \
             a step over all GPUs, the same number on each; with --gpus {gpus} it takes a \
             multiple of {gpus} ({}, ...)",
            accepted.join(", ")
        )));
    }
    Ok(batch / gpus)
}
// ANCHOR_END: local_batch

fn event_error(
    what: &'static str,
) -> impl Fn(step03_cuda_forward::gpu::cudarc::driver::DriverError) -> TrainError {
    move |e| TrainError::Device(device_error(what)(e))
}

/// The model on several GPUs, a replica on each, trained as one.
pub struct DataParallel {
    /// Rank `r`'s replica, on the `r`-th GPU given; rank 0's is the one that is saved.
    replicas: Vec<GpuTrainer>,
    /// Rank `r`'s communicator, on replica `r`'s stream.
    comms: Vec<Comm>,
    /// Events on each rank's stream just before and just after its all-reduce.
    marks: Vec<(CudaEvent, CudaEvent)>,
    /// Each rank's all-reduce milliseconds summed over the timed steps (all but the first).
    allreduce_total: Vec<f64>,
    timed: usize,
    /// Steps taken by this trainer.
    seen: usize,
}

impl DataParallel {
    /// A replica of `start` (its weights, AdamW's moments and step) on each of `gpus`, rank
    /// `r` on `gpus[r]`, for steps of `batch` sequences of `seq_len` tokens over all of
    /// them ([`local_batch`] each). Only rank 0 profiles (`profile`), the all-reduce among
    /// its phases.
    pub fn new(
        start: &Trainer,
        gpus: &[&'static Gpu],
        batch: usize,
        seq_len: usize,
        attention: AttentionKind,
        profile: bool,
    ) -> Result<DataParallel, TrainError> {
        let local = local_batch(batch, gpus.len())?;
        // NCCL first: without it, nothing is allocated
        let comms = communicators(gpus.iter().map(|g| g.stream().clone()).collect())
            .map_err(TrainError::Device)?;
        let replicas = gpus
            .iter()
            .enumerate()
            .map(|(r, gpu)| {
                GpuTrainer::new_on(gpu, start, local, seq_len, attention, profile && r == 0)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let event = |gpu: &Gpu| {
            gpu.context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(event_error("creating an event"))
        };
        let marks = gpus
            .iter()
            .map(|gpu| Ok((event(gpu)?, event(gpu)?)))
            .collect::<Result<Vec<_>, TrainError>>()?;
        Ok(DataParallel {
            allreduce_total: vec![0.0; gpus.len()],
            replicas,
            comms,
            marks,
            timed: 0,
            seen: 0,
        })
    }

    /// The replicas, rank by rank.
    pub fn replicas(&self) -> &[GpuTrainer] {
        &self.replicas
    }

    /// Sequences a step takes over all GPUs.
    pub fn batch(&self) -> usize {
        self.replicas[0].batch * self.replicas.len()
    }

    // ANCHOR: batch_split
    /// Copies a step's batch to the GPUs: rank `r` takes the `r`-th run of `batch / N`
    /// consecutive rows.
    fn upload(
        &mut self,
        inputs: ArrayView2<u8>,
        targets: ArrayView2<u8>,
    ) -> Result<(), TrainError> {
        let (each, all) = (self.replicas[0].batch, self.batch());
        if inputs.nrows() != all {
            return Err(TrainError::Config(format!(
                "a batch of {} sequences, but the trainer was made for {all} over {} GPUs",
                inputs.nrows(),
                self.replicas.len()
            )));
        }
        for (r, replica) in self.replicas.iter_mut().enumerate() {
            let rows = r * each..(r + 1) * each;
            replica.upload_batch(
                inputs.slice(s![rows.clone(), ..]),
                targets.slice(s![rows, ..]),
            )?;
        }
        Ok(())
    }
    // ANCHOR_END: batch_split

    // ANCHOR: all_reduce
    /// Every rank's gradients become the mean of all ranks': one in-place all-reduce of the
    /// flat `f32` gradient buffer per rank, queued on the rank's stream after its backward,
    /// all of them in one NCCL group since one thread calls them all.
    pub fn all_reduce(&mut self) -> Result<(), TrainError> {
        for (replica, (before, _)) in self.replicas.iter().zip(&self.marks) {
            before
                .record(replica.gpu.stream())
                .map_err(event_error("recording an event"))?;
        }
        let nccl = |what| move |e| TrainError::Device(nccl_error(what)(e));
        group_start().map_err(nccl("starting the all-reduce's group"))?;
        let mut queued = Ok(());
        for (replica, comm) in self.replicas.iter_mut().zip(&self.comms) {
            // the mean of equal token counts' means: the whole batch's mean gradient
            queued = comm
                .all_reduce_in_place(&mut replica.grads._slice, &ReduceOp::Avg)
                .map(|_| ());
            if queued.is_err() {
                break;
            }
        }
        // the group is closed even after a failed call, or NCCL stays in it
        let ended = group_end();
        queued.map_err(nccl("queueing the gradients' all-reduce"))?;
        ended.map_err(nccl("the gradients' all-reduce"))?;
        for (replica, (_, after)) in self.replicas.iter().zip(&self.marks) {
            after
                .record(replica.gpu.stream())
                .map_err(event_error("recording an event"))?;
        }
        let rank0 = &mut self.replicas[0];
        rank0.profiler.mark(rank0.gpu, "all-reduce")?;
        Ok(())
    }
    // ANCHOR_END: all_reduce

    /// The mean of the ranks' losses of the uploaded batch (each over as many tokens: the
    /// batch's mean loss), and rank 0's gradient norm (every rank's is the same). Waits for
    /// every GPU.
    fn read_scalars(&mut self) -> Result<(f32, f32), TrainError> {
        let mut sum = 0.0f64;
        let mut norm = 0.0;
        for (r, replica) in self.replicas.iter_mut().enumerate() {
            let [loss, n] = replica.read_scalars()?;
            sum += loss as f64;
            if r == 0 {
                norm = n;
            }
        }
        Ok(((sum / self.replicas.len() as f64) as f32, norm))
    }

    /// The loss of one batch of [`DataParallel::batch`] sequences, split over the GPUs,
    /// without gradients.
    pub fn loss(
        &mut self,
        inputs: ArrayView2<u8>,
        targets: ArrayView2<u8>,
    ) -> Result<f32, TrainError> {
        self.upload(inputs, targets)?;
        for replica in &mut self.replicas {
            replica.forward(false)?;
        }
        Ok(self.read_scalars()?.0)
    }

    /// The weights, AdamW's state and the step of rank 0 (every rank's are the same),
    /// copied back: a CPU [`Trainer`], which saves checkpoints.
    pub fn to_trainer(&self) -> Result<Trainer, TrainError> {
        self.replicas[0].to_trainer()
    }

    /// After every GPU has finished a step: each rank's all-reduce time, rank 0's profile.
    fn finish_step(&mut self) -> Result<(), TrainError> {
        if self.seen > 0 {
            for (total, (before, after)) in self.allreduce_total.iter_mut().zip(&self.marks)
            {
                *total += before
                    .elapsed_ms(after)
                    .map_err(event_error("reading an event"))?
                    as f64;
            }
            self.timed += 1;
        }
        self.seen += 1;
        for replica in &mut self.replicas {
            replica.profiler.finish_step()?;
        }
        Ok(())
    }
}

impl Learner for DataParallel {
    fn config(&self) -> Config {
        self.replicas[0].config
    }

    fn steps_done(&self) -> usize {
        self.replicas[0].step
    }

    fn params_count(&self) -> usize {
        self.replicas[0].params_count()
    }

    // ANCHOR: parallel_train_step
    fn train_step(
        &mut self,
        corpus: &Corpus,
        settings: &Settings,
    ) -> Result<StepRecord, TrainError> {
        let started = Instant::now();
        let step = self.steps_done();
        // the batch one GPU would take, split by rows
        let Batch {
            inputs,
            targets,
            .. // [step 09]
        } = train_batch(
            &corpus.train,
            settings.batch,
            settings.seq_len,
            settings.seed,
            step,
        );
        self.upload(inputs.view(), targets.view())?;
        // queued rank by rank; the GPUs run them side by side
        for replica in &mut self.replicas {
            replica.forward(true)?;
        }
        for replica in &mut self.replicas {
            replica.backward()?;
        }
        self.all_reduce()?;
        let lr = settings.schedule.lr(step);
        for replica in &mut self.replicas {
            replica.optimizer_step(lr, settings.clip)?;
        }
        // the step's one wait, for every GPU
        let (loss, grad_norm) = self.read_scalars()?;
        self.finish_step()?;
        for replica in &mut self.replicas {
            replica.step += 1;
        }
        let seconds = started.elapsed().as_secs_f64();
        Ok(StepRecord::timed(
            step + 1,
            loss,
            lr,
            grad_norm,
            seconds,
            settings.batch * settings.seq_len,
        ))
    }
    // ANCHOR_END: parallel_train_step

    fn heldout_loss(&mut self, batches: &[Batch]) -> Result<f32, TrainError> {
        let mut sum = 0.0;
        for b in batches {
            sum += self.loss(b.inputs.view(), b.targets.view())? as f64;
        }
        // a held-out pass leaves marks of its own: not a step's
        self.replicas[0].profiler.used = 0;
        Ok((sum / batches.len() as f64) as f32)
    }

    fn hardware(&self) -> Hardware {
        self.replicas[0].hardware()
    }

    fn checkpoint(&self) -> Result<Checkpoint, TrainError> {
        Ok(self.to_trainer()?.into())
    }

    /// The largest of the GPUs' high-water marks (the replicas allocate alike).
    fn peak_memory_bytes(&self) -> Result<Option<u64>, TrainError> {
        let mut peak = None;
        for replica in &self.replicas {
            if let Some(b) = replica.peak_memory_bytes()? {
                peak = Some(peak.map_or(b, |p: u64| p.max(b)));
            }
        }
        Ok(peak)
    }

    fn profile(&self) -> Vec<PhaseRecord> {
        self.replicas[0].profile()
    }

    fn gpus(&self) -> usize {
        self.replicas.len()
    }

    fn allreduce_ms(&self) -> Vec<f64> {
        let steps = self.timed.max(1) as f64;
        self.allreduce_total.iter().map(|t| t / steps).collect()
    }
}
