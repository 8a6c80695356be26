//! HTTP routes: request → validation, rendering and tokenization → queue → JSON or SSE.

use super::constrain::{Constraint, Grammars, Structure};
use super::error::ApiError;
use super::metrics::{Metrics, RequestRecord};
use super::reasoning::prompt_opens_thinking;
use super::request::{self, Endpoint, ParsedRequest, PromptInput};
use super::responses::{self, completion_logprobs, ChunkBuilder, Collected, ReasoningField};
use super::worker::{Event, Job, Usage};
use crate::tokenizer::{ChatTemplate, Tokenizer};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

pub struct AppState {
    pub model_id: String,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<Arc<ChatTemplate>>,
    pub vocab_size: usize,
    pub queue: mpsc::Sender<Job>,
    pub max_queue: usize,
    pub max_seq: usize,
    pub metrics: Arc<Metrics>,
    pub api_key: Option<String>,
    pub reasoning_field: ReasoningField,
    /// Server-wide chat_template_kwargs defaults (e.g. enable_thinking); requests override.
    pub default_kwargs: Map<String, Value>,
    pub created: u64,
    pub counter: AtomicU64,
    /// Requests rendered and tokenized at once (CPU threads).
    pub tokenize_permits: tokio::sync::Semaphore,
    /// What a request's unset sampling fields take (`--sampling-defaults`).
    pub sampling_defaults: crate::engine::sampling::SamplingParams,
    /// Structured-output grammars over the vocabulary.
    pub grammars: Grammars,
    /// Stored responses of `/v1/responses` (for `previous_response_id` and retrieval).
    pub responses: std::sync::Mutex<super::responses_api::ResponseStore>,
}

pub fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(super::responses_api::create))
        .route("/v1/responses/{id}", get(super::responses_api::retrieve).delete(super::responses_api::delete))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_one))
        .route("/health", get(health))
        .route("/get_load", get(get_load))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(super::tokenize::tokenize))
        .route("/detokenize", post(super::tokenize::detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let path = req.uri().path();
        if path != "/health" && path != "/metrics" && path != "/get_load" {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
                .map(str::trim)
                .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
            // Constant-time comparison.
            let ok = given.map(|g| g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0).unwrap_or(false);
            if !ok {
                st.metrics.count_request(endpoint_label(path), 401);
                return ApiError::unauthorized().into_response();
            }
        }
    }
    next.run(req).await
}

pub(super) fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat_completions",
        "/v1/completions" => "completions",
        "/v1/responses" => "responses",
        "/v1/models" => "models",
        "/health" => "health",
        "/metrics" => "metrics",
        "/get_load" => "get_load",
        "/tokenize" => "tokenize",
        "/detokenize" => "detokenize",
        _ => "other",
    }
}

async fn not_found(req: Request) -> Response {
    ApiError::not_found(&format!("{} {}", req.method(), req.uri().path())).into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", format!("method {} is not allowed on {}", req.method(), req.uri().path())).into_response()
}

/// Ready while serving (the listener opens only once the model is loaded); 503 while draining,
/// so a gateway or load balancer stops sending requests here.
async fn health(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.metrics;
    let draining = m.draining.load(Relaxed);
    let status = if draining { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    m.count_request("health", status.as_u16());
    let body = json!({"status": if draining { "draining" } else { "ok" }, "model": st.model_id, "queue_depth": m.queue_depth.load(Relaxed).max(0), "running": m.running.load(Relaxed).max(0)});
    (status, Json(body)).into_response()
}

/// Load in the shape the SGLang Model Gateway polls (`/get_load`: one entry per data-parallel
/// rank; it balances on `num_tokens`).
async fn get_load(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.metrics;
    m.count_request("get_load", 200);
    Json(json!([{"dp_rank": 0, "num_reqs": m.running.load(Relaxed).max(0), "num_waiting_reqs": m.queue_depth.load(Relaxed).max(0), "num_tokens": m.active_tokens.load(Relaxed)}])).into_response()
}

fn model_card(st: &AppState) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.created, "owned_by": "lily", "max_model_len": st.max_seq})
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.count_request("models", 200);
    Json(json!({"object": "list", "data": [model_card(&st)]})).into_response()
}

