"""End-to-end benchmark, measured the SparseVILA paper's way: one multi-turn conversation, timed as
vision encode + LLM prefill + decode, with the first image prefill amortised over the rounds.

    PYTHONPATH=. python scripts/bench.py --preset vila-8b --images 1 --rounds 4 --new-tokens 50
    PYTHONPATH=. python scripts/bench.py --preset vila-8b --frames 64 --rounds 3 --new-tokens 250 \
        --prefill-keep 0.3 --decode-keep 0.1
    PYTHONPATH=. python scripts/bench.py --model checkpoints/vila-8b-awq ...   # a real checkpoint

The same conversation runs through each pipeline named by --pipelines:
  hf      HF transformers fp16 (SiglipVisionModel + the projector + LlamaForCausalLM/Qwen2, SDPA),
          re-encoding and re-prefilling image and question every round, as HF users do
  fp16    tinyvila dense, fp16 weights
  quant   tinyvila dense, W4A16 LLM + W8A8 vision
  sparse  tinyvila quantized with SparseVILA (--prefill-keep, --decode-keep)
Greedy, stop tokens ignored, so every pipeline generates exactly --new-tokens per round. Synthetic
weights at real shapes unless --model is given (speed does not depend on the values). Prints a
table (encode, prefill, decode, end to end, tok/s, peak memory) then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tinyvila  # noqa: E402
from tinyvila.api import from_config  # noqa: E402
from tinyvila.config import QuantConfig, SparsityConfig, VLMConfig, preset  # noqa: E402

QUESTIONS = ["Describe the image in detail.", "What objects are on the left?", "What colours dominate?",
             "Is there any text?", "What happens next?", "Summarise the scene."]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="vila-8b")
    p.add_argument("--model", help="a checkpoint folder instead of synthetic weights (pipelines fp16/quant ignored)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--images", type=int, default=1, help="images in the first round")
    p.add_argument("--frames", type=int, help="video: this many frames (each an image) instead of --images")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=50)
    p.add_argument("--pipelines", default="hf,fp16,quant,sparse")
    p.add_argument("--prefill-keep", type=float, default=0.3)
    p.add_argument("--decode-keep", type=float, default=0.1)
    p.add_argument("--group-size", type=int, default=128)
    return p.parse_args(argv)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def context_for(cfg: VLMConfig, n_images: int, rounds: int, new_tokens: int) -> VLMConfig:
    """The preset's context, grown if the conversation (video) needs more (RoPE needs no change)."""
    need = n_images * cfg.image_tokens + rounds * (new_tokens + 64) + 512
    if need <= cfg.text.max_seq_len:
        return cfg
    return dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, max_seq_len=need))


def pipeline_config(base: VLMConfig, name: str, args) -> VLMConfig:
    if name == "fp16":
        return base
    quant = QuantConfig(llm="w4a16", vision="w8a8" if base.vision else "none", group_size=args.group_size)
    cfg = dataclasses.replace(base, quant=quant)
    if name == "sparse":
        cfg = dataclasses.replace(cfg, sparsity=SparsityConfig(prefill_keep=args.prefill_keep,
                                                               decode_keep=args.decode_keep))
    return cfg


def images_for(cfg: VLMConfig, n: int) -> list:
    """Deterministic random uint8 images (content does not change the work done)."""
    g = torch.Generator().manual_seed(0)
    s = cfg.vision.image_size
    return [torch.randint(0, 256, (s, s, 3), generator=g, dtype=torch.uint8).numpy() for _ in range(n)]


def run_tinyvila(vlm, cfg: VLMConfig, args, n_images: int) -> dict:
    """One conversation through a tinyvila chat; per-round stats summed."""
    vlm.stop_ids = frozenset()  # exactly --new-tokens per round
    sampling = tinyvila.SamplingParams(max_new_tokens=args.new_tokens)
    chat = vlm.chat(sampling=sampling, sparsity=cfg.sparsity)
    totals = dict(encode_ms=0.0, prefill_ms=0.0, decode_ms=0.0, decode_tokens=0, prefill_tokens=0)
    ttft = None
    for r in range(args.rounds):
        if r == 0:
            for image in images_for(cfg, n_images):
                chat.add_image(image)
        for _ in chat.ask(QUESTIONS[r % len(QUESTIONS)]):
            pass
        st = chat.stats
        for k in totals:
            totals[k] += getattr(st, k)
        if ttft is None:
            ttft = st.encode_ms + st.prefill_ms + st.decode_ms / max(st.decode_tokens, 1)
    return dict(totals, ttft_ms=ttft)


def hf_models(cfg: VLMConfig, device, dtype):
    """HF SiglipVisionModel + LlamaForCausalLM/Qwen2ForCausalLM of the same shapes, random weights."""
    import transformers as tf

    v, t = cfg.vision, cfg.text
    vcfg = tf.SiglipVisionConfig(hidden_size=v.dim, intermediate_size=v.mlp_dim, num_hidden_layers=v.n_layers,
                                 num_attention_heads=v.n_heads, image_size=v.image_size, patch_size=v.patch_size,
                                 layer_norm_eps=v.norm_eps, hidden_act="gelu_pytorch_tanh")
    common = dict(vocab_size=t.vocab_size, hidden_size=t.dim, intermediate_size=t.ffn_dim,
                  num_hidden_layers=t.n_layers, num_attention_heads=t.n_heads, num_key_value_heads=t.n_kv_heads,
                  rms_norm_eps=t.norm_eps, rope_theta=t.rope_theta, max_position_embeddings=t.max_seq_len,
                  tie_word_embeddings=t.tie_embeddings)
    lcfg = tf.Qwen2Config(**common) if t.arch == "qwen2" else tf.LlamaConfig(**common)
    lm_cls = tf.Qwen2ForCausalLM if t.arch == "qwen2" else tf.LlamaForCausalLM
    # Built directly on the device: HF's own init also sets the buffers (position ids, RoPE inv_freq).
    with torch.device(device):
        vision = tf.SiglipVisionModel._from_config(vcfg, attn_implementation="sdpa", torch_dtype=dtype)
        lm = lm_cls._from_config(lcfg, attn_implementation="sdpa", torch_dtype=dtype)
    return vision.eval(), lm.eval()


