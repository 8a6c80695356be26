//! Stop strings over a text stream: text is released only once it cannot be the start of a
//! stop string, so a stop string split across tokens never leaks.

#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    done: bool,
}

/// Largest char boundary of `s` that is `<= i`.
pub fn floor_boundary(s: &str, mut i: usize) -> usize {
    if i >= s.len() {
        return s.len();
    }
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Length of the longest suffix of `text` that is a proper prefix of `pat` (on char boundaries).
pub fn partial_suffix(text: &str, pat: &str) -> usize {
    let max = pat.len().saturating_sub(1).min(text.len());
    for n in (1..=max).rev() {
        let start = text.len() - n;
        if text.is_char_boundary(start) && pat.as_bytes().starts_with(&text.as_bytes()[start..]) {
            return n;
        }
    }
    0
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), pending: String::new(), done: false }
    }

    /// True once a stop string matched.
    pub fn matched(&self) -> bool {
        self.done
    }

    /// Adds text; returns what can be released and whether a stop string matched (then
    /// everything from the match on is dropped and later pushes return nothing).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.done {
            return (String::new(), true);
        }
        if self.stops.is_empty() {
            return (text.to_string(), false);
        }
        self.pending.push_str(text);
        let first = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min();
        if let Some(i) = first {
            let out = self.pending[..i].to_string();
            self.pending.clear();
            self.done = true;
            return (out, true);
        }
        let hold = self.stops.iter().map(|s| partial_suffix(&self.pending, s)).max().unwrap_or(0);
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// End of generation: releases any held-back text.
    pub fn finish(&mut self) -> String {
        if self.done {
            return String::new();
        }
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (o, hit) = m.push(p);
            out.push_str(&o);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn split_across_pieces() {
        assert_eq!(run(&["STOP"], &["abc S", "T", "OP more"]), ("abc ".into(), true));
        assert_eq!(run(&["STOP"], &["abc S", "T", "x"]), ("abc STx".into(), false));
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
        assert_eq!(run(&["xyz", "y"], &["axyz"]), ("a".into(), true));
        assert_eq!(run(&["yz", "xyq"], &["axyz"]), ("ax".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn holds_back_only_partial_matches() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hello E"), ("hello ".into(), false));
        assert_eq!(m.push("N"), ("".into(), false));
        assert_eq!(m.push("d"), ("ENd".into(), false));
        assert_eq!(m.finish(), "");
    }
}