async fn model_one(State(st): State<Arc<AppState>>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    if id == st.model_id {
        Json(model_card(&st)).into_response()
    } else {
        ApiError::not_found(&format!("model {id:?}")).with_code("model_not_found").into_response()
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.count_request("metrics", 200);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], st.metrics.render(&st.model_id)).into_response()
}

async fn chat(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    handle(st, Endpoint::Chat, body).await
}

async fn completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    handle(st, Endpoint::Completion, body).await
}

/// One prompt of a request, tokenized and checked against the context.
struct PreparedPrompt {
    tokens: Vec<u32>,
    /// The text (echoed by completions with `echo`).
    text: String,
    max_tokens: usize,
}

/// A request that passed validation, ready to queue.
pub(super) struct Prepared {
    pub(super) req: ParsedRequest,
    prompts: Vec<PreparedPrompt>,
    starts_in_reasoning: bool,
    constraint: Option<Constraint>,
}

pub(super) fn body_error(rej: BytesRejection) -> ApiError {
    let status = rej.status();
    let msg = if status == StatusCode::PAYLOAD_TOO_LARGE { "request body is too large".to_string() } else { format!("cannot read request body: {}", rej.body_text()) };
    ApiError::new(status, "invalid_request_error", msg)
}

/// Renders and tokenizes (CPU work, off the async threads); a conversation ends with the
/// assistant's generation prompt when `generation_prompt` (always, for generation).
pub(super) fn render_and_tokenize(st: &AppState, req: &ParsedRequest, generation_prompt: bool) -> Result<(Vec<u32>, String, bool), ApiError> {
    tokenize_prompt(st, req, &req.prompt, generation_prompt)
}

/// [`render_and_tokenize`] of one of the request's prompts.
fn tokenize_prompt(st: &AppState, req: &ParsedRequest, prompt: &PromptInput, generation_prompt: bool) -> Result<(Vec<u32>, String, bool), ApiError> {
    match prompt {
        PromptInput::Chat { messages, tools, kwargs, continue_final } => {
            let template = st.template.as_ref().ok_or_else(|| ApiError::invalid("this model has no chat template; use /v1/completions"))?;
            let mut kw = st.default_kwargs.clone();
            kw.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
            let render = |m: &Value, gen: bool| template.render(m, tools.as_ref(), gen, &kw).map_err(|e| ApiError::invalid(format!("cannot apply the chat template: {e:#}")));
            let text = if *continue_final { continued(messages, |m| render(m, false))? } else { render(messages, generation_prompt)? };
            fits_before_tokenizing(st, &text, "messages")?;
            let ids = st.tokenizer.encode(&text).map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e:#}")))?;
            let opens = prompt_opens_thinking(&text);
            Ok((ids, text, opens))
        }
        PromptInput::Text(t) => {
            fits_before_tokenizing(st, t, "prompt")?;
            let ids = st.tokenizer.encode(t).map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e:#}")))?;
            Ok((ids, t.clone(), false))
        }
        PromptInput::Tokens(ids) => {
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= st.vocab_size) {
                return Err(ApiError::param("prompt", format!("token id {bad} is out of range (vocabulary size {})", st.vocab_size)));
            }
            let text = if req.echo { st.tokenizer.decode(ids, true).unwrap_or_default() } else { String::new() };
            Ok((ids.clone(), text, false))
        }
    }
}

