//! The engine's side of the paged KV cache: block pools, per-sequence block tables per KV
//! group, and the prefix cache.

pub mod block_pool;
pub mod manager;
pub mod prefix_cache;

pub use block_pool::BlockPool;
pub use manager::{KvManager, SeqKv};
pub use prefix_cache::PrefixCache;
