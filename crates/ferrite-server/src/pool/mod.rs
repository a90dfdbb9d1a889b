//! `ModelPool`: the models one server serves, picked by a request's `model` field. A model
//! that is not resident is loaded when a request names it (requests for it wait on its load;
//! requests for other models carry on); past `max_loaded` resident models, or past the memory
//! budget, the least recently used idle model is unloaded first, and a model idle for
//! `idle_unload` is unloaded by `unload_idle`. A model with requests in flight is never
//! unloaded: a load that needs its room waits for them to finish, and one that could not fit
//! even with every other model unloaded is refused with 507.
//!
//! A request holds a `Lease` on its model's engine from before it is prepared until its
//! response is done, which is what "in flight" means here. A request for a LoRA adapter
//! (`adapters`) leases its base model's engine and holds the adapter too.

pub mod adapters;
pub mod backend;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use ferrite_engine::Metrics as EngineMetrics;

pub use adapters::AdapterHold;
pub use backend::{EngineBackend, EngineHealth, EngineStream};

use crate::error::ApiError;
use crate::state::{unix_now, ModelInfo};

/// How a model of the pool is loaded.
pub trait ModelLoader: Send + Sync {
    /// Bytes of memory a load would take (weights and KV cache), from its files and settings
    /// alone; `None` when the pool's budget does not cover where it runs.
    fn estimate(&self) -> Result<Option<u64>, String>;
    /// Load the model and start its engine (blocking).
    fn load(&self) -> Result<Served, String>;
}

/// A model with its running engine.
pub struct Served {
    pub engine: Box<dyn EngineBackend>,
    pub model: ModelInfo,
}

impl Served {
    pub fn new(engine: Box<dyn EngineBackend>, mut model: ModelInfo) -> Served {
        model.max_text_bytes = model.text_bound(engine.limits().max_model_len);
        Served { engine, model }
    }
}

/// One model the pool can serve.
pub struct PoolModel {
    pub name: String,
    /// Other names requests may use.
    pub aliases: Vec<String>,
    pub loader: Arc<dyn ModelLoader>,
}

/// The pool's limits (`--max-loaded-models`, `--idle-unload`, `--memory-budget`).
#[derive(Debug, Clone, Default)]
pub struct PoolConfig {
    pub max_loaded: Option<usize>,
    pub idle_unload: Option<Duration>,
    /// Bytes the resident models' estimates may add up to.
    pub memory_budget: Option<u64>,
    /// The largest LoRA rank an adapter may have (`--max-lora-rank`; None: `MAX_LORA_RANK`).
    pub max_lora_rank: Option<usize>,
}

/// One model's state, as `/v1/models` lists it.
#[derive(Debug, Clone)]
pub struct ModelStatus {
    pub name: String,
    pub created: u64,
    /// `loaded`, `loading`, `unloaded`, `restarting` or `down`.
    pub state: &'static str,
    /// Known once the model has been loaded.
    pub max_model_len: Option<usize>,
    /// The engine's process, when it runs in its own.
    pub pid: Option<u32>,
    /// The base model of a LoRA adapter.
    pub parent: Option<String>,
    /// Where a LoRA adapter was loaded from.
    pub root: Option<String>,
}

struct Entry {
    name: String,
    aliases: Vec<String>,
    /// `None` for a model given already loaded, which stays resident.
    loader: Option<Arc<dyn ModelLoader>>,
    /// Held while the model loads (by the load itself, which finishes even when the request
    /// that started it went away): requests for it queue here.
    loading: Arc<tokio::sync::Mutex<()>>,
}

struct Resident {
    served: Arc<Served>,
    bytes: u64,
    last_used: Instant,
    leases: Arc<AtomicUsize>,
}

#[derive(Default)]
struct Slot {
    resident: Option<Resident>,
    /// Bytes reserved by a load in progress.
    reserved: Option<u64>,
    max_model_len: Option<usize>,
    created: u64,
}

pub struct ModelPool {
    entries: Vec<Entry>,
    slots: Arc<Mutex<Vec<Slot>>>,
    /// Signalled when a lease ends (a model may have become idle).
    freed: Arc<tokio::sync::Notify>,
    config: PoolConfig,
    adapters: Mutex<Vec<adapters::AdapterEntry>>,
    /// Held while an adapter is loaded or unloaded (one at a time).
    adapter_admin: tokio::sync::Mutex<()>,
}

/// A request's hold on one model's engine; the model is not unloaded while any is held.
pub struct Lease {
    served: Arc<Served>,
    leases: Arc<AtomicUsize>,
    freed: Arc<tokio::sync::Notify>,
    /// The LoRA adapter the request runs through.
    adapter: Option<AdapterHold>,
}

