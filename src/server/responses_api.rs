//! `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API over the chat
//! pipeline. A request's `instructions`, `input` items and `tools` become a chat request (the
//! same template, tool-call parser, structured output and scheduler); its events become output
//! items (`reasoning`, `message`, `function_call`) and, when streamed, the Responses event
//! sequence (`response.created` … `response.completed`, each with its `sequence_number`).
//!
//! Stored responses (`store`, default true) keep their conversation, so a request with
//! `previous_response_id` continues it: the earlier turns render to the same prompt prefix, which
//! the prefix cache holds, so the follow-up prefills little more than its new input. The store
//! is bounded (least recently used out); as in OpenAI's API, `instructions` are not carried over.

use super::error::ApiError;
use super::request::Endpoint;
use super::responses::Collected;
use super::routes::{draining, enqueue, now_secs, prepare, refuse, AppState};
use super::tools::ToolEvent;
use super::worker::{Event, Usage};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;

const PATH: &str = "/v1/responses";

/// Stored responses kept at most, and the bytes of their JSON (each keeps its whole
/// conversation, so a long document counts once per turn); least recently used out.
pub const STORE_CAPACITY: usize = 4096;
pub const STORE_BYTES: usize = 256 << 20;

/// A stored response: the object as returned, and its conversation (chat messages, this
/// response's output included) for `previous_response_id`.
struct Stored {
    object: Value,
    conversation: Vec<Value>,
    bytes: usize,
    last_used: u64,
}

/// The bounded response store.
#[derive(Default)]
pub struct ResponseStore {
    entries: HashMap<String, Stored>,
    bytes: usize,
    clock: u64,
}

impl ResponseStore {
    fn put(&mut self, id: String, object: Value, conversation: Vec<Value>) {
        self.remove(&id);
        let bytes = object.to_string().len() + conversation.iter().map(|m| m.to_string().len()).sum::<usize>();
        if bytes > STORE_BYTES {
            return;
        }
        while !self.entries.is_empty() && (self.entries.len() >= STORE_CAPACITY || self.bytes + bytes > STORE_BYTES) {
            let old = self.entries.iter().min_by_key(|(_, s)| s.last_used).map(|(k, _)| k.clone()).expect("not empty");
            self.remove(&old);
        }
        self.clock += 1;
        self.bytes += bytes;
        self.entries.insert(id, Stored { object, conversation, bytes, last_used: self.clock });
    }

    fn get(&mut self, id: &str) -> Option<&Stored> {
        self.clock += 1;
        let clock = self.clock;
        self.entries.get_mut(id).map(|s| {
            s.last_used = clock;
            &*s
        })
    }

    fn remove(&mut self, id: &str) -> bool {
        match self.entries.remove(id) {
            Some(s) => {
                self.bytes -= s.bytes;
                true
            }
            None => false,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The chat request a Responses request stands for, the chat messages of its new input, and
/// the request fields echoed in the response object.
struct Translated {
    chat: Value,
    input_messages: Vec<Value>,
    echo: Map<String, Value>,
}

fn param(name: &str, msg: impl Into<String>) -> ApiError {
    ApiError::param(name, msg)
}

/// A message's content as text: a string, or the text parts of a content list.
fn content_text(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => text.push_str(p.get("text").and_then(Value::as_str).unwrap_or_default()),
                    Some(t) => return Err(param(at, format!("content parts of type {t:?} are not supported (text only)"))),
                    None => return Err(param(at, "a content part needs a \"type\"")),
                }
            }
            Ok(text)
        }
        Value::Null => Ok(String::new()),
        _ => Err(param(at, "content must be a string or a list of content parts")),
    }
}

