//! `lily serve --tui`: a live dashboard (ratatui + crossterm) on its own thread, off the
//! serving path: it only reads the shared [`Metrics`] every 250 ms.
//!
//! Panels: server line; totals (requests by status, running batch, queue depth, tokens, cache
//! hit ratio, memory); a tokens/s sparkline; the recent requests, newest first. `q`, `Esc` or `Ctrl-C`
//! stops the server.

use super::metrics::Metrics;
use anyhow::Result;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Style, Stylize};
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph, Row, Sparkline, Table};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

pub struct DashInfo {
    pub model: String,
    pub url: String,
    pub max_seq: usize,
    pub backend: String,
    pub max_queue: usize,
}

pub struct TuiHandle {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl TuiHandle {
    pub fn stop(self) {
        self.stop.store(true, Relaxed);
        let _ = self.thread.join();
    }
}

fn mb(b: u64) -> String {
    format!("{:.1} MB", b as f64 / 1e6)
}

/// Starts the dashboard; `quit` fires when the user asks to stop.
pub fn spawn(info: DashInfo, metrics: Arc<Metrics>, quit: oneshot::Sender<()>) -> Result<TuiHandle> {
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let thread = std::thread::Builder::new().name("lily-tui".into()).spawn(move || {
        let prev_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |p| {
            ratatui::restore();
            prev_hook(p);
        }));
        let mut terminal = ratatui::init();
        let mut quit = Some(quit);
        let mut history: VecDeque<u64> = VecDeque::new();
        let mut last_tokens = metrics.generated_tokens.load(Relaxed);
        let mut last_t = Instant::now();
        let mut rate = 0.0f64;
        while !stop.load(Relaxed) {
            if last_t.elapsed() >= Duration::from_millis(1000) {
                let now = metrics.generated_tokens.load(Relaxed);
                rate = (now - last_tokens) as f64 / last_t.elapsed().as_secs_f64();
                last_tokens = now;
                last_t = Instant::now();
                history.push_back(rate.round() as u64);
                if history.len() > 300 {
                    history.pop_front();
                }
            }
            let _ = terminal.draw(|f| {
                let [top, totals, spark, table] = Layout::vertical([Constraint::Length(3), Constraint::Length(6), Constraint::Length(6), Constraint::Min(5)]).areas(f.area());
                let up = metrics.started.elapsed().as_secs();
                let running = metrics.running.load(Relaxed);
                let status = if running > 0 { "generating".green() } else { "idle".gray() };
                let head = Line::from(vec![
                    format!("lily  {}  {}  backend {}  max-seq {}  uptime {}:{:02}:{:02}  ", info.model, info.url, info.backend, info.max_seq, up / 3600, up / 60 % 60, up % 60).into(),
                    status,
                    "   q / Esc / Ctrl-C to quit".dark_gray(),
                ]);
                f.render_widget(Paragraph::new(head).block(Block::bordered().title(" server ")), top);

                let by = metrics.requests_by_status();
                let (mut ok, mut c4, mut c5) = (0u64, 0u64, 0u64);
                for ((ep, st), n) in &by {
                    if *ep == "metrics" || *ep == "health" {
                        continue;
                    }
                    match st {
                        200..=299 => ok += n,
                        400..=499 => c4 += n,
                        _ => c5 += n,
                    }
                }
                let lines = vec![
                    Line::from(format!(
                        "requests ok {ok}   4xx {c4}   5xx {c5}   cancelled {}   running {}   batch {}/{}   queue {}/{}",
                        metrics.cancelled.load(Relaxed),
                        running,
                        metrics.batch_size.load(Relaxed),
                        metrics.max_batch.load(Relaxed),
                        metrics.queue_depth.load(Relaxed).max(0),
                        info.max_queue
                    )),
                    Line::from(format!(
                        "tokens   prompt {}   cached {} ({:.1}%)   completion {}",
                        metrics.prompt_tokens.load(Relaxed),
                        metrics.cached_tokens.load(Relaxed),
                        metrics.cache_hit_ratio() * 100.0,
                        metrics.completion_tokens.load(Relaxed)
                    )),
                    Line::from(format!(
                        "prefix cache {} entries, {}   hits {}/{} lookups   running sequences KV+state {}",
                        metrics.cache_entries.load(Relaxed),
                        mb(metrics.cache_bytes.load(Relaxed)),
                        metrics.cache_hits.load(Relaxed),
                        metrics.cache_lookups.load(Relaxed),
                        mb(metrics.active_seq_bytes.load(Relaxed))
                    )),
                    Line::from(format!("time to first token: {} samples   inter-token: {} samples", metrics.ttft.count(), metrics.itl.count())),
                ];
                f.render_widget(Paragraph::new(lines).block(Block::bordered().title(" totals ")), totals);

                let data: Vec<u64> = history.iter().copied().collect();
                let w = spark.width.saturating_sub(2) as usize;
                let shown = &data[data.len().saturating_sub(w)..];
                f.render_widget(
                    Sparkline::default().block(Block::bordered().title(format!(" generated tokens/s: {rate:.1} "))).data(shown).style(Style::default().fg(Color::Cyan)),
                    spark,
                );

                let recent = metrics.recent.lock().map(|q| q.iter().rev().cloned().collect::<Vec<_>>()).unwrap_or_default();
                let rows = recent.iter().map(|r| {
                    let st = Style::default().fg(match r.status {
                        200..=299 => Color::Green,
                        400..=499 => Color::Yellow,
                        _ => Color::Red,
                    });
                    Row::new(vec![
                        r.path.to_string(),
                        r.status.to_string(),
                        r.ms.to_string(),
                        r.prompt.to_string(),
                        r.cached.to_string(),
                        r.completion.to_string(),
                        format!("{:.1}", r.tok_s),
                        r.finish.clone(),
                        r.error.clone().unwrap_or_default(),
                    ])
                    .style(st)
                });
                let widths = [Constraint::Length(22), Constraint::Length(6), Constraint::Length(8), Constraint::Length(7), Constraint::Length(7), Constraint::Length(7), Constraint::Length(8), Constraint::Length(10), Constraint::Min(10)];
                let t = Table::new(rows, widths)
                    .header(Row::new(vec!["path", "status", "ms", "prompt", "cached", "compl", "tok/s", "finish", "error"]).bold())
                    .block(Block::bordered().title(" recent requests, newest first "));
                f.render_widget(t, table);
            });
            if event::poll(Duration::from_millis(250)).unwrap_or(false) {
                if let Ok(Event::Key(k)) = event::read() {
                    let ctrl_c = k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if k.kind == KeyEventKind::Press && (ctrl_c || k.code == KeyCode::Char('q') || k.code == KeyCode::Esc) {
                        if let Some(q) = quit.take() {
                            let _ = q.send(());
                        }
                        break;
                    }
                }
            }
        }
        ratatui::restore();
        metrics.log_lines.store(true, Relaxed);
    })?;
    Ok(TuiHandle { stop: stop2, thread })
}
