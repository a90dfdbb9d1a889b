//! A CPU model that queues steps the way a device model does (`CausalLm::queues_steps`):
//! each queued step runs at once and its argmax picks wait in a queue until taken; a carried
//! id is the pick of the step queued before. The engine's overlap of host and device work can
//! then be checked against the plain engine without a GPU.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ferrite_models::config::ModelConfig;
use ferrite_models::model::{run_forward, CausalLm, Picks, StepLimits};
use ferrite_runtime::sampling::RowSampler;
use ferrite_runtime::{ForwardBatch, KvCache, KvLayout, Result, RuntimeError};

pub struct Queueing {
    inner: Arc<dyn CausalLm>,
    /// Picks not taken yet (oldest first), and the picks of the last queued step.
    state: Mutex<(VecDeque<Vec<u32>>, Vec<u32>)>,
    /// Steps queued with carried ids.
    carried_steps: AtomicUsize,
}

impl Queueing {
    pub fn new(inner: Arc<dyn CausalLm>) -> Arc<Queueing> {
        Arc::new(Queueing { inner, state: Mutex::default(), carried_steps: AtomicUsize::new(0) })
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

    fn forward(&self, batch: &ForwardBatch, kv: &mut KvCache) -> Result<Vec<f32>> {
        assert!(self.state.lock().unwrap().0.is_empty(), "a synchronous step with picks not taken");
        self.inner.forward(batch, kv)
    }

    fn queues_steps(&self) -> bool {
        true
    }

    fn queue_step(
        &self,
        batch: &ForwardBatch,
        kv: &mut KvCache,
        samplers: Option<&[RowSampler]>,
        carried: &[(usize, usize)],
    ) -> Result<()> {
        if samplers.is_some() {
            return Err(RuntimeError::Shape("this test model picks the argmax only".into()));
        }
        let mut st = self.state.lock().unwrap();
        let mut batch = batch.clone();
        for &(t, r) in carried {
            batch.tokens[t] = st.1[r];
        }
        let ids = run_forward(&*self.inner, || self.inner.forward_greedy(&batch, kv))?;
        if !carried.is_empty() {
            self.carried_steps.fetch_add(1, Ordering::Relaxed);
        }
        st.1 = ids.clone();
        st.0.push_back(ids);
        Ok(())
    }

    fn take_picks(&self) -> Result<Picks> {
        let ids = self.state.lock().unwrap().0.pop_front();
        ids.map(Picks::Ids).ok_or_else(|| RuntimeError::Shape("no queued step".into()))
    }

    fn prepare(&self, limits: &StepLimits) -> Result<()> {
        self.inner.prepare(limits)
    }

    fn kv_block_bytes(&self, block_size: usize) -> Vec<usize> {
        self.inner.kv_block_bytes(block_size)
    }

    fn new_kv_cache(&self, group_blocks: &[usize], block_size: usize) -> Result<KvCache> {
        self.inner.new_kv_cache(group_blocks, block_size)
    }
}
