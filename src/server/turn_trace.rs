//! One line per turn of the model worker's loop (`lily serve --trace-turns`): what each phase
//! took and moved, so a load test's server log shows how the scheduler cut the work (prefill
//! turns, the decode steps between them, snapshots) where the worker phase totals only add it up.

use std::time::Duration;

/// What one turn of the worker did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Turn {
    /// Seconds since the worker started serving, at the turn's start.
    pub at: f64,
    pub admitted: usize,
    pub admit: Duration,
    /// Prompt tokens fed and the rows whose prompts went in (they decode from the next step).
    pub prompt_tokens: usize,
    pub prompts_in: usize,
    /// The prefill phase, its snapshots included, and the snapshots' part.
    pub prefill: Duration,
    pub snapshots: Duration,
    /// Rows that decoded, tokens they generated, and the decode phase.
    pub decode_rows: usize,
    pub generated: u64,
    pub decode: Duration,
    pub retired: usize,
}

impl Turn {
    /// The turn as one log line; phases that did nothing are left out.
    pub fn line(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut parts = vec![format!("turn +{:.3}s", self.at)];
        if self.admitted > 0 {
            parts.push(format!("admit {} in {:.1} ms", self.admitted, ms(self.admit)));
        }
        if self.prompt_tokens > 0 || self.prompts_in > 0 {
            parts.push(format!(
                "prefill {} tokens, {} prompts in, {:.1} ms (snapshots {:.1})",
                self.prompt_tokens,
                self.prompts_in,
                ms(self.prefill),
                ms(self.snapshots)
            ));
        }
        if self.decode_rows > 0 {
            parts.push(format!("decode {} rows, {} tokens in {:.1} ms", self.decode_rows, self.generated, ms(self.decode)));
        }
        if self.retired > 0 {
            parts.push(format!("retired {}", self.retired));
        }
        format!("lily: {}", parts.join(" | "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_line_names_what_the_turn_did_and_leaves_out_idle_phases() {
        let t = Turn {
            at: 1.25,
            prompt_tokens: 7689,
            prompts_in: 11,
            prefill: Duration::from_micros(160_200),
            snapshots: Duration::from_micros(3_100),
            decode_rows: 11,
            generated: 11,
            decode: Duration::from_micros(8_260),
            ..Turn::default()
        };
        assert_eq!(t.line(), "lily: turn +1.250s | prefill 7689 tokens, 11 prompts in, 160.2 ms (snapshots 3.1) | decode 11 rows, 11 tokens in 8.3 ms");
        let quiet = Turn { at: 2.0, admitted: 2, admit: Duration::from_micros(400), retired: 1, ..Turn::default() };
        assert_eq!(quiet.line(), "lily: turn +2.000s | admit 2 in 0.4 ms | retired 1");
    }
}
