//! TEST-ONLY: a backend that "generates" scripted replies, so the HTTP layer can be tested
//! end to end with known model output (tool calls, reasoning, stop strings) although the
//! tiny checkpoint's weights are random. Reached only through the hidden `--test-script FILE`
//! option of `lily serve` and from tests; never used for real serving.
//!
//! The script is a JSON array of rules `{"match": "substring", "reply": "text"}`. On each new
//! prompt the backend decodes the whole sequence, picks the first rule whose `match` occurs in
//! it (a rule without `match` matches everything), tokenizes its reply and then returns logits
//! that make exactly that reply the argmax, token by token, followed by `<|im_end|>`. Prompts
//! matching no rule get the reply "(no script rule matched)".

use crate::backend::{Backend, LogitsWanted, Sequence, SequenceState};
use crate::checkpoint::ModelConfig;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result};
use std::any::Any;
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, Clone, serde::Deserialize)]
pub struct Rule {
    #[serde(default, rename = "match")]
    pub pattern: Option<String>,
    pub reply: String,
}

#[derive(Clone, Default)]
struct ScriptState {
    tokens: Vec<u32>,
    reply: Vec<u32>,
    emitted: usize,
}

impl SequenceState for ScriptState {
    fn try_clone_state(&self, _len: usize) -> anyhow::Result<Box<dyn SequenceState>> {
        Ok(Box::new(self.clone()))
    }
    fn memory_bytes(&self) -> usize {
        (self.tokens.capacity() + self.reply.capacity()) * 4 + 64
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

pub struct ScriptedBackend {
    config: ModelConfig,
    tokenizer: Arc<Tokenizer>,
    rules: Vec<Rule>,
    eos: u32,
}

impl ScriptedBackend {
    pub fn new(config: ModelConfig, tokenizer: Arc<Tokenizer>, rules: Vec<Rule>) -> Self {
        let eos = tokenizer.token_id("<|im_end|>").or_else(|| config.eos_token_ids.first().copied()).unwrap_or(0);
        ScriptedBackend { config, tokenizer, rules, eos }
    }

    pub fn load_rules(path: &Path) -> Result<Vec<Rule>> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read test script {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("test script {} must be a JSON array of {{\"match\", \"reply\"}}", path.display()))
    }

    fn choose(&self, prompt: &[u32]) -> Result<Vec<u32>> {
        let text = self.tokenizer.decode(prompt, false)?;
        let reply = self
            .rules
            .iter()
            .find(|r| r.pattern.as_deref().map(|p| text.contains(p)).unwrap_or(true))
            .map(|r| r.reply.clone())
            .unwrap_or_else(|| "(no script rule matched)".into());
        self.tokenizer.encode(&reply)
    }
}

impl Backend for ScriptedBackend {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn new_sequence(&self, max_seq: usize) -> Result<Sequence> {
        Ok(Sequence::new(max_seq, Box::new(ScriptState::default())))
    }
    fn forward(&mut self, seq: &mut Sequence, tokens: &[u32], wanted: LogitsWanted) -> Result<Vec<f32>> {
        seq.check_room(tokens.len())?;
        let continues = {
            let st = seq.state::<ScriptState>();
            tokens.len() == 1 && st.reply.get(st.emitted) == Some(&tokens[0])
        };
        let next_reply = if continues { None } else {
            let mut all = seq.state::<ScriptState>().tokens.clone();
            all.extend_from_slice(tokens);
            Some(self.choose(&all)?)
        };
        let st = seq.state_mut::<ScriptState>();
        st.tokens.extend_from_slice(tokens);
        match next_reply {
            Some(r) => {
                st.reply = r;
                st.emitted = 0;
            }
            None => st.emitted += 1,
        }
        let next = st.reply.get(st.emitted).copied().unwrap_or(self.eos);
        seq.advance(tokens.len());
        let row = |next: u32| {
            let mut l = vec![0.0f32; self.config.vocab_size];
            if let Some(x) = l.get_mut(next as usize) {
                *x = 40.0;
            }
            l
        };
        Ok(match wanted {
            LogitsWanted::None => vec![],
            LogitsWanted::Last => row(next),
            LogitsWanted::All => {
                let mut v = Vec::new();
                for _ in 0..tokens.len() {
                    v.extend(row(next));
                }
                v
            }
        })
    }
}
