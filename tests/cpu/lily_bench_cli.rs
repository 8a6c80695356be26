//! lily-bench on the CPU backend: one JSON line with the contract's fields, and a clear error
//! (exit 1, no panic) for a --max-seq that cannot hold the run or bad sampling flags; sampled runs
//! report their settings and repeat with the seed.

use crate::common::tiny_checkpoint;
use std::process::Command;

fn bench(extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lily-bench"))
        .args(["--model", tiny_checkpoint().to_str().unwrap(), "--backend", "cpu", "--prompt-len", "8", "--decode-steps", "4"])
        .args(extra)
        .output()
        .expect("run lily-bench")
}

/// The JSON line of a run that must succeed.
fn json_line(extra: &[&str]) -> serde_json::Value {
    let out = bench(extra);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON line")
}

/// The stderr of a run that must fail with exit 1, no panic and no JSON line.
fn one_line_error(out: std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked") && out.stdout.is_empty(), "{err}");
    err
}

#[test]
fn json_line_reports_max_seq_and_no_device_memory_on_cpu() {
    let line = json_line(&["--max-seq", "64"]);
    assert_eq!(line["max_seq"], 64);
    assert_eq!(line["prompt_len"], 8);
    assert_eq!(line["decode"]["token_ids"].as_array().unwrap().len(), 4);
    assert!(line["device_memory"].is_null());
    assert_eq!(line["kv_cache"], "f32");
}

#[test]
fn kv_cache_flag_is_reported() {
    let line = json_line(&["--kv-cache", "bf16"]);
    assert_eq!(line["kv_cache"], "bf16");
    assert_eq!(line["decode"]["token_ids"].as_array().unwrap().len(), 4);
}

#[test]
fn too_small_max_seq_is_a_one_line_error() {
    let err = one_line_error(bench(&["--max-seq", "6"]));
    assert!(err.contains("--max-seq 6 is smaller than prompt + decode steps + 1 = 13"), "{err}");
}

#[test]
fn sampled_runs_report_their_settings_and_repeat_with_the_seed() {
    let run = |seed: &str| json_line(&["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", seed, "--no-warmup"]);
    let a = run("5");
    assert_eq!(a["sampling"]["top_k"], 20);
    assert_eq!(a["sampling"]["seed"], 5);
    assert_eq!(a["decode"]["token_digest"], run("5")["decode"]["token_digest"]);
    let greedy = json_line(&["--no-warmup"]);
    assert_eq!(greedy["sampling"], "greedy");
}

#[test]
fn bad_sampling_flags_are_a_one_line_error() {
    let err = one_line_error(bench(&["--top-p", "0"]));
    assert!(err.contains("top_p must be in (0, 1]"), "{err}");
}

#[test]
fn batch_runs_report_aggregate_rates_and_a_digest_per_sequence() {
    let line = json_line(&["--batch", "3", "--no-warmup"]);
    assert_eq!(line["batch"], 3);
    let d = &line["decode"];
    let digests = d["token_digests"].as_array().unwrap();
    assert_eq!(digests.len(), 3);
    assert_eq!(d["token_ids"].as_array().unwrap().len(), 3);
    assert_eq!(d["step_wall_secs"].as_array().unwrap().len(), 4);
    let (agg, per) = (d["aggregate_tok_s"].as_f64().unwrap(), d["tok_s"].as_f64().unwrap());
    assert!(agg > 0.0 && (agg / 3.0 - per).abs() < 1e-6 * agg);
    // Sequence 0's prompt is the contract prompt: greedy, it decodes what the batch-1 run does.
    let single = json_line(&["--no-warmup"]);
    assert_eq!(digests[0], single["decode"]["token_digest"]);
    assert_ne!(digests[0], digests[1]);
    let err = one_line_error(bench(&["--batch", "0"]));
    assert!(err.contains("--batch must be positive"), "{err}");
}

/// `--synth-preset` writes the preset's checkpoint where --model points when it has none (alone,
/// without --prompt-len, it only does that), and a run on it then measures it; a checkpoint that
/// is there is left as it is.
#[test]
fn synth_preset_writes_the_checkpoint_a_run_then_uses() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let lily_bench = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_lily-bench"))
            .args(["--model", dir.to_str().unwrap(), "--synth-preset", "tiny", "--backend", "cpu"])
            .args(extra)
            .output()
            .expect("run lily-bench")
    };
    let out = lily_bench(&[]);
    assert!(out.status.success() && out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    let config = dir.join("config.json");
    let written = std::fs::metadata(&config).expect("config.json written").modified().unwrap();
    let out = lily_bench(&["--prompt-len", "8", "--decode-steps", "2", "--no-warmup"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON line");
    assert_eq!(line["decode"]["token_ids"].as_array().unwrap().len(), 2);
    assert_eq!(std::fs::metadata(&config).unwrap().modified().unwrap(), written, "the checkpoint was written again");
    // Without --model there is nowhere to write it.
    let out = Command::new(env!("CARGO_BIN_EXE_lily-bench")).args(["--synth-preset", "tiny"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `--handover` (the GPU hand-over microbenchmark) needs no model; without a GPU it is a one-line
/// error, and it takes no model-run flags.
#[test]
fn handover_without_a_gpu_is_a_one_line_error() {
    let run = |extra: &[&str]| Command::new(env!("CARGO_BIN_EXE_lily-bench")).arg("--handover").args(extra).output().unwrap();
    if lily::backend::cuda::device::driver_available() {
        return; // a GPU machine runs it for real (bench scripts)
    }
    let err = one_line_error(run(&[]));
    assert!(err.contains("NVIDIA driver"), "{err}");
    let out = run(&["--prompt-len", "8"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}
