//! `lily quantize` on the trained fixture (tests/fixtures/qwen-fixture, scripts/train_fixture.py):
//! the HF bf16 checkpoint, rebuilt from its committed compact form and split over two shards with
//! vision and MTP tensors added (which must be dropped), quantizes to exactly the bytes
//! `mlx_lm.convert -q` wrote (the committed `mlx/` directory), tensor for tensor; inputs that are
//! not such a checkpoint are one-line errors naming the file and tensor.

use crate::fixture::{fixture_dir, hf_checkpoint, lily, mlx_checkpoint, read_safetensors, HfTensor};
use std::path::Path;

#[test]
fn quantize_is_bit_identical_to_mlx_lm_convert() {
    let work = tempfile::tempdir().unwrap();
    let hf = work.path().join("hf");
    hf_checkpoint(&hf, None, |t| {
        // What the official checkpoint carries besides the text model: dropped, as mlx-lm drops it.
        t.push(HfTensor::bf16("model.visual.blocks.0.attn.qkv.weight", vec![8, 4], 0.5));
        t.push(HfTensor::bf16("mtp.fc.weight", vec![4, 8], 0.25));
    });
    let out = work.path().join("q");
    let (ok, _, err) = lily(&["quantize", "--hf", hf.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quiet"]);
    assert!(ok, "{err}");

    let mlx = work.path().join("mlx");
    mlx_checkpoint(&mlx);
    let want = read_safetensors(&mlx.join("model.safetensors"));
    let got = read_safetensors(&out.join("model.safetensors"));
    let names = |m: &std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&got), names(&want), "tensor names");
    let mut differing = Vec::new();
    for (name, (dtype, shape, bytes)) in &want {
        let (gd, gs, gb) = &got[name];
        assert_eq!((gd, gs), (dtype, shape), "{name}: dtype/shape");
        if gb != bytes {
            differing.push(name.clone());
        }
    }
    assert!(differing.is_empty(), "{} tensors differ from mlx_lm.convert's, e.g. {:?}", differing.len(), &differing[..differing.len().min(5)]);

    // The quantization block mlx-lm writes, and a checkpoint Lily opens.
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    let mlx_cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("mlx/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization"], mlx_cfg["quantization"]);
    assert!(out.join("tokenizer.json").exists(), "tokenizer files are carried over");
    let (ok, _, err) = lily(&["info", "--model", out.to_str().unwrap()]);
    assert!(ok, "{err}");
}

/// A small HF checkpoint (the fixture's layers, a 320-token vocabulary) with `edit` applied.
fn small_hf(dir: &Path, edit: impl FnOnce(&mut Vec<HfTensor>)) {
    hf_checkpoint(dir, Some(320), edit);
}

fn quantize_err(hf: &Path) -> String {
    let out = hf.parent().unwrap().join(format!("{}-out", hf.file_name().unwrap().to_string_lossy()));
    let (ok, _, err) = lily(&["quantize", "--hf", hf.to_str().unwrap(), "--out", out.to_str().unwrap(), "--quiet"]);
    assert!(!ok, "quantize of {} should fail", hf.display());
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(!out.exists(), "no output left behind");
    err
}

#[test]
fn bad_inputs_are_one_line_errors() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();

    // The small checkpoint itself converts (so each failure below is the edit's).
    small_hf(&w.join("ok"), |_| {});
    let (ok, _, err) = lily(&["quantize", "--hf", w.join("ok").to_str().unwrap(), "--out", w.join("ok-q").to_str().unwrap(), "--quiet"]);
    assert!(ok, "{err}");
    // An output directory that holds something is not overwritten.
    let (ok, _, err) = lily(&["quantize", "--hf", w.join("ok").to_str().unwrap(), "--out", w.join("ok-q").to_str().unwrap(), "--quiet"]);
    assert!(!ok && err.contains("not an empty directory"), "{err}");

    let missing = "model.language_model.layers.2.linear_attn.in_proj_z.weight";
    small_hf(&w.join("missing"), |t| t.retain(|x| x.name != missing));
    let e = quantize_err(&w.join("missing"));
    assert!(e.contains(&format!("missing tensor {missing}")), "{e}");

    small_hf(&w.join("dtype"), |t| {
        let x = t.iter_mut().find(|x| x.name.ends_with("layers.0.self_attn.q_proj.weight") || x.name.ends_with("layers.3.self_attn.q_proj.weight")).unwrap();
        x.dtype = "I16".into();
    });
    let e = quantize_err(&w.join("dtype"));
    assert!(e.contains("self_attn.q_proj.weight") && e.contains("I16") && e.contains(".safetensors"), "{e}");

    small_hf(&w.join("shape"), |t| {
        let x = t.iter_mut().find(|x| x.name.ends_with("layers.1.mlp.experts.down_proj")).unwrap();
        x.shape = vec![8, 64, 128];
    });
    let e = quantize_err(&w.join("shape"));
    assert!(e.contains("layers.1.mlp.experts.down_proj") && e.contains("[8, 64, 128]"), "{e}");

    small_hf(&w.join("extra"), |t| t.push(HfTensor::bf16("model.language_model.layers.0.mlp.experts.0.gate_proj.weight", vec![64, 128], 0.1)));
    let e = quantize_err(&w.join("extra"));
    assert!(e.contains("unexpected tensor model.language_model.layers.0.mlp.experts.0.gate_proj.weight"), "{e}");

    small_hf(&w.join("arch"), |_| {});
    let cfg_path = w.join("arch/config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap().replacen("\"qwen3_5_moe\"", "\"llama\"", 1);
    std::fs::write(&cfg_path, text).unwrap();
    let e = quantize_err(&w.join("arch"));
    assert!(e.contains("llama") && e.contains("config.json"), "{e}");

    // Already quantized: the MLX fixture itself.
    mlx_checkpoint(&w.join("mlx"));
    let e = quantize_err(&w.join("mlx"));
    assert!(e.contains("already quantized"), "{e}");

    let gguf = w.join("model.gguf");
    std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00").unwrap();
    let e = quantize_err(&gguf);
    assert!(e.contains("GGUF"), "{e}");
}
