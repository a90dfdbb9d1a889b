//! LoRA adapters of the pool: each served under its own name over a base model of the pool
//! (`--lora-modules name=path`, `POST /v1/load_lora_adapter`). A request whose `model` names
//! an adapter leases the base model's engine and holds the adapter (`AdapterHold`) until its
//! response is done; the engine runs the request through it. An adapter is unloaded
//! (`POST /v1/unload_lora_adapter`) only when no request holds it (409 otherwise). The
//! registry outlives the base model's engine: when the pool loads the base again, every
//! adapter of it is attached to the new engine.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use ferrite_models::lora::{LoraAdapter, MAX_LORA_RANK};

use super::{lock_any, ModelPool, ModelStatus, Served};
use crate::error::ApiError;
use crate::state::unix_now;

/// One adapter the pool serves.
pub(super) struct AdapterEntry {
    name: String,
    /// The pool entry of its base model.
    base: usize,
    path: PathBuf,
    lora: Arc<LoraAdapter>,
    holds: Arc<AtomicUsize>,
    created: u64,
}

/// A request's hold on an adapter: it is not unloaded while any is held.
pub struct AdapterHold {
    pub name: String,
    holds: Arc<AtomicUsize>,
}

impl Clone for AdapterHold {
    fn clone(&self) -> AdapterHold {
        self.holds.fetch_add(1, Ordering::AcqRel);
        AdapterHold { name: self.name.clone(), holds: self.holds.clone() }
    }
}

impl Drop for AdapterHold {
    fn drop(&mut self) {
        self.holds.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ModelPool {
    /// The base entry and a hold on the adapter named `name`, if one is.
    pub(super) fn find_adapter(&self, name: &str) -> Option<(usize, AdapterHold)> {
        let adapters = lock_any(&self.adapters);
        let a = adapters.iter().find(|a| a.name == name)?;
        a.holds.fetch_add(1, Ordering::AcqRel);
        Some((a.base, AdapterHold { name: a.name.clone(), holds: a.holds.clone() }))
    }

    /// Serve the PEFT adapter at `path` as `name` over the model `base` names (None: the
    /// default model), loading that model first if it is not resident. Bad files, a rank
    /// over `--max-lora-rank`, shapes that do not fit the base, or a taken name are 400s.
    pub async fn load_adapter(&self, name: &str, path: &Path, base: Option<&str>) -> Result<(), ApiError> {
        let _admin = self.adapter_admin.lock().await;
        let invalid = |m: String| ApiError::bad_request(m).with_param("lora_name").with_code("invalid_adapter");
        if name.is_empty() {
            return Err(invalid("lora_name is empty".into()));
        }
        if self.find_adapter(name).is_some() || self.find(Some(name)).is_ok() {
            return Err(invalid(format!("the name '{name}' is already served; unload it first or pick another")));
        }
        let max_rank = self.config.max_lora_rank.unwrap_or(MAX_LORA_RANK);
        let dir = path.to_path_buf();
        let read = tokio::task::spawn_blocking(move || LoraAdapter::load(&dir, max_rank)).await;
        let lora = match read {
            Ok(Ok(lora)) => Arc::new(lora),
            Ok(Err(e)) => return Err(invalid(format!("cannot load the LoRA adapter '{name}': {e}"))),
            Err(_) => return Err(ApiError::internal("reading the adapter panicked")),
        };
        let base = self.find(base)?;
        let lease = self.acquire_entry(base).await?;
        let (engine_lease, n, l) = (lease.clone(), name.to_string(), lora.clone());
        tokio::task::spawn_blocking(move || engine_lease.engine.load_adapter(&n, l))
            .await
            .map_err(|_| ApiError::internal("attaching the adapter panicked"))??;
        lock_any(&self.adapters).push(AdapterEntry {
            name: name.to_string(),
            base,
            path: path.to_path_buf(),
            lora,
            holds: Arc::default(),
            created: unix_now(),
        });
        eprintln!("loaded LoRA adapter '{name}' over '{}' from {}", self.entries[base].name, path.display());
        Ok(())
    }

    /// Stop serving the adapter `name`: 404 when there is none, 409 while requests use it.
    pub async fn unload_adapter(&self, name: &str) -> Result<(), ApiError> {
        let _admin = self.adapter_admin.lock().await;
        let entry = {
            let mut adapters = lock_any(&self.adapters);
            let i = adapters.iter().position(|a| a.name == name).ok_or_else(|| {
                ApiError::not_found(format!("the LoRA adapter '{name}' is not loaded"))
                    .with_param("lora_name")
                    .with_code("model_not_found")
            })?;
            let held = adapters[i].holds.load(Ordering::Acquire);
            if held > 0 {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    format!("the LoRA adapter '{name}' is in use by {held} request(s); unload it when they are done"),
                )
                .with_code("adapter_in_use"));
            }
            adapters.remove(i)
        };
        // A base that is not resident holds no adapter.
        if let Some(lease) = self.lease(entry.base) {
            let n = name.to_string();
            let detached = tokio::task::spawn_blocking(move || lease.engine.unload_adapter(&n))
                .await
                .map_err(|_| ApiError::internal("detaching the adapter panicked"))?;
            if let Err(e) = detached {
                lock_any(&self.adapters).push(entry);
                return Err(e);
            }
        }
        eprintln!("unloaded LoRA adapter '{name}'");
        Ok(())
    }

    /// The adapters over entry `i`, for attaching to its next engine.
    pub(super) fn adapters_of(&self, i: usize) -> Vec<(String, Arc<LoraAdapter>)> {
        lock_any(&self.adapters).iter().filter(|a| a.base == i).map(|a| (a.name.clone(), a.lora.clone())).collect()
    }

    /// The adapters with their state (their base model's), as `/v1/models` lists them.
    pub(super) fn adapter_statuses(&self, models: &[ModelStatus]) -> Vec<ModelStatus> {
        lock_any(&self.adapters)
            .iter()
            .map(|a| {
                let base = &models[a.base];
                ModelStatus {
                    name: a.name.clone(),
                    created: a.created,
                    state: base.state,
                    max_model_len: base.max_model_len,
                    pid: None,
                    parent: Some(base.name.clone()),
                    root: Some(a.path.display().to_string()),
                }
            })
            .collect()
    }
}

/// Attach `adapters` to `served`, the freshly started engine of the model `model` (blocking);
/// they fitted its previous engine, so a failure is only reported.
pub(super) fn attach(served: &Served, model: &str, adapters: Vec<(String, Arc<LoraAdapter>)>) {
    for (name, lora) in adapters {
        if let Err(e) = served.engine.load_adapter(&name, lora) {
            eprintln!("cannot attach LoRA adapter '{name}' to the reloaded '{model}': {}", e.message);
        }
    }
}