@torch.inference_mode()
def run_hf(ours, cfg: VLMConfig, args, n_images: int) -> dict:
    """Each round: encode the images again, prefill system + images + question, generate."""
    device, dtype = args.device, torch.float16 if args.device != "cpu" else torch.float32
    vision, lm = hf_models(cfg, device, dtype)
    projector = ours.model.projector.to(dtype)
    pixels = tinyvila.image.preprocess(images_for(cfg, n_images), cfg.vision).to(device, dtype)
    from tinyvila.tokenizer import turn_ids
    totals = dict(encode_ms=0.0, prefill_ms=0.0, decode_ms=0.0, decode_tokens=0, prefill_tokens=0)
    ttft = None
    for r in range(args.rounds):
        _sync(device)
        t0 = time.perf_counter()
        feats = vision(pixel_values=pixels, output_hidden_states=True).hidden_states[cfg.vision.select_layer]
        images = projector(feats)
        _sync(device)
        t1 = time.perf_counter()
        ids = turn_ids(ours.tokenizer, ours.template, QUESTIONS[r % len(QUESTIONS)], n_images, first=True)
        embeds = ours.model.embed(ids, images.to(ours.model.dtype)).to(dtype)
        lm(inputs_embeds=embeds)  # the prefill alone, to split prefill from decode
        _sync(device)
        t2 = time.perf_counter()
        lm.generate(inputs_embeds=embeds, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                    do_sample=False, pad_token_id=0)
        _sync(device)
        t3 = time.perf_counter()
        prefill = t2 - t1
        decode = max(t3 - t2 - prefill, 0.0)  # generate() prefills again: subtract it
        totals["encode_ms"] += 1000 * (t1 - t0)
        totals["prefill_ms"] += 1000 * prefill
        totals["decode_ms"] += 1000 * decode
        totals["decode_tokens"] += args.new_tokens
        totals["prefill_tokens"] += embeds.shape[1]
        if ttft is None:
            ttft = 1000 * (t1 - t0 + prefill + decode / args.new_tokens)
    return dict(totals, ttft_ms=ttft)


def measure(name: str, args, base: VLMConfig, n_images: int) -> dict:
    cfg = pipeline_config(base, name if name != "hf" else "fp16", args)
    if args.model:
        vlm = tinyvila.load(args.model, device=args.device)
        if name == "sparse":
            cfg = dataclasses.replace(vlm.cfg, sparsity=SparsityConfig(prefill_keep=args.prefill_keep,
                                                                       decode_keep=args.decode_keep))
        else:
            cfg = vlm.cfg
    else:
        vlm = from_config(cfg, device=args.device)
    run = run_hf if name == "hf" else run_tinyvila
    # Warm-up: the same rounds (so every prompt-length bucket the kernels autotune on is seen) with
    # short answers: kernel compilation, autotuning and cuBLAS handles stay out of the timed run.
    small = argparse.Namespace(**{**vars(args), "new_tokens": 2})
    run(vlm, cfg, small, n_images)
    if args.device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    res = run(vlm, cfg, args, n_images)
    res["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if args.device != "cpu" else None
    del vlm
    if args.device != "cpu":
        torch.cuda.empty_cache()
    e2e = res["encode_ms"] + res["prefill_ms"] + res["decode_ms"]
    return {"pipeline": name, **res, "e2e_ms": e2e,
            "decode_tok_s": 1000 * res["decode_tokens"] / res["decode_ms"] if res["decode_ms"] else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    n_images = args.frames or args.images
    base = context_for(preset(args.preset), n_images, args.rounds, args.new_tokens)
    rows = []
    for name in args.pipelines.split(","):
        try:
            rows.append(measure(name, args, base, n_images))
        except ImportError as e:  # transformers not installed: the HF anchor is skipped, said plainly
            print(f"skipping {name}: {e}", file=sys.stderr)
    ref = rows[0] if rows else None  # speed-ups are against the first pipeline (hf by default)
    print(f"{args.preset}: {n_images} image(s), {args.rounds} rounds x {args.new_tokens} new tokens, {args.device}")
    keys = ["pipeline", "encode_ms", "prefill_ms", "decode_ms", "e2e_ms", "ttft_ms", "decode_tok_s", "peak_gb"]
    print("  ".join(f"{k:>12}" for k in keys + [f"x_{ref['pipeline'] if ref else ''}"]))
    for r in rows:
        cells = [r[k] for k in keys] + [ref["e2e_ms"] / r["e2e_ms"]]
        print("  ".join(f"{c:>12.3f}" if isinstance(c, float) else f"{str(c):>12}" for c in cells))
    env = {"torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if args.device != "cpu" else "cpu"}
    print(json.dumps({"bench": "e2e", "preset": args.preset, "images": n_images, "rounds": args.rounds,
                      "new_tokens": args.new_tokens, "prefill_keep": args.prefill_keep,
                      "decode_keep": args.decode_keep, **env, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
