//! The LoRA adapters of an engine: loaded under a name, attached to the model under an id
//! that rides on the rows of every step (`RowSpan::adapter`), and their sequences' prefix
//! cache chains rooted at the adapter's digest (their KV differs from the base model's). At
//! most `max_loras` are loaded at once; one is unloaded only when no sequence runs through it.
//! The names are shared with the `Engine` front, which refuses a request for an adapter that
//! is not loaded before it reaches the engine thread.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};

use ferrite_models::lora::LoraAdapter;

use super::EngineCore;
use crate::error::EngineError;

/// The names of the loaded adapters, shared with the engine's front.
pub type AdapterNames = Arc<RwLock<HashSet<String>>>;

/// One loaded adapter: its id with the model and the root of its prefix-cache chains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AdapterSlot {
    pub id: u32,
    pub root: u64,
}

/// Adapter ids, unique in the process: engines that share a model never reuse each other's.
static NEXT_ID: AtomicU32 = AtomicU32::new(0);

#[derive(Default)]
pub(crate) struct Adapters {
    by_name: HashMap<String, AdapterSlot>,
    max: usize,
    names: AdapterNames,
}

impl Adapters {
    pub fn new(max: usize) -> Adapters {
        Adapters { max, ..Adapters::default() }
    }

    pub fn names(&self) -> AdapterNames {
        self.names.clone()
    }

    fn publish(&self) {
        let mut names = self.names.write().unwrap_or_else(|e| e.into_inner());
        *names = self.by_name.keys().cloned().collect();
    }
}

impl EngineCore {
    /// The slot of the adapter `name` (None: the base model); an adapter that is not loaded
    /// is an error.
    pub(crate) fn adapter_slot(&self, name: Option<&str>) -> Result<Option<AdapterSlot>, EngineError> {
        let Some(name) = name else { return Ok(None) };
        let slot = self.adapters.by_name.get(name).ok_or_else(|| EngineError::UnknownAdapter(name.to_string()))?;
        Ok(Some(*slot))
    }

    /// Load `adapter` under `name`: attached to the model (which checks its shapes), ready for
    /// requests that name it.
    pub fn load_adapter(&mut self, name: &str, adapter: &LoraAdapter) -> Result<(), EngineError> {
        let a = &mut self.adapters;
        if a.by_name.contains_key(name) {
            return Err(EngineError::Adapter(format!("an adapter named '{name}' is already loaded")));
        }
        if a.by_name.len() >= a.max {
            return Err(EngineError::Adapter(format!(
                "{} adapters are loaded, the most this server holds (--max-loras); unload one first",
                a.max
            )));
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        self.model.attach_lora(id, adapter).map_err(|e| EngineError::Adapter(e.to_string()))?;
        let a = &mut self.adapters;
        // The root is never 0 (the base model's chains start there).
        a.by_name.insert(name.to_string(), AdapterSlot { id, root: adapter.digest.max(1) });
        a.publish();
        Ok(())
    }

    /// Unload the adapter `name`; refused while any sequence (running, waiting or queued on
    /// the device) runs through it.
    pub fn unload_adapter(&mut self, name: &str) -> Result<(), EngineError> {
        let _ = self.drain();
        let slot = self.adapter_slot(Some(name))?.ok_or_else(|| EngineError::UnknownAdapter(name.to_string()))?;
        let sequences =
            self.sched.running.iter().chain(&self.sched.waiting).filter(|s| s.adapter == Some(slot.id)).count();
        if sequences > 0 {
            return Err(EngineError::AdapterInUse { name: name.to_string(), sequences });
        }
        self.model.detach_lora(slot.id);
        self.adapters.by_name.remove(name);
        self.adapters.publish();
        Ok(())
    }

    /// Detach every adapter from the model (the engine is going away; the model may outlive it).
    pub(crate) fn detach_adapters(&mut self) {
        for slot in self.adapters.by_name.values() {
            self.model.detach_lora(slot.id);
        }
        self.adapters.by_name.clear();
        self.adapters.publish();
    }

    /// The names of the loaded adapters, shared with the engine's front.
    pub fn adapter_names(&self) -> AdapterNames {
        self.adapters.names()
    }
}
