//! The engine's side of the paged KV cache: block pools, the owned per-sequence allocations
//! (a block table per KV group), the rules of each group kind, and the prefix cache.

pub mod block_pool;
pub mod manager;
pub mod policy;
pub mod prefix_cache;
pub mod seq_kv;

pub use block_pool::BlockPool;
pub use manager::KvManager;
pub use policy::{policy_for, FullAttention, GroupPolicy, SlidingWindow};
pub use prefix_cache::PrefixCache;
pub use seq_kv::SeqKv;