/// The `input` items as chat messages: messages (developer as system), function calls (one
/// assistant message per run of calls) and their outputs (tool messages); reasoning items are
/// left out (the template drops earlier turns' reasoning anyway).
fn input_messages(input: &Value) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(items) => items,
        Value::Null => return Err(param("input", "'input' is required")),
        _ => return Err(param("input", "'input' must be a string or a list of items")),
    };
    let mut out: Vec<Value> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer") | Some("system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    Some(r) => return Err(param(&at, format!("unknown role {r:?}"))),
                    None => return Err(param(&at, "a message needs a \"role\"")),
                };
                out.push(json!({"role": role, "content": content_text(item.get("content").unwrap_or(&Value::Null), &at)?}));
            }
            "function_call" => {
                let field = |k: &str| item.get(k).and_then(Value::as_str).ok_or_else(|| param(&at, format!("a function_call needs \"{k}\"")));
                let call = json!({"id": field("call_id")?, "type": "function", "function": {"name": field("name")?, "arguments": item.get("arguments").and_then(Value::as_str).unwrap_or("{}")}});
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" && m.get("tool_calls").is_some() => m["tool_calls"].as_array_mut().expect("a list").push(call),
                    _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let call_id = item.get("call_id").and_then(Value::as_str).ok_or_else(|| param(&at, "a function_call_output needs \"call_id\""))?;
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => content_text(v, &at)?,
                    _ => return Err(param(&at, "a function_call_output needs \"output\"")),
                };
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            "reasoning" => {}
            other => return Err(param(&at, format!("input items of type {other:?} are not supported"))),
        }
    }
    Ok(out)
}

/// Function tools in the chat shape; other tool types are refused.
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Some(list) = tools.as_array() else { return Err(param("tools", "'tools' must be a list")) };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {
                let mut f = Map::new();
                for k in ["name", "description", "parameters", "strict"] {
                    if let Some(v) = t.get(k) {
                        f.insert(k.into(), v.clone());
                    }
                }
                out.push(json!({"type": "function", "function": f}));
            }
            Some(other) => return Err(param(&format!("tools[{i}]"), format!("tools of type {other:?} are not supported (function tools only)"))),
            None => return Err(param(&format!("tools[{i}]"), "a tool needs a \"type\"")),
        }
    }
    Ok(Value::Array(out))
}

/// `tool_choice` in the chat shape.
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| param("tool_choice", "a function tool_choice needs \"name\""))?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(param("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}")),
    }
}

