//! Request bodies: `JsonBody` reads the body (over the size limit → 413), checks it is UTF-8
//! and a JSON object (else 400), and `JsonBody::parse` deserializes it into a typed request,
//! naming the offending field in a wrong-type error. Unknown fields are ignored (SDKs send
//! extras); a field of the wrong type never is.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;

/// A request body that is a JSON object.
pub struct JsonBody(pub Value);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|r| {
            let status = r.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(status, "the request body is larger than the server's limit")
            } else {
                ApiError::new(status, format!("could not read the request body: {}", r.body_text()))
            }
        })?;
        if let Err(e) = std::str::from_utf8(&bytes) {
            return Err(ApiError::bad_request(format!(
                "the request body is not valid UTF-8 (invalid byte at offset {})",
                e.valid_up_to()
            )));
        }
        let value: Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
        if !value.is_object() {
            return Err(ApiError::bad_request("the request body must be a JSON object"));
        }
        Ok(JsonBody(value))
    }
}

impl JsonBody {
    /// Deserialize the body as `T`; a wrong type is a 400 naming the field.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, ApiError> {
        parse_value(&self.0)
    }
}

/// Deserialize `value` as `T`; a wrong type is a 400 naming the field (its path).
pub fn parse_value<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::bad_request(format!("invalid request: {inner}"))
        } else {
            ApiError::invalid_param(path.clone(), format!("invalid value for '{path}': {inner}"))
        }
    })
}
