//! The engine's side of the paged KV cache: block pools, the owned per-sequence allocations
//! (a block table per KV group), the rules of each group kind, the prefix cache, and the tiers
//! below the pool (`tier`; the host-RAM tier in `host`, the SSD tier in `disk`, the host memory
//! blocks and state snapshots move through in `tier_slots`), and the turn
//! of a row from full-precision to quantized KV at its delayed start (`transition`).

pub mod block_pool;
pub mod disk;
pub mod host;
pub mod manager;
pub mod policy;
pub mod prefix_cache;
pub mod seq_kv;
pub mod tier;
pub mod tier_slots;
mod transition;

pub use block_pool::BlockPool;
pub use manager::{KvManager, Spill};
pub use policy::{policy_for, FullAttention, GroupPolicy, RecurrentState, SlidingWindow};
pub use prefix_cache::PrefixCache;
pub use seq_kv::{SeqKv, NEVER};
pub use tier::{BlockData, KvTier, Restored, TierKind};
pub use tier_slots::{Place, TierSlots};
