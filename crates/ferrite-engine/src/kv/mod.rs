//! The engine's side of the paged KV cache: which physical blocks each sequence owns.

pub mod block_pool;

pub use block_pool::BlockPool;
