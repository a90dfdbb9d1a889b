//! `GET /v1/models` and `GET /v1/models/{id}`: the served model (any of its names retrieves
//! it; another name is 404).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::state::App;

fn model_object(app: &App) -> Value {
    json!({
        "id": app.model.name,
        "object": "model",
        "created": app.model.created,
        "owned_by": "ferrite",
        "max_model_len": app.engine.limits().max_model_len,
    })
}

pub async fn list(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&app)]}))
}

pub async fn retrieve(State(app): State<Arc<App>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    app.model.check(Some(&id))?;
    Ok(Json(model_object(&app)))
}
