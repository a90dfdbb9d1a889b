//! ferrite-engine: the engine core.
