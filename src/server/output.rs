//! The per-request text pipeline: detokenized text → stop strings → reasoning split → tool
//! calls. Stop strings apply to the raw generated text, so they never leak into either the
//! reasoning or the content.

use super::reasoning::ReasoningSplitter;
use super::stop::StopMatcher;
use super::tools::{ToolEvent, ToolParser};
use serde_json::{Map, Value};

/// What one step released.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolEvent>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }
    pub fn append(&mut self, other: Delta) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.tool_calls.extend(other.tool_calls);
    }
}

pub struct OutputPipeline {
    stop: StopMatcher,
    reasoning: Option<ReasoningSplitter>,
    tools: Option<ToolParser>,
}

impl OutputPipeline {
    /// `reasoning`: `Some(starts_in_reasoning)` to split reasoning (chat), `None` for raw text.
    /// `tools`: schemas by function name when tool calls are parsed.
    pub fn new(stop: Vec<String>, reasoning: Option<bool>, tools: Option<Map<String, Value>>) -> Self {
        OutputPipeline { stop: StopMatcher::new(stop), reasoning: reasoning.map(ReasoningSplitter::new), tools: tools.map(ToolParser::new) }
    }

    pub fn in_reasoning(&self) -> bool {
        self.reasoning.as_ref().map(|r| r.in_reasoning()).unwrap_or(false)
    }

    /// Complete tool calls so far (a call cut by the end of generation does not count).
    pub fn tool_calls(&self) -> usize {
        self.tools.as_ref().map(|t| t.complete_calls()).unwrap_or(0)
    }

    /// Whether generation ended inside a tool call (its arguments stay partial).
    pub fn tool_call_cut(&self) -> bool {
        self.tools.as_ref().is_some_and(|t| t.cut())
    }

    /// Pushes newly decoded text; returns the released delta and whether a stop string matched.
    pub fn push(&mut self, text: &str) -> (Delta, bool) {
        let (released, hit) = self.stop.push(text);
        let mut d = self.route(&released, false);
        if hit {
            d.append(self.finish_inner());
        }
        (d, hit)
    }

    fn route(&mut self, text: &str, _final: bool) -> Delta {
        let mut d = Delta::default();
        let split = match &mut self.reasoning {
            Some(r) => r.push(text),
            None => super::reasoning::Split { reasoning: String::new(), content: text.to_string() },
        };
        d.reasoning = split.reasoning;
        self.content(&split.content, &mut d);
        d
    }

    fn content(&mut self, text: &str, d: &mut Delta) {
        if text.is_empty() {
            return;
        }
        match &mut self.tools {
            Some(t) => {
                for e in t.push(text) {
                    match e {
                        ToolEvent::Content(c) => d.content.push_str(&c),
                        other => d.tool_calls.push(other),
                    }
                }
            }
            None => d.content.push_str(text),
        }
    }

    fn finish_inner(&mut self) -> Delta {
        let mut d = Delta::default();
        if let Some(r) = &mut self.reasoning {
            let s = r.finish();
            d.reasoning = s.reasoning;
            self.content(&s.content, &mut d);
        }
        if let Some(t) = &mut self.tools {
            for e in t.finish() {
                match e {
                    ToolEvent::Content(c) => d.content.push_str(&c),
                    other => d.tool_calls.push(other),
                }
            }
        }
        d
    }

    /// End of generation: flushes everything held back.
    pub fn finish(&mut self, tail: &str) -> Delta {
        if self.stop.matched() {
            return Delta::default();
        }
        let (mut d, hit) = self.push(tail);
        if hit {
            return d;
        }
        let rest = self.stop.finish();
        d.append(self.route(&rest, true));
        d.append(self.finish_inner());
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p: &mut OutputPipeline, pieces: &[&str]) -> (Delta, bool) {
        let mut all = Delta::default();
        for s in pieces {
            let (d, hit) = p.push(s);
            all.append(d);
            if hit {
                return (all, true);
            }
        }
        all.append(p.finish(""));
        (all, false)
    }

    #[test]
    fn stop_string_inside_reasoning_and_content() {
        let mut p = OutputPipeline::new(vec!["STOP".into()], Some(true), None);
        let (d, hit) = run(&mut p, &["abc", "</think>\n\nhello S", "TO", "P tail"]);
        assert!(hit);
        assert_eq!(d.reasoning, "abc");
        assert_eq!(d.content, "hello ");
        let mut p = OutputPipeline::new(vec!["</think>".into()], Some(true), None);
        let (d, hit) = run(&mut p, &["abc</th", "ink>rest"]);
        assert!(hit);
        assert_eq!((d.reasoning.as_str(), d.content.as_str()), ("abc", ""));
    }

    #[test]
    fn reasoning_then_tool_call() {
        let mut p = OutputPipeline::new(vec![], Some(true), Some(Map::new()));
        let (d, _) = run(&mut p, &["need weather</think>\n\n", "<tool_call>\n<function=w>\n<parameter=c>\nParis\n</parameter>\n</function>\n</tool_call>"]);
        assert_eq!(d.reasoning, "need weather");
        assert_eq!(d.content, "");
        assert_eq!(p.tool_calls(), 1);
        assert_eq!(d.tool_calls.len(), 3);
    }
}