/// `text.format` as the chat `response_format`.
fn response_format(text: &Value) -> Result<Option<Value>, ApiError> {
    let Some(format) = text.get("format") else { return Ok(None) };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut js = Map::new();
            for k in ["name", "schema", "strict", "description"] {
                if let Some(v) = format.get(k) {
                    js.insert(k.into(), v.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": js})))
        }
        _ => Err(param("text.format", "'text.format.type' must be \"text\", \"json_object\" or \"json_schema\"")),
    }
}

/// The chat request for `body`, continuing `history` (a stored conversation).
fn translate(body: &Value, history: &[Value]) -> Result<Translated, ApiError> {
    let Some(obj) = body.as_object() else { return Err(ApiError::invalid("the request body must be a JSON object")) };
    if obj.get("background").and_then(Value::as_bool) == Some(true) {
        return Err(param("background", "background responses are not supported"));
    }
    let input = input_messages(obj.get("input").unwrap_or(&Value::Null))?;
    let mut messages = Vec::new();
    if let Some(instr) = obj.get("instructions").filter(|v| !v.is_null()) {
        let text = instr.as_str().ok_or_else(|| param("instructions", "'instructions' must be a string"))?;
        messages.push(json!({"role": "system", "content": text}));
    }
    messages.extend(history.iter().cloned());
    messages.extend(input.iter().cloned());
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    for k in ["model", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "parallel_tool_calls", "user", "prompt_cache_key", "chat_template_kwargs", "repetition_penalty", "presence_penalty", "frequency_penalty"] {
        if let Some(v) = obj.get(k).filter(|v| !v.is_null()) {
            chat.insert(k.into(), v.clone());
        }
    }
    if let Some(m) = obj.get("max_output_tokens").filter(|v| !v.is_null()) {
        chat.insert("max_completion_tokens".into(), m.clone());
    }
    if let Some(t) = obj.get("tools").filter(|v| !v.is_null()) {
        chat.insert("tools".into(), chat_tools(t)?);
    }
    if let Some(c) = obj.get("tool_choice").filter(|v| !v.is_null()) {
        chat.insert("tool_choice".into(), chat_tool_choice(c)?);
    }
    if let Some(f) = obj.get("text").map(response_format).transpose()?.flatten() {
        chat.insert("response_format".into(), f);
    }
    if let Some(e) = obj.get("reasoning").and_then(|r| r.get("effort")).filter(|v| !v.is_null()) {
        chat.insert("reasoning_effort".into(), e.clone());
    }
    let mut echo = Map::new();
    for (k, default) in [
        ("instructions", Value::Null),
        ("max_output_tokens", Value::Null),
        ("metadata", json!({})),
        ("parallel_tool_calls", json!(true)),
        ("previous_response_id", Value::Null),
        ("reasoning", json!({"effort": null, "summary": null})),
        ("store", json!(true)),
        ("temperature", Value::Null),
        ("text", json!({"format": {"type": "text"}})),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("top_p", Value::Null),
        ("user", Value::Null),
    ] {
        echo.insert(k.into(), obj.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(default));
    }
    echo.insert("truncation".into(), json!("disabled"));
    Ok(Translated { chat: Value::Object(chat), input_messages: input, echo })
}

/// The output items of a finished response, in order: reasoning, message, function calls.
fn output_items(id: &str, c: &Collected) -> Vec<Value> {
    let mut out = Vec::new();
    if !c.reasoning.is_empty() {
        out.push(reasoning_item(&format!("rs_{id}"), &c.reasoning, "completed"));
    }
    // An empty message only when there is nothing else (as the stream does).
    if !c.content.is_empty() || (c.calls.is_empty() && c.reasoning.is_empty()) {
        out.push(message_item(&format!("msg_{id}"), &c.content, "completed"));
    }
    for (k, (call_id, name, args)) in c.calls.iter().enumerate() {
        out.push(call_item(&format!("fc_{id}_{k}"), call_id, name, args, "completed"));
    }
    out
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "completed" { json!([{"type": "reasoning_text", "text": text}]) } else { json!([]) };
    json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "completed" { json!([text_part(text)]) } else { json!([]) };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(id: &str, call_id: &str, name: &str, args: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": args, "status": status})
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// The response object: `status` "in_progress" (no output yet), "completed", or "incomplete"
/// (cut by max_output_tokens).
fn response_object(id: &str, created: u64, model: &str, echo: &Map<String, Value>, status: &str, output: Vec<Value>, usage: Option<&Usage>) -> Value {
    let mut v = json!({
        "id": id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": null,
        "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "usage": usage.map(usage_json).unwrap_or(Value::Null),
    });
    for (k, val) in echo {
        v[k] = val.clone();
    }
    v
}

/// The assistant's turn as a chat message, for the stored conversation.
fn assistant_message(c: &Collected) -> Value {
    let mut m = json!({"role": "assistant", "content": c.content});
    if !c.reasoning.is_empty() {
        m["reasoning_content"] = json!(c.reasoning);
    }
    if !c.calls.is_empty() {
        m["tool_calls"] = c.tool_calls();
    }
    m
}

pub async fn create(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let arrived = Instant::now();
    let fail = |e: ApiError| refuse(&st, PATH, arrived, e);
    if let Some(e) = draining(&st) {
        return fail(e);
    }
    let body = match body.map_err(super::routes::body_error).and_then(|b| serde_json::from_slice::<Value>(&b).map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))) {
        Ok(b) => b,
        Err(e) => return fail(e),
    };
    let previous = body.get("previous_response_id").filter(|v| !v.is_null());
    let history = match previous {
        None => Vec::new(),
        Some(Value::String(p)) => match st.responses.lock().unwrap_or_else(|e| e.into_inner()).get(p) {
            Some(s) => s.conversation.clone(),
            None => return fail(ApiError::param("previous_response_id", format!("no stored response with id {p:?}")).with_code("previous_response_not_found")),
        },
        Some(_) => return fail(ApiError::param("previous_response_id", "'previous_response_id' must be a string")),
    };
    let t = match translate(&body, &history) {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let p = match prepare(&st, Endpoint::Chat, Ok(Bytes::from(t.chat.to_string()))).await {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    if p.req.n != 1 {
        return fail(ApiError::param("n", "the Responses API answers one choice"));
    }
    let stream = p.req.stream;
    let rx = match enqueue(&st, p, arrived, PATH) {
        Ok(rx) => rx,
        Err(e) => return fail(e),
    };
    let serial = st.counter.fetch_add(1, Relaxed) + 1;
    let created = now_secs();
    let key = format!("{created:x}{serial:x}");
    let id = format!("resp_{key}");
    let store = t.echo.get("store").and_then(Value::as_bool).unwrap_or(true);
    let mut conversation = history;
    conversation.extend(t.input_messages);
    let finished = Finished { st: st.clone(), id: id.clone(), key, created, echo: t.echo, conversation, store };
    if stream {
        st.metrics.count_request("responses", 200);
        return streamed(finished, rx).into_response();
    }
    // Dropping this future (client gone) drops `rx`, which cancels.
    let mut rx = rx;
    let mut acc = Collected::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Delta { delta, logprobs, .. } => acc.add(delta, logprobs),
            Event::Done { finish_reason, usage, .. } => {
                st.metrics.count_request("responses", 200);
                return Json(finished.complete(&acc, finish_reason, &usage)).into_response();
            }
            // The worker logged the failure; only the status is counted here.
            Event::Error(e) => {
                st.metrics.count_request("responses", e.status.as_u16());
                return e.into_response();
            }
            Event::PromptLogprobs { .. } => {}
        }
    }
    st.metrics.count_request("responses", 500);
    ApiError::internal().into_response()
}

/// What a response needs once its tokens are in.
struct Finished {
    st: Arc<AppState>,
    id: String,
    /// The id's unique part, for the output items' ids.
    key: String,
    created: u64,
    echo: Map<String, Value>,
    conversation: Vec<Value>,
    store: bool,
}

impl Finished {
    /// The final response object, stored with its conversation when `store`.
    fn complete(mut self, acc: &Collected, finish_reason: &str, usage: &Usage) -> Value {
        let status = if finish_reason == "length" { "incomplete" } else { "completed" };
        let object = response_object(&self.id, self.created, &self.st.model_id, &self.echo, status, output_items(&self.key, acc), Some(usage));
        if self.store {
            self.conversation.push(assistant_message(acc));
            self.st.responses.lock().unwrap_or_else(|e| e.into_inner()).put(self.id.clone(), object.clone(), self.conversation);
        }
        object
    }
}

/// Which output item the stream has open.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    Nothing,
    Reasoning,
    Message,
    Call(usize),
}

