//! [`DistributedSampler`]: which samples each rank trains on, for any number of ranks, and
//! the same samples again after the world changed size.
//!
//! PyTorch's `DistributedSampler` splits a dataset over a fixed world. Here the unit is the
//! **global batch of a step**: step `s` (counted over the whole run, as `run_elastic`'s
//! step counter is) takes the `s`-th `global_batch` samples of its epoch's order (shuffled
//! per epoch, the same on every rank), whatever the number of ranks; each rank takes its
//! part of them ([`BatchSplit`]: padded, dropped or uneven, as PyTorch's). After a recovery the
//! ranks left agree on the step, so the next step's global batch is the one the lost rank
//! never finished, split over the new world: no sample is skipped or seen twice, and with
//! [`BatchSplit::Uneven`] and [`BatchPart::weight`] the averaged gradient is the whole global batch's,
//! on 4 ranks, 3, or 1.
//!
//! ```
//! use nccl_safe_candle::{DistributedSampler, BatchSplit};
//!
//! // 10 samples, global batches of 4: steps 0 and 1 take 4 each, step 2 the last 2.
//! let sampler = DistributedSampler::new(10, 4)?.split(BatchSplit::Uneven);
//! assert_eq!(sampler.steps_per_epoch(), 3);
//! // Step 1 on 3 ranks: samples 4, 5, 6, 7; rank 0 takes two of them.
//! let part = sampler.part(1, 0, 3)?;
//! assert_eq!(part.indices, vec![4, 7]);
//! // The same step on 2 ranks (after a loss) takes the same samples.
//! let all: Vec<usize> = (0..2).flat_map(|r| sampler.part(1, r, 2).unwrap().indices).collect();
//! assert_eq!({ let mut a = all; a.sort(); a }, vec![4, 5, 6, 7]);
//! # Ok::<(), nccl_safe_candle::DistError>(())
//! ```

use candle_core::{Device, Tensor};

use crate::error::{DistErrorKind as K, DistResult as Result};

/// How a global batch that does not divide by the number of ranks is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchSplit {
    /// Every rank takes `ceil(batch / world)` samples: the batch is padded with its own
    /// first samples (PyTorch's default, `drop_last=False`); a padded sample counts twice.
    #[default]
    Pad,
    /// Every rank takes `floor(batch / world)` samples: the rest of the batch is not trained
    /// on this step (PyTorch's `drop_last=True`).
    DropLast,
    /// Rank `r` takes `batch / world` samples, one more when `r < batch % world`: every
    /// sample once. DDP averages the ranks' gradients with equal weights, so scale each
    /// rank's mean loss by its [`BatchPart::weight`] for the global batch's exact mean.
    Uneven,
}

/// This rank's part of one step's global batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchPart {
    /// The dataset indices of this rank's samples, in order.
    pub indices: Vec<usize>,
    /// What to multiply this rank's mean loss by so that the ranks' averaged gradient is
    /// the mean over the samples the ranks took: `len * world / taken` (1 for
    /// [`BatchSplit::Pad`] and [`BatchSplit::DropLast`], whose parts are equal).
    pub weight: f64,
    /// The epoch the step belongs to.
    pub epoch: u64,
}

impl BatchPart {
    /// Rows `indices` of `t` along its first dimension (a copy): this rank's samples of a
    /// tensor that holds the whole dataset.
    #[track_caller]
    pub fn select(&self, t: &Tensor) -> Result<Tensor> {
        let (at, _scope) = crate::error::caller_scope();
        (|| -> Result<Tensor> {
            let n = t.dim(0)?;
            if let Some(&i) = self.indices.iter().find(|&&i| i >= n) {
                return Err(K::Shape {
                    call: "BatchPart::select",
                    reason: format!("sample {i} is out of a tensor of {n} rows"),
                }
                .into());
            }
            let idx: Vec<u32> = self.indices.iter().map(|&i| i as u32).collect();
            let idx =
                Tensor::from_vec(idx, self.indices.len(), &Device::Cpu)?.to_device(t.device())?;
            Ok(t.index_select(&idx, 0)?)
        })()
        .map_err(|e| e.at(at, None))
    }
}

