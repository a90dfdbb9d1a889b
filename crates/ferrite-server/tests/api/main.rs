//! The HTTP API end to end: servers on 127.0.0.1 with real models, driven by reqwest.

mod agents;
mod anthropic;
mod chat;
mod common;
mod completions;
mod embeddings;
mod errors;
mod fill;
mod hardening;
mod kv_precision;
mod lifecycle;
mod listener;
mod lora;
mod ops;
mod pool;
mod recorded;
mod responses;
mod structured;
mod tiers;
mod tools;
mod web;