/// The prompt that continues the final (assistant) message: the conversation rendered with that
/// message's content replaced by a marker, cut at the marker, then the content as sent. The
/// template's own end of turn never follows, whatever it does around the content.
fn continued(messages: &Value, render: impl Fn(&Value) -> Result<String, ApiError>) -> Result<String, ApiError> {
    const MARK: &str = "\u{E000}lily-continue\u{E000}";
    let mut marked = messages.clone();
    let last = marked.as_array_mut().and_then(|m| m.last_mut()).ok_or_else(|| ApiError::param("messages", "no message to continue"))?;
    let content = last.get("content").and_then(Value::as_str).unwrap_or_default().to_string();
    last["content"] = Value::String(MARK.into());
    let text = render(&marked)?;
    let at = text.rfind(MARK).ok_or_else(|| ApiError::param("messages", "the chat template drops the final assistant message's content, so it cannot be continued"))?;
    Ok(format!("{}{content}", &text[..at]))
}

/// Rejects a text whose fewest possible tokens already exceed the context, before the tokenizer
/// spends time and memory on it (a multi-megabyte body would take seconds and ~0.75 GB).
fn fits_before_tokenizing(st: &AppState, text: &str, param: &str) -> Result<(), ApiError> {
    let least = st.tokenizer.min_tokens(text);
    if least >= st.max_seq {
        return Err(ApiError::param(param, format!("the prompt has at least {least} tokens ({} bytes) but the server's max-seq is {}", text.len(), st.max_seq))
            .with_code("context_length_exceeded"));
    }
    Ok(())
}

pub(super) async fn prepare(st: &Arc<AppState>, ep: Endpoint, body: Result<Bytes, BytesRejection>) -> Result<Prepared, ApiError> {
    let body = body.map_err(body_error)?;
    let req = request::parse(ep, &body, &st.sampling_defaults)?;
    let st2 = st.clone();
    let req2 = req.clone();
    // Rendering and tokenizing run a few at a time: many large prompts at once would each hold
    // their tokenizer's working memory.
    let _permit = st.tokenize_permits.acquire().await.map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    let rendered = tokio::task::spawn_blocking(move || {
        catch_unwind(AssertUnwindSafe(|| {
            let all = std::iter::once(&req2.prompt).chain(&req2.extra_prompts).map(|p| tokenize_prompt(&st2, &req2, p, true)).collect::<Result<Vec<_>, _>>()?;
            Ok::<_, ApiError>((all, constraint_for(&st2, &req2)?))
        }))
    })
    .await
    .map_err(|_| ApiError::internal())?
    .map_err(|_| ApiError::invalid("cannot render this request (internal template error)"))?;
    let (rendered, constraint) = rendered?;
    let starts_in_reasoning = rendered.first().is_some_and(|r| r.2);
    // The constraint applies to the answer: after the reasoning when the prompt opens it.
    let constraint = constraint.map(|m| Constraint::new(m, !starts_in_reasoning));
    let param = if ep == Endpoint::Chat { "messages" } else { "prompt" };
    let max_seq = st.max_seq;
    let mut prompts = Vec::with_capacity(rendered.len());
    for (tokens, text, _) in rendered {
        if tokens.is_empty() {
            return Err(ApiError::param(param, "the prompt is empty after tokenization"));
        }
        if tokens.len() >= max_seq {
            return Err(ApiError::param(param, format!("the prompt has {} tokens but the server's max-seq is {max_seq} (at least one token must remain for the reply)", tokens.len())).with_code("context_length_exceeded"));
        }
        let max_tokens = match req.max_tokens {
            Some(m) => {
                if tokens.len().checked_add(m).map(|t| t > max_seq).unwrap_or(true) {
                    return Err(ApiError::param("max_tokens", format!("the prompt ({} tokens) + max_tokens ({m}) exceeds the server's max-seq of {max_seq}", tokens.len())).with_code("context_length_exceeded"));
                }
                m
            }
            None => max_seq - tokens.len(),
        };
        prompts.push(PreparedPrompt { tokens, text, max_tokens });
    }
    Ok(Prepared { req, prompts, starts_in_reasoning, constraint })
}