impl Lease {
    /// The name of the LoRA adapter the request runs through (None: the base model).
    pub fn adapter(&self) -> Option<&str> {
        self.adapter.as_ref().map(|a| a.name.as_str())
    }

    /// The name a response reports as its model: the adapter's, or the model's.
    pub fn model_name(&self) -> &str {
        self.adapter().unwrap_or(&self.served.model.name)
    }
}

impl std::ops::Deref for Lease {
    type Target = Served;
    fn deref(&self) -> &Served {
        &self.served
    }
}

impl Clone for Lease {
    fn clone(&self) -> Lease {
        self.leases.fetch_add(1, Ordering::AcqRel);
        Lease {
            served: self.served.clone(),
            leases: self.leases.clone(),
            freed: self.freed.clone(),
            adapter: self.adapter.clone(),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.leases.fetch_sub(1, Ordering::AcqRel);
        self.freed.notify_waiters();
    }
}

/// What a load must do before it may start.
enum Room {
    Fits,
    /// Unload these first (already taken out of the table).
    Evict(Vec<Arc<Served>>),
    /// Models in flight hold the room it needs.
    Wait,
}

impl ModelPool {
    /// A pool of `models`, none loaded yet; the first is the one a request without `model`
    /// gets.
    pub fn new(models: Vec<PoolModel>, config: PoolConfig) -> ModelPool {
        let entries: Vec<Entry> = models
            .into_iter()
            .map(|m| Entry { name: m.name, aliases: m.aliases, loader: Some(m.loader), loading: Arc::default() })
            .collect();
        let slots = entries.iter().map(|_| Slot { created: unix_now(), ..Slot::default() }).collect();
        ModelPool {
            entries,
            slots: Arc::new(Mutex::new(slots)),
            freed: Arc::new(tokio::sync::Notify::new()),
            config,
            adapters: Mutex::default(),
            adapter_admin: tokio::sync::Mutex::default(),
        }
    }

    /// A pool of one model, already loaded and never unloaded.
    pub fn single(served: Served) -> ModelPool {
        let entry = Entry {
            name: served.model.name.clone(),
            aliases: served.model.aliases.clone(),
            loader: None,
            loading: Arc::default(),
        };
        let slot = Slot {
            max_model_len: Some(served.engine.limits().max_model_len),
            created: served.model.created,
            resident: Some(Resident {
                served: Arc::new(served),
                bytes: 0,
                last_used: Instant::now(),
                leases: Arc::new(AtomicUsize::new(0)),
            }),
            reserved: None,
        };
        ModelPool {
            entries: vec![entry],
            slots: Arc::new(Mutex::new(vec![slot])),
            freed: Arc::new(tokio::sync::Notify::new()),
            config: PoolConfig::default(),
            adapters: Mutex::default(),
            adapter_admin: tokio::sync::Mutex::default(),
        }
    }

    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    fn slots(&self) -> MutexGuard<'_, Vec<Slot>> {
        lock_any(&self.slots)
    }

    /// The entry a request's `model` names (absent: the first); unknown → 404.
    fn find(&self, requested: Option<&str>) -> Result<usize, ApiError> {
        let Some(name) = requested else { return Ok(0) };
        self.entries.iter().position(|e| e.name == name || e.aliases.iter().any(|a| a == name)).ok_or_else(|| {
            let names: Vec<String> = self.entries.iter().map(|e| format!("'{}'", e.name)).collect();
            ApiError::not_found(format!("the model '{name}' does not exist; this server serves {}", names.join(", ")))
                .with_param("model")
                .with_code("model_not_found")
        })
    }

    /// A lease on the model `requested` names, loading it first when it is not resident; a
    /// LoRA adapter's name leases its base model and holds the adapter.
    pub async fn acquire(&self, requested: Option<&str>) -> Result<Lease, ApiError> {
        let (i, hold) = match requested.and_then(|name| self.find_adapter(name)) {
            Some((i, hold)) => (i, Some(hold)),
            None => (self.find(requested)?, None),
        };
        let mut lease = self.acquire_entry(i).await?;
        lease.adapter = hold;
        Ok(lease)
    }

    /// A lease on entry `i`, loading it first when it is not resident.
    async fn acquire_entry(&self, i: usize) -> Result<Lease, ApiError> {
        if let Some(lease) = self.lease(i) {
            return Ok(lease);
        }
        let loading = self.entries[i].loading.clone().lock_owned().await;
        if let Some(lease) = self.lease(i) {
            return Ok(lease);
        }
        self.load(i, loading).await?;
        self.lease(i).ok_or_else(|| ApiError::internal("the model was unloaded as soon as it loaded"))
    }

