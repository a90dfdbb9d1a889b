//! The engine's side of the KV tiers below the pool and of resumable generations: opening
//! the tiers, what is published when, and resumption (the block moves are `core/restore.rs`).
//!
//! - **Publish**: full prompt blocks go to the SSD tier as soon as they are computed;
//!   generated blocks at each checkpoint and when the sequence ends (finished or cut off).
//!   Copying blocks out is the engine thread's (a memcpy, or a device copy it waits for); the
//!   file writes are the writer thread's, and a store the writer has no room for is dropped.
//! - **Host RAM** (`--host-cache-memory`) takes what the pool evicts (`kv/host.rs`).
//! - **Resume** (`--generation-checkpoint N`): every N generated tokens, and when a generation
//!   is cut off (client disconnect, shutdown), its tokens are recorded under a digest of
//!   (namespace, prompt, parameters) — in memory and, with the SSD tier, on disk. An identical
//!   request replays the recorded tokens at once (streamed as if generated, through the same
//!   stop, grammar and detokenizer state), and continues from their KV, which the tiers hold.
//!   Sampling draws from (seed, step), so the continuation is the uninterrupted run's.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use ferrite_runtime::{KvCache, KvLayout};

use super::emit::{emit_token, Emitter};
use super::restore::publish;
use super::{Emitted, EngineCore};
use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::kv::disk::{DiskTier, FORMAT_VERSION};
use crate::kv::host::HostTier;
use crate::kv::{KvManager, TierSlots};
use crate::metrics::Metrics;
use crate::request::RequestParams;
use crate::sequence::Sequence;

/// FNV-1a of `bytes`, continuing from `h`.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The namespace digest of the prefix cache and its tiers: the model's identity, what a KV
/// block's bytes are (storage and value type), the layout, the block size, and the cache
/// format version. Stable across runs (a restart finds its files).
pub(super) fn namespace(model: u64, kv: &KvCache, layout: &KvLayout, block_size: usize) -> u64 {
    let desc = format!("{model:x}|{}|{layout:?}|{block_size}|v{FORMAT_VERSION}", kv.scheme());
    fnv(0xcbf2_9ce4_8422_2325, desc.as_bytes())
}

/// The key a generation of `prompt` with `params` is recorded under; `None` for requests
/// that are not resumed (several choices, or logprobs, which a replay could not give back).
/// A greedy request's seed does not matter, so it is left out.
fn resume_key(namespace: u64, prompt: &[u32], params: &RequestParams) -> Option<u64> {
    if params.n != 1 || params.logprobs.is_some() {
        return None;
    }
    let mut p = params.clone();
    if p.sampling.is_greedy() {
        p.sampling.seed = 0;
    }
    let json = serde_json::to_vec(&p).ok()?;
    let h = fnv(fnv(namespace, &json), &[0xff]);
    Some(prompt.iter().fold(h, |h, t| fnv(h, &t.to_le_bytes())))
}

/// Records of interrupted generations kept in memory: key → (prompt, generated tokens).
pub(super) struct Resumes {
    every: usize,
    records: HashMap<u64, (Vec<u32>, Vec<u32>)>,
    order: VecDeque<u64>,
}

/// Records kept in memory at most (the oldest go first; the SSD tier keeps its own).
const MAX_RECORDS: usize = 1024;

impl Resumes {
    pub fn new(every: usize) -> Result<Resumes, EngineError> {
        if every == 0 {
            return Err(EngineError::Config("--generation-checkpoint must be at least 1".into()));
        }
        Ok(Resumes { every, records: HashMap::new(), order: VecDeque::new() })
    }

    fn put(&mut self, key: u64, prompt: &[u32], generated: &[u32]) {
        if self.records.insert(key, (prompt.to_vec(), generated.to_vec())).is_none() {
            self.order.push_back(key);
        }
        while self.records.len() > MAX_RECORDS {
            let Some(old) = self.order.pop_front() else { break };
            self.records.remove(&old);
        }
    }

    fn take(&mut self, key: u64, prompt: &[u32]) -> Option<Vec<u32>> {
        match self.records.get(&key) {
            Some((p, _)) if p == prompt => self.records.remove(&key).map(|(_, g)| g),
            _ => None,
        }
    }

    fn forget(&mut self, key: u64) {
        self.records.remove(&key);
    }
}

