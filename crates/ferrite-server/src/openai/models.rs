//! `GET /v1/models` and `GET /v1/models/{id}`: every model of the pool with its state
//! (`loaded`, `loading`, `unloaded`, `restarting` or `down`; any of a model's names retrieves
//! it; another name is 404), then every LoRA adapter with its base model as `parent` and its
//! directory as `root`. Listing a model does not load it.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::pool::ModelStatus;
use crate::state::App;

fn model_object(m: &ModelStatus) -> Value {
    let mut v = json!({
        "id": m.name,
        "object": "model",
        "created": m.created,
        "owned_by": "ferrite",
        "status": m.state,
        "parent": m.parent,
    });
    if let Some(root) = &m.root {
        v["root"] = json!(root);
    }
    if let Some(len) = m.max_model_len {
        v["max_model_len"] = json!(len);
    }
    if let Some(pid) = m.pid {
        v["pid"] = json!(pid);
    }
    v
}

pub async fn list(State(app): State<Arc<App>>) -> Json<Value> {
    let data: Vec<Value> = app.pool.list().iter().map(model_object).collect();
    Json(json!({"object": "list", "data": data}))
}

pub async fn retrieve(State(app): State<Arc<App>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let name = app.pool.resolve_name(&id)?;
    let listed = app.pool.list().into_iter().find(|m| m.name == name);
    listed.map(|m| Json(model_object(&m))).ok_or_else(|| ApiError::internal("the model left the pool"))
}