/// The compiled grammar of the request's structured output, if it asks for one (compiling is
/// CPU work, done here beside tokenizing, off the model thread).
fn constraint_for(st: &AppState, req: &ParsedRequest) -> Result<Option<llguidance::Matcher>, ApiError> {
    let Some(structure) = &req.structure else { return Ok(None) };
    let param = match structure {
        Structure::Tools(_) => "tool_choice",
        Structure::Format(_) => "response_format",
    };
    st.grammars.matcher(structure).map(Some).map_err(|e| ApiError::param(param, format!("cannot use this output format: {e}")))
}

/// Queues a prepared request: one job per prompt, each forking its `n` choices after its
/// prefill. Their events arrive on the returned receiver, which closes once every job is done
/// with it; dropping it (the client left) cancels them.
pub(super) fn enqueue(st: &AppState, p: Prepared, arrived: Instant, path: &'static str) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let n = p.req.n;
    let jobs: Vec<Job> = p
        .prompts
        .into_iter()
        .enumerate()
        .map(|(k, q)| Job {
            req: p.req.clone(),
            prompt: q.tokens,
            max_tokens: q.max_tokens,
            starts_in_reasoning: p.starts_in_reasoning,
            constraint: p.constraint.clone(),
            events: tx.clone(),
            arrived,
            path,
            index: k * n,
            n,
        })
        .collect();
    drop(tx);
    for job in jobs {
        st.metrics.queue_depth.fetch_add(1, Relaxed);
        if let Err(e) = st.queue.try_send(job) {
            st.metrics.queue_depth.fetch_sub(1, Relaxed);
            // Jobs already queued see the client gone (the receiver is dropped with the
            // response) and end unserved.
            return Err(match e {
                mpsc::error::TrySendError::Full(_) => ApiError::queue_full(st.max_queue),
                mpsc::error::TrySendError::Closed(_) => ApiError::unavailable("the model worker has stopped"),
            });
        }
    }
    Ok(rx)
}

/// Answers a generation request that failed before it was queued: counted, logged, and the
/// error object returned.
pub(super) fn refuse(st: &AppState, path: &'static str, arrived: Instant, e: ApiError) -> Response {
    st.metrics.count_request(endpoint_label(path), e.status.as_u16());
    st.metrics.record(RequestRecord { method: "POST", path, status: e.status.as_u16(), ms: arrived.elapsed().as_millis() as u64, prompt: 0, cached: 0, completion: 0, tok_s: 0.0, finish: String::new(), error: Some(e.message.clone()), queue_ms: None, ttft_ms: None, resume_ms: None, prefill_ms: None });
    e.into_response()
}

/// A generation request that arrives while the server drains: refused, to be retried elsewhere.
pub(super) fn draining(st: &AppState) -> Option<ApiError> {
    st.metrics.draining.load(Relaxed).then(|| ApiError::unavailable("the server is shutting down; retry on another replica"))
}