/// Bytes of staging the SSD tier's block copies go through at a time (and at least one
/// state snapshot).
const STAGING_BYTES: usize = 64 << 20;

/// Open the SSD tier of `cfg`, if it has one, and the staging slots its copies go through.
pub(super) fn open_disk(
    cfg: &EngineConfig,
    kv: &KvCache,
    kvm: &KvManager,
    namespace: u64,
    metrics: &Arc<Metrics>,
) -> Result<Option<(DiskTier, TierSlots)>, EngineError> {
    let Some(d) = &cfg.disk_cache else { return Ok(None) };
    if !cfg.prefix_cache {
        return Err(EngineError::Config("--prefix-cache-dir needs the prefix cache (drop --no-prefix-cache)".into()));
    }
    let state_group = kvm.state_group();
    let group_bytes: Vec<u64> = (0..kv.group_blocks().len()).map(|g| kv.group_block_bytes(g) as u64).collect();
    let per = |bytes: usize| (STAGING_BYTES / bytes.max(1)).max(1);
    let state_bytes = state_group.map_or(0, |g| kv.group_block_bytes(g));
    let staging = TierSlots::new(kv, state_group, per(kv.block_bytes() - state_bytes), per(state_bytes))?;
    let disk = DiskTier::open(d, namespace, cfg.block_size, (group_bytes, state_group), metrics.clone())?;
    Ok(Some((disk, staging)))
}

/// Open the host-RAM tier of `cfg`, if it has one; the pool then records what it evicts. A
/// model with recurrent state splits the budget as the pool does: a snapshot per `stride`
/// blocks.
pub(super) fn open_host(
    cfg: &EngineConfig,
    kv: &KvCache,
    kvm: &mut KvManager,
    stride: usize,
    metrics: &Arc<Metrics>,
) -> Result<Option<HostTier>, EngineError> {
    let Some(bytes) = cfg.host_cache_memory else { return Ok(None) };
    if kvm.prefix_cache().is_none() {
        return Err(EngineError::Config("--host-cache-memory needs the prefix cache (drop --no-prefix-cache)".into()));
    }
    let state_group = kvm.state_group();
    let state_bytes = state_group.map_or(0, |g| kv.group_block_bytes(g));
    let stride = if state_group.is_some() { stride.max(1) } else { 1 };
    // `units` of `stride` blocks and a snapshot (without recurrent state: of a block).
    let unit = stride * (kv.block_bytes() - state_bytes) + state_bytes;
    let units = bytes / unit.max(1);
    if units == 0 {
        return Err(EngineError::Config(format!("--host-cache-memory {bytes} holds no KV block ({unit} bytes each)")));
    }
    kvm.keep_spills();
    let states = if state_group.is_some() { units } else { 0 };
    Ok(Some(HostTier::new(TierSlots::new(kv, state_group, units * stride, states)?, metrics.clone())))
}

impl EngineCore {
    /// For a new request: replay an interrupted run of it, if one is recorded (true when the
    /// replay already ended it), then read ahead what a lower tier holds of its prefix.
    pub(super) fn admit_from_tiers(&mut self, seq: &mut Sequence) -> bool {
        if self.replay(seq) {
            return true;
        }
        self.read_ahead(seq);
        false
    }

    fn replay(&mut self, seq: &mut Sequence) -> bool {
        let Some(resumes) = self.resumes.as_mut() else { return false };
        let prompt = &seq.tokens[..seq.prompt_len];
        let Some(key) = resume_key(self.namespace, prompt, &seq.params) else { return false };
        seq.tier.resume_key = Some(key);
        let recorded = resumes.take(key, prompt).or_else(|| self.disk.as_ref()?.load_generation(key, prompt));
        let Some(generated) = recorded else { return false };
        let e = Emitter {
            eos: &self.eos,
            tokenizer: self.tokenizer.as_deref(),
            max_model_len: self.limits.max_model_len,
            metrics: &self.metrics,
        };
        seq.tier.recorded = true;
        self.metrics.resumed_generations.fetch_add(1, Relaxed);
        for t in generated {
            self.metrics.resumed_tokens.fetch_add(1, Relaxed);
            seq.tier.resumed += 1;
            if !matches!(emit_token(&e, seq, t, Vec::new()), Emitted::Running) {
                self.forget_record(seq);
                return true;
            }
        }
        seq.tier.checkpointed = seq.generated();
        if let Some(s) = &self.scaffold {
            if seq.fill.mode.asserts_scaffolds() {
                seq.fill.cursor = s.cursor_after(&seq.tokens);
            }
        }
        false
    }

