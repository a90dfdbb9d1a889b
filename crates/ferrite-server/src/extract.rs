//! Request bodies: `JsonBody` needs `Content-Type: application/json` (else 415: a browser form
//! or `text/plain` post cannot carry a request across origins), reads the body (over the size
//! limit → 413), checks it is UTF-8 and a JSON object (else 400), and `JsonBody::parse`
//! deserializes it into a typed request straight from the bytes, naming the offending field in
//! a wrong-type error. Unknown fields are skipped by the parser without being built (SDKs send
//! extras, and a hostile client can send a huge one): the body is never held as a whole
//! `serde_json::Value`, so what a request costs in memory is its bytes plus the fields the
//! server reads. A field of the wrong type is never ignored.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use serde::de::{DeserializeOwned, IgnoredAny};

use crate::error::ApiError;

/// A request body that is a JSON object, kept as its bytes.
pub struct JsonBody(Bytes);

impl<S: Send + Sync> FromRequest<S> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let content_type = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
        if !is_json(content_type) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("the request body must be sent as 'Content-Type: application/json', got '{content_type}'"),
            ));
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|r| {
            let status = r.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(status, "the request body is larger than the server's limit")
            } else {
                ApiError::new(status, format!("could not read the request body: {}", r.body_text()))
            }
        })?;
        JsonBody::new(bytes)
    }
}

impl JsonBody {
    /// Check `bytes` is UTF-8 holding one JSON object (walked, nothing built).
    pub fn new(bytes: Bytes) -> Result<JsonBody, ApiError> {
        if let Err(e) = std::str::from_utf8(&bytes) {
            return Err(ApiError::bad_request(format!(
                "the request body is not valid UTF-8 (invalid byte at offset {})",
                e.valid_up_to()
            )));
        }
        serde_json::from_slice::<IgnoredAny>(&bytes)
            .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ApiError::bad_request("the request body must be a JSON object"));
        }
        Ok(JsonBody(bytes))
    }

    /// Deserialize the body as `T`; a wrong type is a 400 naming the field.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, ApiError> {
        let mut de = serde_json::Deserializer::from_slice(&self.0);
        serde_path_to_error::deserialize(&mut de).map_err(path_error)
    }
}

/// `application/json`, with or without parameters (`; charset=utf-8`).
fn is_json(content_type: &str) -> bool {
    content_type.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// A 400 naming the field (its path) that did not parse.
fn path_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    if path == "." {
        ApiError::bad_request(format!("invalid request: {inner}"))
    } else {
        ApiError::invalid_param(path.clone(), format!("invalid value for '{path}': {inner}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Small {
        model: Option<String>,
    }

    #[test]
    fn unknown_fields_are_skipped_and_wrong_types_named() {
        let body = JsonBody::new(Bytes::from_static(br#"{"extra": [[1, 2], {"a": [3]}], "model": "m"}"#)).expect("ok");
        assert_eq!(body.parse::<Small>().expect("parses").model.as_deref(), Some("m"));
        let body = JsonBody::new(Bytes::from_static(br#"{"model": 3}"#)).expect("ok");
        assert_eq!(body.parse::<Small>().expect_err("400").param.as_deref(), Some("model"));
        assert!(is_json("application/json") && is_json("Application/JSON; charset=utf-8"));
        assert!(!is_json("text/plain") && !is_json("") && !is_json("application/jsonx"));
        for bad in [&b"[1]"[..], b" 3", b"{\"a\": ", b"{} {}"] {
            assert!(JsonBody::new(Bytes::copy_from_slice(bad)).is_err(), "{:?}", std::str::from_utf8(bad));
        }
    }
}
