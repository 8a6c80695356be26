#!/usr/bin/env python3
"""Cross-check bench/write_gguf.py against llama.cpp's own converter (manual; needs torch,
transformers and the llama-cpp-python sdist's vendor/llama.cpp).

1. export a Lily checkpoint, dequantized, as an HF bf16-layout directory (f32 tensors);
2. run vendor/llama.cpp/convert_hf_to_gguf.py --outtype f32 on it;
3. compare its KV metadata and every tensor (name, shape, type, values) with write_gguf.py's
   f32 output.

    PYTHONPATH=$LLAMA/gguf-py python tests/bench/gguf_oracle.py --model /tmp/tiny --llama $LLAMA \
        --ours /tmp/tiny-f32.gguf --work /tmp/oracle
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def export_hf(model, out):
    import torch
    from safetensors.torch import save_file
    import transformers_goldens as tg
    cfg = json.load(open(os.path.join(model, "config.json")))
    state = tg.to_hf_state(tg.load_tensors(model), cfg["quantization"]["group_size"])
    hf = {}
    for k, v in state.items():
        name = k if k.startswith("lm_head") else "model.language_model." + k[len("model."):]
        hf[name] = v.to(torch.float32).contiguous()
    os.makedirs(out, exist_ok=True)
    save_file(hf, os.path.join(out, "model.safetensors"))
    for k in ("quantization", "quantization_config"):
        cfg.pop(k, None)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.exists(os.path.join(model, f)):
            shutil.copy(os.path.join(model, f), out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama", required=True, help="vendor/llama.cpp of the sdist")
    ap.add_argument("--ours", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--reuse", action="store_true", help="reuse WORK/ref-f32.gguf from an earlier run")
    args = ap.parse_args()
    import numpy as np
    import gguf
    hf = os.path.join(args.work, "hf")
    ref = os.path.join(args.work, "ref-f32.gguf")
    if not (args.reuse and os.path.exists(ref)):
        export_hf(args.model, hf)
        subprocess.run([sys.executable, os.path.join(args.llama, "convert_hf_to_gguf.py"), hf, "--outtype", "f32", "--outfile", ref], check=True)
    a, b = gguf.GGUFReader(ref), gguf.GGUFReader(args.ours)
    def kv(r):
        out = {}
        for f in r.fields.values():
            if f.name.startswith("GGUF.") or f.name.startswith("general."):
                continue
            try:
                v = f.contents()
            except Exception:
                v = None
            out[f.name] = v
        return out
    ka, kb = kv(a), kv(b)
    # Intended difference: write_gguf drops MTP (a Lily checkpoint has no mtp.* tensors); the converter
    # still counts config.json's mtp_num_hidden_layers as an extra (nextn) block. Undo that on the ref side.
    nextn = ka.pop("qwen35moe.nextn_predict_layers", 0) or 0
    if nextn and "qwen35moe.nextn_predict_layers" not in kb:
        print(f"note: ref has nextn_predict_layers={nextn} (MTP block counted, no tensors); compared without it")
        ka["qwen35moe.block_count"] -= nextn
        ka["qwen35moe.attention.recurrent_layers"] = ka["qwen35moe.attention.recurrent_layers"][:-nextn]
    bad = 0
    for k in sorted(set(ka) | set(kb)):
        if ka.get(k) != kb.get(k):
            va, vb = str(ka.get(k))[:120], str(kb.get(k))[:120]
            print(f"KV {k}: ref={va} ours={vb}")
            bad += 1
    ta = {t.name: t for t in a.tensors}
    tb = {t.name: t for t in b.tensors}
    for n in sorted(set(ta) | set(tb)):
        if n not in ta or n not in tb:
            print(f"tensor {n}: only in {'ref' if n in ta else 'ours'}")
            bad += 1
            continue
        x, y = ta[n], tb[n]
        if list(x.shape) != list(y.shape) or x.tensor_type != y.tensor_type:
            print(f"tensor {n}: ref {list(x.shape)} {x.tensor_type.name} ours {list(y.shape)} {y.tensor_type.name}")
            bad += 1
            continue
        d = float(np.max(np.abs(np.asarray(x.data, np.float32) - np.asarray(y.data, np.float32)))) if x.data.size else 0.0
        if d > 1e-6:
            print(f"tensor {n}: max |diff| {d}")
            bad += 1
    print(f"{len(ta)} ref tensors, {len(tb)} ours; {bad} differences")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