/// The Responses event sequence of one streamed response.
struct EventStream {
    key: String,
    seq: u64,
    open: Open,
    /// Output items started so far (the open one is the last).
    items: usize,
    acc: Collected,
}

impl EventStream {
    fn event(&mut self, out: &mut Vec<Result<SseEvent, Infallible>>, mut v: Value) {
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        let kind = v["type"].as_str().unwrap_or_default().to_string();
        out.push(Ok(SseEvent::default().event(kind).data(v.to_string())));
    }

    fn item_id(&self, open: Open) -> String {
        match open {
            Open::Reasoning => format!("rs_{}", self.key),
            Open::Message => format!("msg_{}", self.key),
            Open::Call(k) => format!("fc_{}_{k}", self.key),
            Open::Nothing => String::new(),
        }
    }

    /// Closes the open item: its text's done events and the finished item.
    fn close(&mut self, out: &mut Vec<Result<SseEvent, Infallible>>) {
        let open = self.open;
        let (index, id) = (self.items.saturating_sub(1), self.item_id(open));
        let item = match open {
            Open::Nothing => return,
            Open::Reasoning => {
                let text = self.acc.reasoning.clone();
                self.event(out, json!({"type": "response.reasoning_text.done", "item_id": id, "output_index": index, "content_index": 0, "text": text}));
                self.event(out, json!({"type": "response.content_part.done", "item_id": id, "output_index": index, "content_index": 0, "part": {"type": "reasoning_text", "text": text}}));
                reasoning_item(&id, &text, "completed")
            }
            Open::Message => {
                let text = self.acc.content.clone();
                self.event(out, json!({"type": "response.output_text.done", "item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}));
                self.event(out, json!({"type": "response.content_part.done", "item_id": id, "output_index": index, "content_index": 0, "part": text_part(&text)}));
                message_item(&id, &text, "completed")
            }
            Open::Call(k) => {
                let (call_id, name, args) = self.acc.calls[k].clone();
                self.event(out, json!({"type": "response.function_call_arguments.done", "item_id": id, "output_index": index, "name": name, "arguments": args}));
                call_item(&id, &call_id, &name, &args, "completed")
            }
        };
        self.event(out, json!({"type": "response.output_item.done", "output_index": index, "item": item}));
        self.open = Open::Nothing;
    }

    /// Opens a new item (closing the open one).
    fn start(&mut self, out: &mut Vec<Result<SseEvent, Infallible>>, open: Open) {
        self.close(out);
        self.open = open;
        let (index, id) = (self.items, self.item_id(open));
        self.items += 1;
        match open {
            Open::Reasoning => {
                self.event(out, json!({"type": "response.output_item.added", "output_index": index, "item": reasoning_item(&id, "", "in_progress")}));
                self.event(out, json!({"type": "response.content_part.added", "item_id": id, "output_index": index, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}));
            }
            Open::Message => {
                self.event(out, json!({"type": "response.output_item.added", "output_index": index, "item": message_item(&id, "", "in_progress")}));
                self.event(out, json!({"type": "response.content_part.added", "item_id": id, "output_index": index, "content_index": 0, "part": text_part("")}));
            }
            Open::Call(k) => {
                let (call_id, name, _) = self.acc.calls[k].clone();
                self.event(out, json!({"type": "response.output_item.added", "output_index": index, "item": call_item(&id, &call_id, &name, "", "in_progress")}));
            }
            Open::Nothing => {}
        }
    }

    /// The events of one delta of the generation.
    fn delta(&mut self, out: &mut Vec<Result<SseEvent, Infallible>>, d: super::output::Delta) {
        if !d.reasoning.is_empty() {
            if self.open != Open::Reasoning {
                self.start(out, Open::Reasoning);
            }
            self.acc.reasoning.push_str(&d.reasoning);
            let id = self.item_id(Open::Reasoning);
            self.event(out, json!({"type": "response.reasoning_text.delta", "item_id": id, "output_index": self.items - 1, "content_index": 0, "delta": d.reasoning}));
        }
        let mut text = d.content;
        for e in d.tool_calls {
            match e {
                ToolEvent::Content(c) => text.push_str(&c),
                ToolEvent::Start { id, name, .. } => {
                    self.text(out, std::mem::take(&mut text));
                    self.acc.calls.push((id, name, String::new()));
                    let k = self.acc.calls.len() - 1;
                    self.start(out, Open::Call(k));
                }
                ToolEvent::Args { index, fragment } => {
                    self.text(out, std::mem::take(&mut text));
                    if let Some(c) = self.acc.calls.get_mut(index) {
                        c.2.push_str(&fragment);
                    }
                    if self.open == Open::Call(index) {
                        let id = self.item_id(self.open);
                        self.event(out, json!({"type": "response.function_call_arguments.delta", "item_id": id, "output_index": self.items - 1, "delta": fragment}));
                    }
                }
            }
        }
        self.text(out, text);
    }

    fn text(&mut self, out: &mut Vec<Result<SseEvent, Infallible>>, text: String) {
        if text.is_empty() {
            return;
        }
        if self.open != Open::Message {
            self.start(out, Open::Message);
        }
        self.acc.content.push_str(&text);
        let id = self.item_id(Open::Message);
        self.event(out, json!({"type": "response.output_text.delta", "item_id": id, "output_index": self.items - 1, "content_index": 0, "delta": text, "logprobs": []}));
    }
}

fn streamed(finished: Finished, rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Sse<impl futures::Stream<Item = Result<SseEvent, Infallible>>> {
    let mut es = EventStream { key: finished.key.clone(), seq: 0, open: Open::Nothing, items: 0, acc: Collected::default() };
    let mut head = Vec::new();
    let start = response_object(&finished.id, finished.created, &finished.st.model_id, &finished.echo, "in_progress", vec![], None);
    es.event(&mut head, json!({"type": "response.created", "response": start}));
    es.event(&mut head, json!({"type": "response.in_progress", "response": start}));
    let mut finished = Some(finished);
    let body = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let mut out = Vec::new();
        match ev {
            Event::Delta { delta, .. } => es.delta(&mut out, delta),
            Event::Done { finish_reason, usage, .. } => {
                // A response with no output at all still answers with an (empty) message.
                if es.items == 0 {
                    es.start(&mut out, Open::Message);
                }
                es.close(&mut out);
                if let Some(f) = finished.take() {
                    let object = f.complete(&es.acc, finish_reason, &usage);
                    let kind = if object["status"] == "incomplete" { "response.incomplete" } else { "response.completed" };
                    es.event(&mut out, json!({"type": kind, "response": object}));
                }
            }
            Event::Error(e) => {
                let body = e.body();
                es.event(&mut out, json!({"type": "error", "code": body["error"]["code"], "message": body["error"]["message"], "param": body["error"]["param"]}));
            }
            Event::PromptLogprobs { .. } => {}
        }
        futures::stream::iter(out)
    });
    Sse::new(futures::stream::iter(head).chain(body)).keep_alive(KeepAlive::default())
}

/// `GET /v1/responses/{id}`: a stored response.
pub async fn retrieve(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match st.responses.lock().unwrap_or_else(|e| e.into_inner()).get(&id) {
        Some(s) => {
            st.metrics.count_request("responses", 200);
            Json(s.object.clone()).into_response()
        }
        None => {
            st.metrics.count_request("responses", 404);
            ApiError::not_found(&format!("response {id:?}")).into_response()
        }
    }
}

/// `DELETE /v1/responses/{id}`: forgets a stored response.
pub async fn delete(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let removed = st.responses.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
    if removed {
        st.metrics.count_request("responses", 200);
        Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        st.metrics.count_request("responses", 404);
        ApiError::not_found(&format!("response {id:?}")).into_response()
    }
}

/// Unit tests of the request translation (the HTTP behaviour is tested through the openai
/// client in tests/openai_client/test_responses.py).
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_chat_messages() {
        let input = json!([
            {"role": "developer", "content": "be brief"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]);
        let m = input_messages(&input).unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[1], json!({"role": "user", "content": "weather in Paris?"}));
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(m[2]["tool_calls"][1]["function"]["name"], "get_time");
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}));
        assert_eq!(input_messages(&json!("hi")).unwrap(), vec![json!({"role": "user", "content": "hi"})]);
        for bad in [json!([{"type": "input_image"}]), json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), json!([{"type": "function_call", "name": "f"}]), json!(3), Value::Null] {
            assert!(input_messages(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn request_fields_map_onto_the_chat_request() {
        let body = json!({
            "model": "m", "instructions": "sys", "input": "hi", "max_output_tokens": 9, "temperature": 0.5,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": true}},
            "reasoning": {"effort": "none"}, "stream": true,
        });
        let history = vec![json!({"role": "user", "content": "before"}), json!({"role": "assistant", "content": "ok"})];
        let t = translate(&body, &history).unwrap();
        let c = &t.chat;
        // Instructions first, then the stored turns, then the new input.
        assert_eq!(c["messages"].as_array().unwrap().iter().map(|m| m["content"].as_str().unwrap()).collect::<Vec<_>>(), ["sys", "before", "ok", "hi"]);
        assert_eq!((c["max_completion_tokens"].clone(), c["temperature"].clone(), c["stream"].clone()), (json!(9), json!(0.5), json!(true)));
        assert_eq!(c["tools"][0], json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}));
        assert_eq!(c["tool_choice"], json!({"type": "function", "function": {"name": "f"}}));
        assert_eq!(c["response_format"], json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}));
        assert_eq!(c["reasoning_effort"], json!("none"));
        assert_eq!(t.input_messages, vec![json!({"role": "user", "content": "hi"})]);
        assert_eq!((t.echo["store"].clone(), t.echo["instructions"].clone()), (json!(true), json!("sys")));
        for bad in [json!({"input": "x", "tools": [{"type": "web_search"}]}), json!({"input": "x", "background": true}), json!({"input": "x", "text": {"format": {"type": "yaml"}}}), json!({"input": "x", "tool_choice": 3})] {
            assert!(translate(&bad, &[]).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_store_is_bounded_least_recently_used_out() {
        let mut s = ResponseStore::default();
        for i in 0..STORE_CAPACITY {
            s.put(format!("r{i}"), json!(i), vec![]);
        }
        assert!(s.get("r0").is_some()); // r1 is now the least recently used
        s.put("new".into(), json!(0), vec![]);
        assert_eq!(s.len(), STORE_CAPACITY);
        assert!(s.get("r1").is_none() && s.get("r0").is_some() && s.get("new").is_some());
        // Bytes bound it too: two conversations of 100 MiB leave room for one more.
        let big = |c: char| vec![json!({"role": "user", "content": c.to_string().repeat(100 << 20)})];
        s.put("a".into(), json!(0), big('a'));
        s.put("b".into(), json!(0), big('b'));
        assert!(s.get("a").is_some() && s.get("b").is_some());
        s.put("c".into(), json!(0), big('c'));
        assert!(s.get("a").is_none() && s.get("b").is_some() && s.get("c").is_some());
        assert!(s.bytes <= STORE_BYTES && s.bytes > 200 << 20);
        // One larger than the whole budget is not stored, and evicts nothing.
        s.put("huge".into(), json!(0), vec![json!("x".repeat(STORE_BYTES))]);
        assert!(s.get("huge").is_none() && s.get("b").is_some() && s.get("c").is_some());
    }
}