async fn handle(st: Arc<AppState>, ep: Endpoint, body: Result<Bytes, BytesRejection>) -> Response {
    let arrived = Instant::now();
    let (label, path) = match ep {
        Endpoint::Chat => ("chat_completions", "/v1/chat/completions"),
        Endpoint::Completion => ("completions", "/v1/completions"),
    };
    let fail = |e: ApiError| refuse(&st, path, arrived, e);
    if let Some(e) = draining(&st) {
        return fail(e);
    }
    let p = match prepare(&st, ep, body).await {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let stream = p.req.stream;
    let include_usage = p.req.include_usage;
    let want_logprobs = p.req.logprobs;
    let n = p.req.n;
    // Choice `i` answers prompt `i / n`; each prompt's job forks its n choices after its prefill.
    let choices = p.prompts.len() * n;
    let echoes: Vec<Option<String>> = p.prompts.iter().map(|q| p.req.echo.then(|| q.text.clone())).collect();
    let echo_of = move |i: usize| echoes[i / n].clone();
    let rx = match enqueue(&st, p, arrived, path) {
        Ok(rx) => rx,
        Err(e) => return fail(e),
    };
    let serial = st.counter.fetch_add(1, Relaxed) + 1;
    let created = now_secs();
    let id = match ep {
        Endpoint::Chat => format!("chatcmpl-{created}-{serial}"),
        Endpoint::Completion => format!("cmpl-{created}-{serial}"),
    };
    let model = st.model_id.clone();
    let chat = ep == Endpoint::Chat;

    if stream {
        st.metrics.count_request(label, 200);
        let mut b = ChunkBuilder::new(id, created, model, chat, include_usage, st.reasoning_field, choices);
        let mut first: Vec<Value> = Vec::new();
        for i in 0..choices {
            if chat {
                first.push(b.role(i));
            } else if let Some(e) = echo_of(i).filter(|_| !want_logprobs) {
                // The echoed prompt's chunk: at once, or with its logprobs once the worker has them.
                first.push(b.echo(i, &e, Value::Null));
            }
        }
        let head = futures::stream::iter(first.into_iter().map(|v| Ok::<_, Infallible>(SseEvent::default().data(v.to_string()))));
        let mut usage = Usage::default();
        let mut done = 0;
        let body = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
            let mut out: Vec<Result<SseEvent, Infallible>> = Vec::new();
            let mut send = |v: Value| out.push(Ok(SseEvent::default().data(v.to_string())));
            match ev {
                Event::PromptLogprobs { index, entries } => {
                    for i in index..index + n {
                        let e = echo_of(i).unwrap_or_default();
                        send(b.echo(i, &e, completion_logprobs(&entries, 0)));
                    }
                }
                Event::Delta { index, delta, logprobs } => {
                    if let Some(v) = b.delta(index, &delta, &logprobs, want_logprobs) {
                        send(v);
                    }
                }
                Event::Done { index, finish_reason, usage: u } => {
                    send(b.finish(index, finish_reason));
                    usage.add(&u);
                    done += 1;
                    if include_usage && done == choices {
                        send(b.usage(&usage));
                    }
                }
                Event::Error(e) => send(e.body()),
            }
            futures::stream::iter(out)
        });
        let done = futures::stream::once(async { Ok::<_, Infallible>(SseEvent::default().data("[DONE]")) });
        return Sse::new(head.chain(body).chain(done)).keep_alive(KeepAlive::default()).into_response();
    }

    // Non-streaming: collect. Dropping this future (client gone) drops `rx`, which cancels.
    let mut rx = rx;
    let mut acc: Vec<Collected> = (0..choices).map(|_| Collected::default()).collect();
    let mut finish: Vec<&'static str> = vec![""; choices];
    let mut usage = Usage::default();
    let mut done = 0;
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::PromptLogprobs { index, entries } => {
                for a in &mut acc[index..index + n] {
                    a.prompt_logprobs = entries.clone();
                }
            }
            Event::Delta { index, delta, logprobs } => acc[index].add(delta, logprobs),
            Event::Done { index, finish_reason, usage: u } => {
                finish[index] = finish_reason;
                usage.add(&u);
                done += 1;
                if done < choices {
                    continue;
                }
                let list: Vec<Value> = acc
                    .iter()
                    .enumerate()
                    .map(|(i, a)| if chat { a.chat_choice(i, finish[i], want_logprobs, st.reasoning_field) } else { a.completion_choice(i, finish[i], want_logprobs, echo_of(i).as_deref()) })
                    .collect();
                st.metrics.count_request(label, 200);
                return Json(responses::response(chat, &id, created, &model, list, &usage)).into_response();
            }
            Event::Error(e) => {
                st.metrics.count_request(label, e.status.as_u16());
                return e.into_response();
            }
        }
    }
    st.metrics.count_request(label, 500);
    ApiError::internal().into_response()
}
