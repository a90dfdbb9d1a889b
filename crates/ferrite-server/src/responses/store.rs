//! The stored responses behind `previous_response_id` and `GET /v1/responses/{id}`: a
//! bounded in-memory map with a time to live. Each entry holds the response object and the
//! conversation so far (without instructions) with the response's output appended, which
//! is what a follow-up request continues. Expired entries go on the next write; past the
//! capacity — in entries or in bytes (of the entries' JSON) — the oldest go first. An entry
//! larger than the whole byte budget is not kept.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// One stored response.
#[derive(Debug)]
pub struct Stored {
    pub response: Value,
    /// The conversation, this response's output included.
    pub messages: Vec<Value>,
    at: Instant,
    /// The bytes of its JSON (what it counts against the byte budget).
    bytes: usize,
}

#[derive(Default)]
struct Entries {
    map: HashMap<String, Arc<Stored>>,
    /// Ids in the order they were stored (their expiry order).
    order: VecDeque<String>,
    /// The bytes of the entries in `map`.
    bytes: usize,
}

pub struct ResponseStore {
    entries: Mutex<Entries>,
    capacity: usize,
    max_bytes: usize,
    ttl: Duration,
}

/// The length of `v` as compact JSON.
fn json_len(v: &Value) -> usize {
    serde_json::to_vec(v).map_or(0, |b| b.len())
}

impl ResponseStore {
    pub fn new(capacity: usize, max_bytes: usize, ttl: Duration) -> ResponseStore {
        ResponseStore { entries: Mutex::new(Entries::default()), capacity, max_bytes, ttl }
    }

    pub fn put(&self, id: String, response: Value, messages: Vec<Value>) {
        let bytes = json_len(&response) + messages.iter().map(json_len).sum::<usize>();
        if self.capacity == 0 || bytes > self.max_bytes {
            return;
        }
        let Ok(mut e) = self.entries.lock() else { return };
        let now = Instant::now();
        while let Some(oldest) = e.order.front() {
            let expired = e.map.get(oldest).is_none_or(|s| now.duration_since(s.at) >= self.ttl);
            if !expired && e.order.len() < self.capacity && e.bytes + bytes <= self.max_bytes {
                break;
            }
            if let Some(old) = e.order.pop_front().and_then(|old| e.map.remove(&old)) {
                e.bytes -= old.bytes;
            }
        }
        e.order.push_back(id.clone());
        e.bytes += bytes;
        if let Some(replaced) = e.map.insert(id, Arc::new(Stored { response, messages, at: now, bytes })) {
            e.bytes -= replaced.bytes;
        }
    }

    /// The response `id`, unless it expired or was never stored.
    pub fn get(&self, id: &str) -> Option<Arc<Stored>> {
        let e = self.entries.lock().ok()?;
        e.map.get(id).filter(|s| s.at.elapsed() < self.ttl).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn bounded_by_capacity_and_time() {
        let store = ResponseStore::new(2, 1 << 20, Duration::from_secs(60));
        for id in ["a", "b", "c"] {
            store.put(id.into(), json!({"id": id}), vec![]);
        }
        assert!(store.get("a").is_none(), "the oldest went past the capacity");
        assert_eq!(store.get("c").map(|s| s.response["id"].clone()), Some(json!("c")));
        let brief = ResponseStore::new(8, 1 << 20, Duration::from_millis(30));
        brief.put("x".into(), json!({}), vec![json!({"role": "user"})]);
        assert_eq!(brief.get("x").map(|s| s.messages.len()), Some(1));
        std::thread::sleep(Duration::from_millis(60));
        assert!(brief.get("x").is_none(), "expired");
        brief.put("y".into(), json!({}), vec![]);
        assert_eq!(brief.entries.lock().map(|e| e.map.len()).ok(), Some(1), "expired entries go on the next write");
    }

    #[test]
    fn bounded_by_bytes() {
        let store = ResponseStore::new(100, 1000, Duration::from_secs(60));
        let big = json!({"text": "x".repeat(400)});
        for id in ["a", "b", "c"] {
            store.put(id.into(), big.clone(), vec![]);
        }
        assert!(store.get("a").is_none(), "the oldest went past the byte budget");
        assert!(store.get("b").is_some() && store.get("c").is_some());
        assert!(store.entries.lock().map(|e| e.bytes <= 1000).unwrap_or(false));
        store.put("huge".into(), json!({"text": "x".repeat(2000)}), vec![]);
        assert!(store.get("huge").is_none(), "larger than the whole budget: not kept");
        assert!(store.get("c").is_some(), "and nothing was evicted for it");
    }
}
