//! Chat templates (minijinja with the Hugging Face extras).