    /// After a step: publish the prompt blocks computed so far, checkpoint resumable
    /// generations that passed another `every` tokens, and publish everything of the
    /// sequences at `done` (finished), whose records are no longer needed.
    pub(super) fn publish_step(&mut self, done: &[usize]) {
        let every = self.resumes.as_ref().map(|r| r.every);
        for idx in 0..self.sched.running.len() {
            let seq = &self.sched.running[idx];
            let bs = self.kvm.block_size();
            if done.contains(&idx) {
                self.publish_all(idx);
                let seq = &mut self.sched.running[idx];
                if seq.tier.recorded {
                    seq.tier.recorded = false;
                    let key = seq.tier.resume_key;
                    self.forget_key(key);
                }
            } else if every
                .is_some_and(|n| seq.tier.resume_key.is_some() && seq.generated() - seq.tier.checkpointed >= n)
            {
                self.checkpoint(idx);
            } else if let Some((disk, staging)) = self.disk.as_ref().zip(self.staging.as_mut()) {
                let upto = seq.num_computed.min(seq.prompt_len) / bs;
                if upto > seq.tier.published {
                    publish(disk, &self.kvm, &self.kv, staging, &mut self.sched.running[idx], upto);
                }
            }
        }
    }

    fn publish_all(&mut self, idx: usize) {
        if let Some((disk, staging)) = self.disk.as_ref().zip(self.staging.as_mut()) {
            let seq = &mut self.sched.running[idx];
            let upto = seq.kv.hashes().len();
            publish(disk, &self.kvm, &self.kv, staging, seq, upto);
        }
    }

    /// Publish `running[idx]`'s blocks and record its generation so far.
    fn checkpoint(&mut self, idx: usize) {
        self.publish_all(idx);
        let seq = &mut self.sched.running[idx];
        let Some(key) = seq.tier.resume_key else { return };
        if seq.generated() == 0 {
            return;
        }
        seq.tier.checkpointed = seq.generated();
        seq.tier.recorded = true;
        let (prompt, generated) = seq.tokens.split_at(seq.prompt_len);
        if let Some(r) = self.resumes.as_mut() {
            r.put(key, prompt, generated);
        }
        if let Some(disk) = &self.disk {
            disk.store_generation(key, prompt, generated);
        }
    }

    /// A running sequence cut off before its end (client gone, shutdown): keep what it has
    /// in the tiers so that a retry continues it.
    pub(super) fn cut(&mut self, idx: usize) {
        if self.sched.running[idx].tier.resume_key.is_some() {
            self.checkpoint(idx);
        } else {
            self.publish_all(idx);
        }
    }

    fn forget_record(&mut self, seq: &mut Sequence) {
        seq.tier.recorded = false;
        self.forget_key(seq.tier.resume_key);
    }

    fn forget_key(&mut self, key: Option<u64>) {
        let Some(key) = key else { return };
        if let Some(r) = self.resumes.as_mut() {
            r.forget(key);
        }
        if let Some(disk) = &self.disk {
            disk.forget_generation(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    #[test]
    fn the_resume_key_covers_prompt_and_parameters_but_not_a_greedy_seed() {
        let greedy =
            |seed| RequestParams { sampling: SamplingParams { seed, ..Default::default() }, ..Default::default() };
        let key = |p: &[u32], params: &RequestParams| resume_key(1, p, params);
        assert_eq!(key(&[1, 2], &greedy(3)), key(&[1, 2], &greedy(4)));
        assert_ne!(key(&[1, 2], &greedy(3)), key(&[1, 3], &greedy(3)));
        assert_ne!(resume_key(1, &[1], &greedy(3)), resume_key(2, &[1], &greedy(3)));
        let sampled = |seed| RequestParams {
            sampling: SamplingParams { temperature: 0.8, seed, ..Default::default() },
            ..Default::default()
        };
        assert_ne!(key(&[1], &sampled(3)), key(&[1], &sampled(4)));
        assert_ne!(key(&[1], &sampled(3)), key(&[1], &greedy(3)));
        assert_eq!(key(&[1], &RequestParams { n: 2, ..greedy(0) }), None);
        assert_eq!(key(&[1], &RequestParams { logprobs: Some(0), ..greedy(0) }), None);
    }
}
