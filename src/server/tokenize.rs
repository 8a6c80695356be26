//! `POST /tokenize` and `POST /detokenize` in vLLM's shapes: the token ids the server would feed
//! the model for a prompt or a conversation (rendered by the chat template exactly as a chat
//! request is), and the text of token ids, without running the model.
//!
//! /tokenize: `{"prompt": "..."}` or `{"messages": [...], "tools"?, "chat_template_kwargs"?,
//! "add_generation_prompt"? (default true)}`, `"return_token_strs"?`; answers `{"count",
//! "max_model_len", "tokens", "token_strs"?}` (token strings as the tokenizer's vocabulary spells
//! them: byte-level, e.g. "Ġhello"). /detokenize: `{"tokens": [...]}` → `{"prompt": "..."}`.

use super::error::ApiError;
use super::request::{self, Endpoint, PromptInput};
use super::routes::{render_and_tokenize, AppState};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// The body as a JSON object.
fn object(body: Result<Bytes, BytesRejection>) -> Result<(Value, Map<String, Value>), ApiError> {
    let value = request::json_body(&body.map_err(super::routes::body_error)?)?;
    let obj = value.as_object().cloned().ok_or_else(|| ApiError::invalid("request body must be a JSON object"))?;
    Ok((value, obj))
}

fn flag(obj: &Map<String, Value>, name: &str, default: bool) -> Result<bool, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::param(name, format!("'{name}' must be a boolean, got {other}"))),
    }
}

fn tokenize_body(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let (value, obj) = object(body)?;
    let token_strs = flag(&obj, "return_token_strs", false)?;
    let generation_prompt = flag(&obj, "add_generation_prompt", true)?;
    flag(&obj, "add_special_tokens", true)?; // accepted: the Qwen tokenizer adds no special tokens
    let endpoint = match (obj.contains_key("messages"), obj.contains_key("prompt")) {
        (true, false) => Endpoint::Chat,
        (false, true) => Endpoint::Completion,
        _ => return Err(ApiError::invalid("give exactly one of 'prompt' (text or token ids) and 'messages'")),
    };
    let req = request::parse_value(endpoint, &value, &st.sampling_defaults)?;
    if !req.extra_prompts.is_empty() {
        return Err(ApiError::param("prompt", "one prompt at a time here"));
    }
    if let PromptInput::Tokens(_) = req.prompt {
        return Err(ApiError::param("prompt", "'prompt' must be text here (token ids are already tokens)"));
    }
    let rendered = catch_unwind(AssertUnwindSafe(|| render_and_tokenize(st, &req, generation_prompt)))
        .map_err(|_| ApiError::invalid("cannot render this request (internal template error)"))?;
    let (ids, _, _) = rendered?;
    let mut out = json!({"count": ids.len(), "max_model_len": st.max_seq, "tokens": ids});
    if token_strs {
        let inner = st.tokenizer.inner();
        out["token_strs"] = ids.iter().map(|&id| inner.id_to_token(id).map(Value::String).unwrap_or(Value::Null)).collect();
    }
    Ok(out)
}

fn detokenize_body(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let (_, obj) = object(body)?;
    let tokens = obj.get("tokens").and_then(Value::as_array).ok_or_else(|| ApiError::param("tokens", "'tokens' must be an array of token ids"))?;
    let ids = tokens
        .iter()
        .map(|t| match t.as_u64() {
            Some(id) if (id as usize) < st.vocab_size => Ok(id as u32),
            _ => Err(ApiError::param("tokens", format!("{t} is not a token id (0 to {})", st.vocab_size - 1))),
        })
        .collect::<Result<Vec<u32>, ApiError>>()?;
    let text = st.tokenizer.decode(&ids, false).map_err(|e| ApiError::invalid(format!("cannot detokenize: {e:#}")))?;
    Ok(json!({"prompt": text}))
}

/// Runs `work` off the async threads (templates and tokenization are CPU work) and answers it.
async fn answer(st: Arc<AppState>, label: &'static str, work: fn(&AppState, Result<Bytes, BytesRejection>) -> Result<Value, ApiError>, body: Result<Bytes, BytesRejection>) -> Response {
    let st2 = st.clone();
    let out = match st.tokenize_permits.acquire().await {
        Ok(_permit) => tokio::task::spawn_blocking(move || work(&st2, body)).await.unwrap_or_else(|_| Err(ApiError::internal())),
        Err(_) => Err(ApiError::unavailable("the server is shutting down")),
    };
    match out {
        Ok(v) => {
            st.metrics.count_request(label, 200);
            Json(v).into_response()
        }
        Err(e) => {
            st.metrics.count_request(label, e.status.as_u16());
            e.into_response()
        }
    }
}

pub async fn tokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    answer(st, "tokenize", tokenize_body, body).await
}

pub async fn detokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    answer(st, "detokenize", detokenize_body, body).await
}