    /// The name of the model or adapter `requested` names (404 when none), without loading it.
    pub fn resolve_name(&self, requested: &str) -> Result<String, ApiError> {
        if let Some((_, hold)) = self.find_adapter(requested) {
            return Ok(hold.name.clone());
        }
        self.find(Some(requested)).map(|i| self.entries[i].name.clone())
    }

    fn lease(&self, i: usize) -> Option<Lease> {
        let mut slots = self.slots();
        let r = slots[i].resident.as_mut()?;
        r.last_used = Instant::now();
        r.leases.fetch_add(1, Ordering::AcqRel);
        Some(Lease { served: r.served.clone(), leases: r.leases.clone(), freed: self.freed.clone(), adapter: None })
    }

    async fn load(&self, i: usize, loading: tokio::sync::OwnedMutexGuard<()>) -> Result<(), ApiError> {
        let entry = &self.entries[i];
        let Some(loader) = entry.loader.clone() else {
            return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("the model '{}' is gone", entry.name)));
        };
        let need = loader.estimate().map_err(|e| load_failed(&entry.name, &e))?;
        loop {
            let room = self.make_room(i, need)?;
            match room {
                Room::Fits => break,
                Room::Evict(victims) => drop_off_runtime(victims).await,
                Room::Wait => {
                    // Woken when a lease ends; the timeout covers a wake-up missed in between.
                    let _ = tokio::time::timeout(Duration::from_millis(200), self.freed.notified()).await;
                }
            }
        }
        let (slots, name) = (self.slots.clone(), entry.name.clone());
        let adapters = self.adapters_of(i);
        let load = tokio::task::spawn_blocking(move || {
            let _loading = loading;
            let started = Instant::now();
            let loaded = loader.load();
            // Its adapters are attached before any request can see the engine.
            if let Ok(served) = &loaded {
                adapters::attach(served, &name, adapters);
            }
            let mut slots = lock_any(&slots);
            let slot = &mut slots[i];
            slot.reserved = None;
            let served = loaded?;
            eprintln!("loaded model '{name}' in {:.0} ms", started.elapsed().as_secs_f64() * 1e3);
            slot.max_model_len = Some(served.engine.limits().max_model_len);
            slot.created = unix_now();
            slot.resident = Some(Resident {
                served: Arc::new(served),
                bytes: need.unwrap_or(0),
                last_used: Instant::now(),
                leases: Arc::new(AtomicUsize::new(0)),
            });
            Ok::<(), String>(())
        });
        match load.await {
            Ok(done) => done.map_err(|e| load_failed(&entry.name, &e)),
            Err(_) => {
                self.slots()[i].reserved = None;
                Err(load_failed(&entry.name, "the load panicked"))
            }
        }
    }

    /// Decide (and reserve) the room a load of entry `i` needing `need` bytes takes.
    fn make_room(&self, i: usize, need: Option<u64>) -> Result<Room, ApiError> {
        let mut slots = self.slots();
        let held = |s: &Slot| s.resident.as_ref().map_or(0, |r| r.bytes) + s.reserved.unwrap_or(0);
        let occupied = |s: &Slot| s.resident.is_some() || s.reserved.is_some();
        let mut excess_count = self
            .config
            .max_loaded
            .map_or(0, |max| (slots.iter().filter(|s| occupied(s)).count() + 1).saturating_sub(max));
        let budget = self.config.memory_budget.zip(need);
        let mut excess_bytes = budget.map_or(0, |(b, n)| (slots.iter().map(held).sum::<u64>() + n).saturating_sub(b));
        if let Some((budget, need)) = budget {
            let pinned: u64 = slots
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i && self.entries[j].loader.is_none())
                .map(|(_, s)| held(s))
                .sum();
            if need + pinned > budget {
                return Err(insufficient_memory(&self.entries[i].name, need, budget));
            }
        }
        if excess_count == 0 && excess_bytes == 0 {
            slots[i].reserved = Some(need.unwrap_or(0));
            return Ok(Room::Fits);
        }
        let mut idle: Vec<usize> = (0..slots.len())
            .filter(|&j| j != i && self.entries[j].loader.is_some())
            .filter(|&j| slots[j].resident.as_ref().is_some_and(|r| r.leases.load(Ordering::Acquire) == 0))
            .collect();
        idle.sort_by_key(|&j| slots[j].resident.as_ref().map(|r| r.last_used));
        let mut victims = Vec::new();
        for j in idle {
            if excess_count == 0 && excess_bytes == 0 {
                break;
            }
            if let Some(r) = slots[j].resident.take() {
                eprintln!("unloading model '{}' to make room for '{}'", self.entries[j].name, self.entries[i].name);
                excess_count = excess_count.saturating_sub(1);
                excess_bytes = excess_bytes.saturating_sub(r.bytes);
                victims.push(r.served);
            }
        }
        Ok(if victims.is_empty() { Room::Wait } else { Room::Evict(victims) })
    }

    /// Unload models idle for `idle_unload`, checking as often as that needs; returns at once
    /// when the pool has no idle limit.
    pub async fn unload_idle(&self) {
        let Some(idle) = self.config.idle_unload else { return };
        let tick = (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
        loop {
            tokio::time::sleep(tick).await;
            let victims: Vec<Arc<Served>> = {
                let mut slots = self.slots();
                (0..slots.len())
                    .filter(|&j| self.entries[j].loader.is_some())
                    .filter_map(|j| {
                        let r = slots[j].resident.as_ref()?;
                        let expired = r.leases.load(Ordering::Acquire) == 0 && r.last_used.elapsed() >= idle;
                        if expired {
                            eprintln!("unloading model '{}' (idle for {} s)", self.entries[j].name, idle.as_secs());
                        }
                        expired.then(|| slots[j].resident.take().map(|r| r.served)).flatten()
                    })
                    .collect()
            };
            drop_off_runtime(victims).await;
        }
    }

    /// Every model with its state, in the order they were given.
    fn list_models(&self) -> Vec<ModelStatus> {
        let slots = self.slots();
        self.entries
            .iter()
            .zip(slots.iter())
            .map(|(e, s)| {
                let (state, pid) = match (&s.resident, s.reserved) {
                    (Some(r), _) => (r.served.engine.health().label(), r.served.engine.pid()),
                    (None, Some(_)) => ("loading", None),
                    (None, None) => ("unloaded", None),
                };
                ModelStatus {
                    name: e.name.clone(),
                    created: s.created,
                    state,
                    max_model_len: s.max_model_len,
                    pid,
                    parent: None,
                    root: None,
                }
            })
            .collect::<Vec<_>>()
    }

    /// Every model with its state, then every LoRA adapter with its base model's.
    pub fn list(&self) -> Vec<ModelStatus> {
        let mut models = self.list_models();
        models.extend(self.adapter_statuses(&models));
        models
    }

    /// The resident models whose engines are down, with why.
    pub fn down(&self) -> Vec<(String, String)> {
        let slots = self.slots();
        self.entries
            .iter()
            .zip(slots.iter())
            .filter_map(|(e, s)| match s.resident.as_ref()?.served.engine.health() {
                EngineHealth::Down(why) => Some((e.name.clone(), why)),
                _ => None,
            })
            .collect()
    }

    /// The resident engines' metrics added up (`/metrics`).
    pub fn engine_metrics(&self) -> EngineMetrics {
        let total = EngineMetrics::default();
        for s in self.slots().iter() {
            if let Some(r) = &s.resident {
                let from = crate::isolate::protocol::metric_fields(r.served.engine.metrics());
                for (sum, v) in crate::isolate::protocol::metric_fields(&total).iter().zip(from) {
                    sum.fetch_add(v.load(Ordering::Relaxed), Ordering::Relaxed);
                }
            }
        }
        total
    }
}

/// Lock `m`, poisoned or not (every update under these locks is one assignment).
fn lock_any<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Drop engines on the blocking pool: an engine's drop waits for its thread (or process).
async fn drop_off_runtime(victims: Vec<Arc<Served>>) {
    if !victims.is_empty() {
        let _ = tokio::task::spawn_blocking(move || drop(victims)).await;
    }
}

fn load_failed(name: &str, why: &str) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, format!("cannot load the model '{name}': {why}"))
        .with_code("model_load_failed")
}

fn insufficient_memory(name: &str, need: u64, budget: u64) -> ApiError {
    let gb = |b: u64| b as f64 / 1e9;
    ApiError::new(
        StatusCode::INSUFFICIENT_STORAGE,
        format!(
            "the model '{name}' needs about {:.2} GB (weights and KV cache) but the memory budget is {:.2} GB \
             (--memory-budget), even with every other model unloaded",
            gb(need),
            gb(budget)
        ),
    )
    .with_param("model")
    .with_code("insufficient_memory")
}
