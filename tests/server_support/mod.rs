//! Shared fixtures of the server tests: the tiny synthetic checkpoint (tests/common), servers on
//! ephemeral loopback ports, and an SSE reader.

#![allow(dead_code)]

use lily::server::{ServeArgs, ServerHandle};
use lily::tokenizer::Tokenizer;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

pub use crate::common::tiny_checkpoint;
use crate::common::scratch;

/// The tiny checkpoint's tokenizer, loaded once per test binary (~2 s of CPU each time).
pub fn tiny_tokenizer() -> Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| Arc::new(Tokenizer::load(tiny_checkpoint()).expect("load the tiny tokenizer"))).clone()
}

/// The tiny tokenizer when `args` serves the tiny checkpoint.
fn shared_tokenizer(args: &ServeArgs) -> Option<Arc<Tokenizer>> {
    (args.model.as_deref() == Some(tiny_checkpoint())).then(tiny_tokenizer)
}

/// `lily::server::spawn`; servers of the tiny checkpoint share its tokenizer.
pub fn spawn(args: ServeArgs) -> anyhow::Result<ServerHandle> {
    match shared_tokenizer(&args) {
        Some(t) => lily::server::spawn_with_tokenizer(args, t),
        None => lily::server::spawn(args),
    }
}

/// `lily::server::spawn_with_backend`, sharing the tiny tokenizer as [`spawn`] does.
pub fn spawn_with_backend(args: ServeArgs, backend: Box<dyn lily::backend::Backend>) -> anyhow::Result<ServerHandle> {
    let t = shared_tokenizer(&args);
    lily::server::spawn_with_backend(args, t, backend)
}

pub fn args() -> ServeArgs {
    let mut a = ServeArgs::for_model(Some(tiny_checkpoint().to_path_buf()));
    a.bind = "127.0.0.1:0".into();
    a.max_seq = 1024;
    a
}

/// A server running the tiny model on the CPU backend.
pub fn tiny_server() -> &'static ServerHandle {
    static S: OnceLock<ServerHandle> = OnceLock::new();
    S.get_or_init(|| spawn(args()).expect("start server"))
}

/// The rules of the scripted (test-only) backend used for deterministic output.
pub const SCRIPT: &str = r#"[
  {"match": "cut call", "reply": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3"},
  {"match": "weather", "reply": "The user wants weather.</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"},
  {"match": "two calls", "reply": "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n<parameter=y>\n{\"k\": [1, 2]}\n</parameter>\n</function>\n</tool_call>"},
  {"match": "stop test", "reply": "Counting: one, two, STOP three, four"},
  {"match": "unicode", "reply": "Héllo wörld 你好 🎉 done"},
  {"match": "what is 2+2", "reply": "Two plus two is four.</think>\n\nThe answer is 4."},
  {"reply": "Hello there! I am a scripted reply."}
]"#;

pub fn script_path() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let p = scratch::scratch_dir().join("script.json");
        std::fs::write(&p, SCRIPT).unwrap();
        p
    })
    .clone()
}

/// A server whose "model" replies from [`SCRIPT`].
pub fn scripted_server() -> &'static ServerHandle {
    static S: OnceLock<ServerHandle> = OnceLock::new();
    S.get_or_init(|| {
        let mut a = args();
        a.test_script = Some(script_path());
        spawn(a).expect("start scripted server")
    })
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().build().unwrap()
}

/// POSTs `body` as JSON: the status and the reply as JSON (as a JSON string when it is not JSON).
pub async fn post(url: &str, body: Value) -> (u16, Value) {
    let r = client().post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

pub fn user(text: &str) -> Value {
    serde_json::json!([{"role": "user", "content": text}])
}

/// Reads a whole SSE response: the `data:` payloads, in order.
pub async fn sse_events(resp: reqwest::Response) -> Vec<String> {
    let text = resp.text().await.unwrap();
    text.split("\n\n").filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:"))).map(str::to_string)).collect()
}

pub fn rss_bytes() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok()).unwrap_or(0) * 1024
}

/// The tiny model on the CPU with `around(inner, seq, tokens, wanted)` in place of its forward:
/// tests that need the model to say something (end of sequence, `</think>`, ...), to fail on
/// some input, or to take its time. Every other backend call is the CPU backend's default.
pub struct Around<F> {
    inner: Box<dyn lily::backend::Backend>,
    around: F,
}

/// What [`Around`] runs for a forward: the inner backend, then the forward's arguments.
pub trait Forward: FnMut(&mut dyn lily::backend::Backend, &mut lily::backend::Sequence, &[u32], lily::backend::LogitsWanted) -> anyhow::Result<Vec<f32>> + Send {}
impl<F: FnMut(&mut dyn lily::backend::Backend, &mut lily::backend::Sequence, &[u32], lily::backend::LogitsWanted) -> anyhow::Result<Vec<f32>> + Send> Forward for F {}

impl<F: Forward> lily::backend::Backend for Around<F> {
    fn name(&self) -> &'static str {
        "around"
    }
    fn config(&self) -> &lily::checkpoint::ModelConfig {
        self.inner.config()
    }
    fn new_sequence(&self, max_seq: usize) -> anyhow::Result<lily::backend::Sequence> {
        self.inner.new_sequence(max_seq)
    }
    fn forward(&mut self, seq: &mut lily::backend::Sequence, tokens: &[u32], w: lily::backend::LogitsWanted) -> anyhow::Result<Vec<f32>> {
        (self.around)(self.inner.as_mut(), seq, tokens, w)
    }
}

/// A server on the tiny model whose forwards `around` runs (see [`Around`]).
pub fn around_server<F: Forward + 'static>(around: F) -> ServerHandle {
    around_server_with(args(), around)
}

/// [`around_server`] with other serve arguments.
pub fn around_server_with<F: Forward + 'static>(args: lily::server::ServeArgs, around: F) -> ServerHandle {
    let ck = lily::checkpoint::Checkpoint::open(tiny_checkpoint()).unwrap();
    let inner: Box<dyn lily::backend::Backend> = Box::new(lily::backend::cpu::CpuBackend::new(&ck).unwrap());
    spawn_with_backend(args, Box::new(Around { inner, around })).unwrap()
}

/// A server on the tiny model whose logits `steer(wanted, logits, vocab)` edits after every
/// forward.
pub fn steered_server<F: FnMut(lily::backend::LogitsWanted, &mut [f32], usize) + Send + 'static>(mut steer: F) -> ServerHandle {
    around_server(move |b: &mut dyn lily::backend::Backend, seq: &mut lily::backend::Sequence, tokens: &[u32], w| {
        let mut out = b.forward(seq, tokens, w)?;
        let vocab = b.config().vocab_size;
        steer(w, &mut out, vocab);
        Ok(out)
    })
}
