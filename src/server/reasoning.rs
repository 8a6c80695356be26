//! Splits generated text into reasoning and content at `</think>`.
//!
//! The starting state comes from the rendered prompt's tail: when the chat template opened
//! `<think>` (thinking on), the output starts inside the reasoning and has no opening tag. A
//! generation cut before `</think>` is all reasoning. Without an opened block, an output that
//! itself starts with `<think>` is also understood.

use super::stop::partial_suffix;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// At the start of content: an opening `<think>` may still come.
    Detect,
    Reasoning,
    Content,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    state: State,
    buf: String,
    /// Drop the newlines that follow `</think>` (the template writes them back).
    strip_leading: bool,
}

/// Whether a rendered prompt leaves the model inside an open `<think>` block.
pub fn prompt_opens_thinking(prompt: &str) -> bool {
    let t = prompt.trim_end_matches(['\n', ' ']);
    t.ends_with(OPEN)
}

impl ReasoningSplitter {
    pub fn new(starts_in_reasoning: bool) -> Self {
        ReasoningSplitter { state: if starts_in_reasoning { State::Reasoning } else { State::Detect }, buf: String::new(), strip_leading: false }
    }

    /// Content-only splitter (no reasoning detection at all).
    pub fn content_only() -> Self {
        ReasoningSplitter { state: State::Content, buf: String::new(), strip_leading: false }
    }

    /// True while the output is (or may still be) inside the reasoning block.
    pub fn in_reasoning(&self) -> bool {
        self.state == State::Reasoning
    }

    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        self.buf.push_str(text);
        loop {
            match self.state {
                State::Detect => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.buf = rest.trim_start_matches('\n').to_string();
                        self.state = State::Reasoning;
                        continue;
                    }
                    if t.is_empty() || OPEN.starts_with(t) {
                        return out; // wait for more
                    }
                    self.state = State::Content;
                }
                State::Reasoning => {
                    if let Some(i) = self.buf.find(CLOSE) {
                        out.reasoning.push_str(&self.buf[..i]);
                        self.buf = self.buf[i + CLOSE.len()..].to_string();
                        self.state = State::Content;
                        self.strip_leading = true;
                        continue;
                    }
                    let hold = partial_suffix(&self.buf, CLOSE);
                    let cut = self.buf.len() - hold;
                    out.reasoning.push_str(&self.buf[..cut]);
                    self.buf.drain(..cut);
                    return out;
                }
                State::Content => {
                    if self.strip_leading {
                        let t = self.buf.trim_start_matches(['\n', '\r']);
                        if t.is_empty() {
                            self.buf.clear();
                            return out;
                        }
                        self.buf = t.to_string();
                        self.strip_leading = false;
                    }
                    out.content.push_str(&self.buf);
                    self.buf.clear();
                    return out;
                }
            }
        }
    }

    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Reasoning => out.reasoning = rest,
            State::Detect | State::Content => {
                if !(self.strip_leading && rest.trim().is_empty()) {
                    out.content = rest;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(start: bool, pieces: &[&str]) -> Split {
        let mut s = ReasoningSplitter::new(start);
        let mut all = Split::default();
        for p in pieces {
            let o = s.push(p);
            all.reasoning += &o.reasoning;
            all.content += &o.content;
        }
        let o = s.finish();
        all.reasoning += &o.reasoning;
        all.content += &o.content;
        all
    }

    #[test]
    fn splits_at_close_tag_across_pieces() {
        let s = run(true, &["I think", " hard</th", "ink>\n\nThe answer", " is 4."]);
        assert_eq!(s.reasoning, "I think hard");
        assert_eq!(s.content, "The answer is 4.");
    }

    #[test]
    fn truncated_reasoning_is_all_reasoning() {
        assert_eq!(run(true, &["still", " thinking </thi"]), Split { reasoning: "still thinking </thi".into(), content: String::new() });
    }

    #[test]
    fn no_thinking_prompt() {
        assert_eq!(run(false, &["Hello", " world"]).content, "Hello world");
        let s = run(false, &["<thi", "nk>\nhmm</think>\n\nok"]);
        assert_eq!((s.reasoning.as_str(), s.content.as_str()), ("hmm", "ok"));
        assert!(prompt_opens_thinking("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    }
}
