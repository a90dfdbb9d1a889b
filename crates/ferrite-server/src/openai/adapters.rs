//! vLLM's run-time LoRA endpoints: `POST /v1/load_lora_adapter` (`lora_name`, `lora_path`,
//! optionally `base_model_name`: a model of the pool, default the first) serves a PEFT
//! adapter directory under a new name; `POST /v1/unload_lora_adapter` (`lora_name`) stops
//! serving it once no request uses it (409 while one does). Both need the API key like every
//! API route; bad adapters are 400s naming what is wrong, and the server carries on.

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::State;
use serde::Deserialize;

use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::state::App;

#[derive(Debug, Deserialize)]
struct LoadAdapter {
    lora_name: String,
    lora_path: PathBuf,
    base_model_name: Option<String>,
}

#[derive(Debug, Deserialize)]
struct UnloadAdapter {
    lora_name: String,
}

pub async fn load(State(app): State<Arc<App>>, body: JsonBody) -> Result<String, ApiError> {
    let req: LoadAdapter = body.parse()?;
    app.pool.load_adapter(&req.lora_name, &req.lora_path, req.base_model_name.as_deref()).await?;
    Ok(format!("Success: LoRA adapter '{}' added successfully.", req.lora_name))
}

pub async fn unload(State(app): State<Arc<App>>, body: JsonBody) -> Result<String, ApiError> {
    let req: UnloadAdapter = body.parse()?;
    app.pool.unload_adapter(&req.lora_name).await?;
    Ok(format!("Success: LoRA adapter '{}' removed successfully.", req.lora_name))
}