/// The samples of each step for each rank of any world; see the [module](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    global_batch: usize,
    split: BatchSplit,
    shuffle: Option<u64>,
}

impl DistributedSampler {
    /// Over a dataset of `len` samples, `global_batch` samples per step over all ranks (the
    /// last step of an epoch takes what is left), in order, [`BatchSplit::Pad`]. Both must be at
    /// least 1, and `global_batch` at most `len`.
    #[track_caller]
    pub fn new(len: usize, global_batch: usize) -> Result<DistributedSampler> {
        if len == 0 || global_batch == 0 || global_batch > len {
            return Err(crate::DistError::new(K::InvalidArgument {
                call: "DistributedSampler::new",
                reason: format!(
                    "a global batch of {global_batch} from {len} samples: both must be at least 1, \
                     the batch at most the dataset"
                ),
            }));
        }
        Ok(DistributedSampler {
            len,
            global_batch,
            split: BatchSplit::Pad,
            shuffle: None,
        })
    }

    /// How a global batch that does not divide by the number of ranks is split.
    pub fn split(mut self, split: BatchSplit) -> Self {
        self.split = split;
        self
    }

    /// Shuffles each epoch's order with `seed` (and the epoch): the same on every rank and
    /// every run with the same seed, as PyTorch's `shuffle=True` with `set_epoch`.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle = Some(seed);
        self
    }

    /// The dataset's number of samples.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a sampler has at least one sample.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Steps per epoch: `ceil(len / global_batch)`.
    pub fn steps_per_epoch(&self) -> u64 {
        self.len.div_ceil(self.global_batch) as u64
    }

    /// The dataset indices in epoch `epoch`'s order (a permutation with
    /// [`shuffle`](Self::shuffle)).
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.len).collect();
        if let Some(seed) = self.shuffle {
            // Fisher-Yates with splitmix64: the same on every platform.
            let mut state = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut next = || {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^ (z >> 31)
            };
            for i in (1..v.len()).rev() {
                let j = (next() % (i as u64 + 1)) as usize;
                v.swap(i, j);
            }
        }
        v
    }

    /// The global batch of `step` (counted from 0 over the whole run): dataset indices, in
    /// the epoch's order.
    pub fn global_batch(&self, step: u64) -> Vec<usize> {
        let (epoch, k) = (step / self.steps_per_epoch(), step % self.steps_per_epoch());
        let start = k as usize * self.global_batch;
        let end = (start + self.global_batch).min(self.len);
        self.order(epoch)[start..end].to_vec()
    }

    /// Rank `rank`'s part of step `step`'s global batch on a world of `world` ranks: the
    /// batch's samples `rank`, `rank + world`, ... (PyTorch's stride), padded, dropped or
    /// uneven by the [`BatchSplit`]. Refused when `rank` is out of the world, or a rank would
    /// take no sample (a batch smaller than the world, with `DropLast` or `Uneven`).
    #[track_caller]
    pub fn part(&self, step: u64, rank: usize, world: usize) -> Result<BatchPart> {
        let batch = self.global_batch(step);
        let n = batch.len();
        let refuse = |reason: String| {
            crate::DistError::new(K::InvalidArgument {
                call: "DistributedSampler::part",
                reason,
            })
        };
        if world == 0 || rank >= world {
            return Err(refuse(format!("rank {rank} of a world of {world}")));
        }
        let per_rank = match self.split {
            BatchSplit::Pad => n.div_ceil(world),
            BatchSplit::DropLast => n / world,
            BatchSplit::Uneven => n / world + usize::from(rank < n % world),
        };
        if per_rank == 0 {
            return Err(refuse(format!(
                "step {step}'s batch of {n} sample(s) leaves rank {rank} of {world} none with {:?}",
                self.split
            )));
        }
        let indices: Vec<usize> = (0..per_rank)
            .map(|i| batch[(rank + i * world) % n])
            .collect();
        let taken = match self.split {
            BatchSplit::Pad => n.div_ceil(world) * world,
            BatchSplit::DropLast => n / world * world,
            BatchSplit::Uneven => n,
        };
        Ok(BatchPart {
            weight: (per_rank * world) as f64 / taken as f64,
            indices,
            epoch: step / self.steps_per_epoch(),
        })
    }

    /// [`part`](Self::part) for `comm`'s rank and world.
    #[track_caller]
    pub fn part_for(&self, comm: &nccl_safe::Communicator, step: u64) -> Result<BatchPart> {
        self.part(step, comm.rank(), comm.world_size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_split_matches_pytorchs_counts_and_strides() {
        // 10 samples, one global batch, 4 ranks (PyTorch: pad to 12 with samples 0 and 1;
        // drop_last keeps 8).
        let s = DistributedSampler::new(10, 10).unwrap();
        let parts: Vec<_> = (0..4).map(|r| s.part(0, r, 4).unwrap().indices).collect();
        assert_eq!(
            parts,
            vec![vec![0, 4, 8], vec![1, 5, 9], vec![2, 6, 0], vec![3, 7, 1]]
        );
        let s = s.split(BatchSplit::DropLast);
        let parts: Vec<_> = (0..4).map(|r| s.part(0, r, 4).unwrap().indices).collect();
        assert_eq!(parts, vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        let s = s.split(BatchSplit::Uneven);
        let parts: Vec<_> = (0..4).map(|r| s.part(0, r, 4).unwrap()).collect();
        let idx: Vec<_> = parts.iter().map(|p| p.indices.clone()).collect();
        assert_eq!(
            idx,
            vec![vec![0, 4, 8], vec![1, 5, 9], vec![2, 6], vec![3, 7]]
        );
        let w: Vec<_> = parts.iter().map(|p| p.weight).collect();
        assert_eq!(w, vec![1.2, 1.2, 0.8, 0.8]);
        // The weights make the average of the ranks' weighted means the batch's mean.
        let mean = |v: &[usize]| v.iter().sum::<usize>() as f64 / v.len() as f64;
        let avg: f64 = parts
            .iter()
            .map(|p| p.weight * mean(&p.indices))
            .sum::<f64>()
            / 4.0;
        assert!((avg - 4.5).abs() < 1e-12, "{avg}");
    }

    #[test]
    fn a_step_takes_the_same_samples_on_any_world() {
        let s = DistributedSampler::new(23, 7)
            .unwrap()
            .shuffle(3)
            .split(BatchSplit::Uneven);
        assert_eq!(s.steps_per_epoch(), 4);
        for step in 0..9 {
            let mut want = s.global_batch(step);
            want.sort_unstable();
            for world in 1..=want.len() {
                let mut got: Vec<usize> = (0..world)
                    .flat_map(|r| s.part(step, r, world).unwrap().indices)
                    .collect();
                got.sort_unstable();
                assert_eq!(got, want, "step {step}, world {world}");
            }
        }
        // An epoch covers every sample once; another epoch has another order.
        let mut epoch: Vec<usize> = (0..4).flat_map(|k| s.global_batch(k)).collect();
        assert_ne!(epoch, (0..23).collect::<Vec<_>>());
        assert_ne!(s.order(0), s.order(1));
        epoch.sort_unstable();
        assert_eq!(epoch, (0..23).collect::<Vec<_>>());
    }

    #[test]
    fn bad_arguments_are_typed_errors() {
        assert!(DistributedSampler::new(0, 1).is_err());
        assert!(DistributedSampler::new(4, 0).is_err());
        assert!(DistributedSampler::new(4, 5).is_err());
        let s = DistributedSampler::new(4, 2).unwrap();
        assert!(s.part(0, 3, 3).is_err());
        assert!(s.part(0, 0, 0).is_err());
        // Pad repeats samples for a batch smaller than the world; the others refuse.
        assert_eq!(s.part(0, 2, 3).unwrap().indices, vec![0]);
        assert!(s.clone().split(BatchSplit::DropLast).part(0, 0, 3).is_err());
        assert!(s.split(BatchSplit::Uneven).part(0, 2, 3).is_err());
    }
}
