//! A CPU model that queues steps the way a device model does (`Pending::is_queued`): each
//! argmax step runs at once and hands back a queued handle holding its picks; a carried id is
//! the pick of the step run before. The engine's overlap of host and device work can then be
//! checked against the plain engine without a GPU.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ferrite_models::config::ModelConfig;
use ferrite_models::model::{CausalLm, Pending, QueuedStep, StepLimits, StepOutput, Want};
use ferrite_runtime::{ForwardBatch, KvCache, KvLayout, KvScheme, Result, RuntimeError};

pub struct Queueing {
    inner: Arc<dyn CausalLm>,
    /// The picks of the last step.
    last: Mutex<Vec<u32>>,
    /// Queued steps whose handles were not resolved yet.
    untaken: Arc<AtomicUsize>,
    /// Steps queued with carried ids.
    carried_steps: AtomicUsize,
}

/// A queued step's picks, handed back when its handle is resolved.
struct Queued {
    ids: Vec<u32>,
    untaken: Arc<AtomicUsize>,
}

impl QueuedStep for Queued {
    fn wait(self: Box<Self>) -> Result<StepOutput> {
        self.untaken.fetch_sub(1, Ordering::Relaxed);
        Ok(StepOutput::Ids(self.ids))
    }
}

impl Queueing {
    pub fn new(inner: Arc<dyn CausalLm>) -> Arc<Queueing> {
        Arc::new(Queueing {
            inner,
            last: Mutex::default(),
            untaken: Arc::default(),
            carried_steps: AtomicUsize::new(0),
        })
    }

    pub fn carried_steps(&self) -> usize {
        self.carried_steps.load(Ordering::Relaxed)
    }
}

impl CausalLm for Queueing {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }

    fn step(&self, batch: &ForwardBatch, kv: &mut KvCache, want: Want<'_>) -> Result<Pending> {
        match want {
            Want::Logits => {
                assert_eq!(self.untaken.load(Ordering::Relaxed), 0, "a synchronous step with picks not taken");
                self.inner.step(batch, kv, want)
            }
            Want::Sample(_) => Err(RuntimeError::Shape("this test model picks the argmax only".into())),
            Want::Argmax => {
                let mut last = self.last.lock().unwrap();
                let mut batch = batch.clone();
                let carried = std::mem::take(&mut batch.carried);
                for &(t, r) in &carried {
                    batch.tokens[t] = last[r];
                }
                let ids = self.inner.step(&batch, kv, want)?.ids()?;
                if !carried.is_empty() {
                    self.carried_steps.fetch_add(1, Ordering::Relaxed);
                }
                last.clone_from(&ids);
                self.untaken.fetch_add(1, Ordering::Relaxed);
                Ok(Pending::queued(Queued { ids, untaken: self.untaken.clone() }))
            }
        }
    }

    fn prepare(&self, limits: &StepLimits) -> Result<()> {
        self.inner.prepare(limits)
    }

    fn kv_block_bytes(&self, block_size: usize, scheme: &KvScheme) -> Result<Vec<usize>> {
        self.inner.kv_block_bytes(block_size, scheme)
    }

    fn new_kv_cache(&self, group_blocks: &[usize], block_size: usize, scheme: &KvScheme) -> Result<KvCache> {
        self.inner.new_kv_cache(group_blocks, block_size, scheme)
    }
}
