"""End-to-end benchmark, measured the SparseVILA paper's way: one multi-turn conversation, timed as
vision encode + LLM prefill + decode, greedy, with the first image prefill amortised over the rounds.

    # image conversation, 4 rounds x 50 tokens: HF fp16, tinyvila fp16, quantized, SparseVILA
    python -m scripts.bench --images 1 --rounds 4 --new-tokens 50
    # decode tok/s at a 1K-token context against the bandwidth floor, and against HF fp16
    python -m scripts.bench --decode-context 1024 --new-tokens 256
    # video conversation, 3 rounds x 250 tokens: dense quantized vs SparseVILA
    python -m scripts.bench --frames 64 --rounds 3 --new-tokens 250 --prefill-keep 0.3 --decode-keep 0.1
    python -m scripts.bench --model checkpoints/vila-8b-awq ...   # a real checkpoint
    python -m scripts.bench --decode-context 1024 --pipelines quant --options pdl=0   # runtime options

Pipelines (--pipelines; default hf,fp16,quant,sparse for images, quant,sparse for video, hf,quant
for --decode-context; without transformers installed, hf is skipped with a message):
  hf      HF transformers fp16 (SiglipVisionModel + tinyvila's projector + LlamaForCausalLM/Qwen2,
          SDPA), re-encoding and re-prefilling image and question every round, as HF users do
  fp16    tinyvila dense, fp16 weights
  quant   tinyvila dense, W4A16 LLM + W8A8 vision
  sparse  tinyvila quantized with SparseVILA (--prefill-keep, --decode-keep)
Stop tokens are ignored, so every pipeline generates exactly --new-tokens per round. Synthetic weights
at real shapes (--preset, default vila-8b) unless --model is given (speed does not depend on the
values; with --model, fp16/quant both mean the checkpoint as stored, and hf has random weights of its
shapes). The KV cache is sized to what the conversation needs. Each pipeline first runs the whole
conversation twice unmeasured (--warmup full: every shape, compilation, autotuning and graph capture
of the measured run happens there, a later turn's graph being captured at its key's second turn; the
measured run counts any Triton kernel loads or autotunings it still hit), then runs it again on the
same chat with peak memory reset (--repeats N times: the row is the median run by end-to-end time, its
TTFT the median over the runs, every run's time in the JSON).
tinyvila pipelines run under --options (tinyvila.options.Options fields, on top of Options.from_env()).

Prints a table (tinyvila.benchmark's columns, the follow-up TTFT: the median over rounds 2 and later, plus
speed-ups over the first pipeline and the decode bandwidth floor), the sparse-vs-dense stage speed-ups beside
what FLOPs (prefill) and bytes read (decode) predict, the speed targets this mode measures, then one JSON line
(GPU, torch, triton, commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

import tinyvila
from scripts.benches import common
from scripts.benches import cost_model as cm
from tinyvila import benchmark as bm
from tinyvila.api import Stats, from_config, resolve_model
from tinyvila.config import QuantConfig, SparsityConfig, VLMConfig, preset
from tinyvila.loader import synthetic_tokenizer
from tinyvila.options import Options
from tinyvila.tokenizer import TEMPLATES, BPETokenizer, load_tokenizer, turn_ids

QUESTIONS = ["Describe the image in detail.", "What objects are on the left?", "What colours dominate?",
             "Is there any text?", "What happens next?", "Summarise the scene."]
FILLER = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. "


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="vila-8b")
    p.add_argument("--model", help="a checkpoint folder instead of synthetic weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--images", type=int, default=1, help="images in the first round")
    p.add_argument("--frames", type=int, help="video: this many frames (one batch, each an image) instead of --images")
    p.add_argument("--decode-context", type=int, help="decode mode: one text-only turn whose prompt is this "
                   "many tokens; reports decode speed against the bandwidth floor")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=50)
    p.add_argument("--pipelines", help="comma-separated, from hf,fp16,quant,sparse (default: by mode; leave hf "
                   "out to skip the HF anchor, which takes 10-30 s per run of an 8B conversation)")
    p.add_argument("--prefill-keep", type=float, default=0.3)
    p.add_argument("--decode-keep", type=float, default=0.1)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], help="synthetic models: compute "
                   "dtype (default: the preset's)")
    p.add_argument("--repeats", type=int, default=1,
                   help="measured runs of the conversation per pipeline (after the warm-up): the row is the run "
                        "with the median end-to-end time, and its TTFT the median TTFT over the runs, so that "
                        "one host hiccup in a single-shot timing does not decide a target")
    p.add_argument("--warmup", choices=["full", "short"], default="full",
                   help="full: the whole conversation twice before measuring; short: 2 tokens a round, once")
    p.add_argument("--options", default="", metavar="NAME=VALUE,...",
                   help="runtime options of the tinyvila pipelines (tinyvila.options.Options fields, e.g. "
                        "cuda_graph=0,pdl=0), on top of Options.from_env()")
    args = p.parse_args(argv)
    try:
        args.opts = Options.parse(args.options, Options.from_env())
    except ValueError as e:
        p.error(str(e))
    if args.pipelines is None:
        args.pipelines = ("hf,quant" if args.decode_context else "quant,sparse" if args.frames
                          else "hf,fp16,quant,sparse")
    if args.decode_context:
        args.rounds = 1
    return args


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# -- the conversation ----------------------------------------------------------------------------------
@dataclass
class Turn:
    images: list         # HxWx3 uint8 arrays added before the question (all encoded as one batch)
    question: str


def random_images(cfg: VLMConfig, n: int) -> list:
    """Deterministic random uint8 images at the encoder's size (content does not change the work)."""
    g = torch.Generator().manual_seed(0)
    s = cfg.vision.image_size
    return [torch.randint(0, 256, (s, s, 3), generator=g, dtype=torch.uint8).numpy() for _ in range(n)]


def filler_question(tokenizer, template, n_tokens: int) -> str:
    """The longest prefix of repeated filler text whose first-turn prompt is at most n_tokens ids."""
    text = FILLER * (n_tokens // 8 + 1)
    lo, hi = 0, len(text)
    while lo < hi:  # prompt length grows with the prefix: bisect on characters
        mid = (lo + hi + 1) // 2
        if len(turn_ids(tokenizer, template, text[:mid], 0, first=True)) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def conversation(args, cfg: VLMConfig, tokenizer, template) -> list[Turn]:
    if args.decode_context:
        return [Turn([], filler_question(tokenizer, template, args.decode_context))]
    images = random_images(cfg, args.frames or args.images)
    return [Turn(images if r == 0 else [], QUESTIONS[r % len(QUESTIONS)]) for r in range(args.rounds)]


def context_needed(cfg: VLMConfig, turns: list[Turn], new_tokens: int, tokenizer, template) -> int:
    """KV slots the conversation needs when nothing is pruned (each turn: its ids with images
    expanded, a pending answer token, its answer), rounded up to 256."""
    need = 0
    for i, t in enumerate(turns):
        n = len(t.images)
        ids = turn_ids(tokenizer, template, t.question, n, first=i == 0)
        need += len(ids) - n + n * cfg.image_tokens + 1 + new_tokens
    return -(-need // 256) * 256


# -- pipelines -----------------------------------------------------------------------------------------
def pipeline_config(base: VLMConfig, name: str, args) -> VLMConfig:
    if name in ("fp16", "hf"):
        return base
    quant = QuantConfig(llm="w4a16", vision="w8a8" if base.vision else "none", group_size=args.group_size)
    cfg = dataclasses.replace(base, quant=quant)
    if name == "sparse":
        cfg = dataclasses.replace(cfg, sparsity=SparsityConfig(prefill_keep=args.prefill_keep,
                                                               decode_keep=args.decode_keep))
    return cfg


class TinyvilaPipeline:
    """A tinyvila model and one chat, reused (clear()) for the warm-up and the measured run."""

    def __init__(self, name: str, cfg: VLMConfig, args, max_seq_len: int):
        if args.model:
            self.vlm = tinyvila.load(args.model, device=args.device, options=args.opts)
            sparsity = SparsityConfig(prefill_keep=args.prefill_keep, decode_keep=args.decode_keep)
            self.cfg = dataclasses.replace(self.vlm.cfg, sparsity=sparsity if name == "sparse" else SparsityConfig())
        else:
            self.vlm, self.cfg = from_config(cfg, device=args.device, options=args.opts), cfg  # as load() builds it
        self.vlm.stop_ids = frozenset()  # exactly --new-tokens per round
        self.chat = self.vlm.chat(sparsity=self.cfg.sparsity, max_seq_len=max_seq_len)

    def run(self, turns: list[Turn], new_tokens: int) -> list[Stats]:
        self.chat.clear()
        sampling = tinyvila.SamplingParams(max_new_tokens=new_tokens)
        out = []
        for t in turns:
            if t.images:
                self.chat.add_image(t.images)
            for _ in self.chat.ask(t.question, sampling):
                pass
            out.append(self.chat.stats)
        return out


def hf_models(cfg: VLMConfig, device, dtype, with_vision: bool):
    """HF SiglipVisionModel + LlamaForCausalLM/Qwen2ForCausalLM of the same shapes, random weights."""
    import transformers as tf

    v, t = cfg.vision, cfg.text
    common_cfg = dict(vocab_size=t.vocab_size, hidden_size=t.dim, intermediate_size=t.ffn_dim,
                      num_hidden_layers=t.n_layers, num_attention_heads=t.n_heads, num_key_value_heads=t.n_kv_heads,
                      rms_norm_eps=t.norm_eps, rope_theta=t.rope_theta, max_position_embeddings=t.max_seq_len,
                      tie_word_embeddings=t.tie_embeddings)
    lcfg = tf.Qwen2Config(**common_cfg) if t.arch == "qwen2" else tf.LlamaConfig(**common_cfg)
    lm_cls = tf.Qwen2ForCausalLM if t.arch == "qwen2" else tf.LlamaForCausalLM
    vision = None
    # Built directly on the device: HF's own init also sets the buffers (position ids, RoPE inv_freq).
    with torch.device(device):
        if with_vision:
            vcfg = tf.SiglipVisionConfig(hidden_size=v.dim, intermediate_size=v.mlp_dim, num_hidden_layers=v.n_layers,
                                         num_attention_heads=v.n_heads, image_size=v.image_size,
                                         patch_size=v.patch_size, layer_norm_eps=v.norm_eps,
                                         hidden_act="gelu_pytorch_tanh")
            vision = tf.SiglipVisionModel._from_config(vcfg, attn_implementation="sdpa", torch_dtype=dtype).eval()
        lm = lm_cls._from_config(lcfg, attn_implementation="sdpa", torch_dtype=dtype)
    return vision, lm.eval()


def _first_token_streamer():
    """A transformers streamer that records when the first generated token reaches the host."""
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        t = None

        def put(self, value):
            if self.t is None and value.numel() and getattr(self, "prompt_seen", False):
                self.t = time.perf_counter()  # value is already on the host (generate calls .cpu())
            self.prompt_seen = True  # generate's first put is the prompt's ids

        def end(self):
            pass

    return FirstToken()


class HFPipeline:
    """HF transformers fp16 at the same shapes (random weights): each round re-encodes the images
    and prefills system + images + question afresh, then `generate`s, as an HF user does."""

    def __init__(self, cfg: VLMConfig, args, tokenizer, template, with_vision: bool):
        from tinyvila.projector import Projector

        self.cfg, self.device, self.tokenizer, self.template = cfg, args.device, tokenizer, template
        self.dtype = torch.float16 if torch.device(args.device).type == "cuda" else torch.float32
        self.vision, self.lm = hf_models(cfg, self.device, self.dtype, with_vision)
        self.projector = None
        if with_vision:
            with torch.device(self.device):
                self.projector = Projector(cfg.projector, cfg.vision).to(self.dtype).eval()
            for name, p in self.projector.named_parameters():  # N(0, 0.02); norm scales 1 + that
                p.data.normal_(0, 0.02).add_(1.0 if p.ndim == 1 and name.endswith("weight") else 0.0)

    def _embed(self, ids: list[int], images: torch.Tensor | None) -> torch.Tensor:
        """ids with IMAGE_TOKEN sentinels -> (1, T, d), image i replacing the i-th sentinel (as VLM.embed)."""
        from tinyvila.tokenizer import IMAGE_TOKEN

        h = self.lm.get_input_embeddings()(torch.tensor([max(t, 0) for t in ids], device=self.device))
        pieces, prev = [], 0
        for i, s in enumerate(s for s, t in enumerate(ids) if t == IMAGE_TOKEN):
            pieces += [h[prev:s], images[i].to(h.dtype)]
            prev = s + 1
        return torch.cat(pieces + [h[prev:]])[None]

    @torch.inference_mode()
    def run(self, turns: list[Turn], new_tokens: int) -> list[Stats]:
        images = turns[0].images
        pixels = tinyvila.image.preprocess(images, self.cfg.vision).to(self.device, self.dtype) if images else None
        n, out = len(images), []
        for t in turns:
            _sync(self.device)
            t0 = time.perf_counter()
            feats = None
            if n:
                hidden = self.vision(pixel_values=pixels, output_hidden_states=True).hidden_states
                feats = self.projector(hidden[self.cfg.vision.select_layer])
            _sync(self.device)
            t1 = time.perf_counter()
            embeds = self._embed(turn_ids(self.tokenizer, self.template, t.question, n, first=True), feats)
            self.lm(inputs_embeds=embeds, logits_to_keep=1)  # the prefill alone, to split prefill from decode
            _sync(self.device)
            t2 = time.perf_counter()
            streamer = _first_token_streamer()
            self.lm.generate(inputs_embeds=embeds, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, streamer=streamer)
            _sync(self.device)
            t3 = time.perf_counter()
            prefill = t2 - t1  # generate() prefills again: its decode is the rest
            T = embeds.shape[1]
            # Decode = the first token's sampling (generate's time to it, less the separately timed prefill:
            # an estimate, clipped at 0 on a noisy host) + the steps after it (exact: first token -> end).
            t_first = streamer.t or t3
            first = max(t_first - t2 - prefill, 0.0)
            out.append(Stats(encode_ms=1000 * (t1 - t0), prefill_ms=1000 * prefill, prefill_tokens=T,
                             decode_ms=1000 * (first + t3 - t_first), decode_tokens=new_tokens,
                             context_tokens=T + new_tokens, images=n, visual_tokens=n * self.cfg.image_tokens,
                             visual_kept=n * self.cfg.image_tokens, finish="max_tokens", first_token_ms=1000 * first))
        return out


# -- measuring -----------------------------------------------------------------------------------------
def copy_bandwidth_gbs(device) -> float:
    """Measured copy bandwidth (bytes read + written per second), GB/s: a 1 GiB device-to-device copy
    on CUDA (scripts/benches/common.py), a 64 MiB copy on the CPU."""
    if torch.device(device).type == "cuda":
        return common.copy_bandwidth_gbs()
    src = torch.ones(1 << 26, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / sorted(times)[2] / 1e9


def tokenizer_and_template(args, cfg: VLMConfig):
    if args.model:
        return load_tokenizer(Path(args.model) / cfg.tokenizer), TEMPLATES[cfg.template]
    return BPETokenizer(synthetic_tokenizer(cfg), source="<synthetic>"), TEMPLATES[cfg.template]


def build(name: str, args, base: VLMConfig, turns: list[Turn], max_seq_len: int, tok, template):
    if name == "hf":
        return HFPipeline(base, args, tok, template, with_vision=any(t.images for t in turns))
    return TinyvilaPipeline(name, pipeline_config(base, name, args), args, max_seq_len)


def free_device(device) -> None:
    """Return a freed pipeline's memory, so that the next one's peak is its own. cuBLAS keeps a workspace per stream
    it ran on (HF's and eager warm-ups) in PyTorch's allocator: it goes too."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def measure(name: str, args, base: VLMConfig, turns: list[Turn], max_seq_len: int, tok, template,
            bw_gbs: float) -> dict:
    """Build, warm up, measure one pipeline; free it. Returns its row (tinyvila.benchmark summary +
    decode floor + first-use count + the per-turn stats)."""
    # Memory still held since the bench started (by an earlier pipeline), not by the caller's own tensors.
    resident = ((torch.cuda.memory_allocated() - args.baseline_bytes) / 2**30
                if torch.device(args.device).type == "cuda" else None)
    pipe = build(name, args, base, turns, max_seq_len, tok, template)
    for _ in range(2 if args.warmup == "full" else 1):  # a later turn's graph is captured at its key's second turn
        pipe.run(turns, args.new_tokens if args.warmup == "full" else 2)
    bm.reset_peak(args.device)
    with bm.FirstUse() as first_use:
        runs = [pipe.run(turns, args.new_tokens) for _ in range(max(1, args.repeats))]
    peak = bm.peak_gb(args.device)
    runs.sort(key=lambda r: bm.summary(r)["e2e_ms"])
    stats = runs[(len(runs) - 1) // 2]  # the median run (the lower one of an even count)
    ttfts = sorted(r[0].ttft_ms for r in runs)
    follow_ups = [t.ttft_ms for t in stats[1:]]  # the median run's rounds 2 and later
    cfg = pipe.cfg if isinstance(pipe, TinyvilaPipeline) else base
    del pipe
    free_device(args.device)
    # Decode against its floor: bytes the steps must read over the copy bandwidth, per step time.
    steps = sum(max(t.decode_tokens - 1, 0) for t in stats)
    step_ms = sum(t.decode_ms - t.first_token_ms for t in stats)
    floor_ms = cm.decode_bytes(cfg, stats) / (bw_gbs * 1e9) * 1000
    return {"pipeline": name, **bm.summary(stats, peak), "ttft_ms": ttfts[(len(ttfts) - 1) // 2],
            "ttft_runs_ms": ttfts, "followup_ttft_ms": statistics.median(follow_ups) if follow_ups else None,
            "e2e_runs_ms": [bm.summary(r)["e2e_ms"] for r in runs],
            "weight_gb": cm.decode_weight_bytes(cfg) / 1e9,
            "step_tok_s": 1000 * steps / step_ms if step_ms > 0 else None,
            "floor_tok_s": 1000 * steps / floor_ms if floor_ms > 0 else None,
            "of_floor": floor_ms / step_ms if step_ms > 0 else None,
            "first_use": first_use.loads + first_use.tunings, "resident_gb_before": resident,
            "prefill_gflop": cm.conversation_flops(cfg, stats) / 1e9,
            "decode_gb": cm.decode_bytes(cfg, stats) / 1e9,
            "turns": [dataclasses.asdict(t) for t in stats]}


def stage_speedups(dense: dict, sparse: dict) -> dict:
    """Sparse over dense, per stage: measured time ratios beside the FLOPs (prefill) and bytes
    (decode) ratios the cost model predicts."""
    def ratio(a, b):
        return a / b if b else None
    return {"dense": dense["pipeline"], "sparse": sparse["pipeline"],
            "encode": ratio(dense["encode_ms"], sparse["encode_ms"]),
            "prefill": ratio(dense["prefill_ms"], sparse["prefill_ms"]),
            "prefill_pred_flops": ratio(dense["prefill_gflop"], sparse["prefill_gflop"]),
            "decode": ratio(dense["decode_ms"], sparse["decode_ms"]),
            "decode_pred_bytes": ratio(dense["decode_gb"], sparse["decode_gb"]),
            "e2e": ratio(dense["e2e_ms"], sparse["e2e_ms"])}


def targets(args, rows: dict, speedups: dict | None) -> list[dict]:
    """The speed targets this run measures (docs/benchmarks.md): (what, value, target, met)."""
    out = []

    def check(what, value, target, ok):
        if value is not None:
            out.append({"what": what, "value": round(value, 3), "target": target, "met": bool(ok(value))})

    hf = rows.get("hf")
    if args.decode_context:
        for name in ("quant", "fp16"):
            if name in rows:
                check(f"{name} decode at {args.decode_context} context, of bandwidth floor",
                      rows[name]["of_floor"], ">= 0.5", lambda v: v >= 0.5)
                if hf and hf["step_tok_s"] and rows[name]["step_tok_s"]:  # None: no measurable decode time
                    check(f"{name} decode tok/s over hf", rows[name]["step_tok_s"] / hf["step_tok_s"], ">= 10",
                          lambda v: v >= 10)
    elif args.frames:
        need = 2.5 if args.frames >= 256 else 1.5 if args.frames >= 64 else None
        if speedups and need:
            check(f"sparse over dense quant end to end, {args.frames} frames", speedups["e2e"], f">= {need}",
                  lambda v: v >= need)
    else:
        for name in ("quant", "sparse", "fp16"):
            if name in rows and args.images == 1:
                check(f"{name} TTFT, one image + short question (ms)", rows[name]["ttft_ms"], "<= 30",
                      lambda v: v <= 30)
            if name in rows and hf:
                check(f"{name} end to end over hf", hf["e2e_ms"] / rows[name]["e2e_ms"], ">= 4", lambda v: v >= 4)
    return out


def over_ref(ref: dict, row: dict) -> dict:
    """Speed-ups of a row over the reference row: end to end, and decode steps."""
    return {"x_e2e": ref["e2e_ms"] / row["e2e_ms"],
            "x_decode": row["step_tok_s"] / ref["step_tok_s"] if row["step_tok_s"] and ref["step_tok_s"] else None}


def environment(device) -> dict:
    env = common.environment()
    if torch.device(device).type != "cuda":
        env["gpu"] = "cpu"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    return {**env, "dirty": bool(dirty)}


def notes(args, rows: list[dict], bw_gbs: float) -> None:
    """Warnings about a row's validity, and in decode mode each row's bandwidth floor spelled out."""
    for r in rows:
        if r["first_use"]:
            print(f"WARNING: {r['pipeline']}: {r['first_use']} Triton kernel loads/autotunings during the measured "
                  "run: the warm-up missed a shape; its times include compilation")
        if r["resident_gb_before"] and r["resident_gb_before"] > 0.1:
            print(f"WARNING: {r['pipeline']}: {r['resident_gb_before']:.2f} GiB of an earlier pipeline was still "
                  "allocated when it was built: its peak memory includes that")
        steps = r["decode_tokens"] - len(r["turns"])
        if args.decode_context and steps > 0 and r["of_floor"]:
            per_step = r["decode_gb"] / steps
            print(f"{r['pipeline']}: a decode step reads {r['weight_gb']:.4g} GB of weights + "
                  f"{per_step - r['weight_gb']:.4g} GB of KV (mean over the answer); at {bw_gbs:.0f} GB/s the floor "
                  f"is {r['floor_tok_s']:.0f} tok/s; measured {r['step_tok_s']:.1f} tok/s = {r['of_floor']:.3f} of it")


def report(args, rows: list[dict], speedups: dict | None, checks: list[dict], bw_gbs: float, max_seq_len: int,
           failed: list[str]):
    mode = f"decode at {args.decode_context} context" if args.decode_context else \
        f"{args.frames} frames" if args.frames else f"{args.images} image(s)"
    print(f"{args.model or args.preset}: {mode}, {args.rounds} round(s) x {args.new_tokens} new tokens, "
          f"{args.device}, KV cache {max_seq_len}, copy bandwidth {bw_gbs:.0f} GB/s")
    ref = rows[0]["pipeline"]
    extra = {"followup_ttft_ms": ("follow-up TTFT ms", ".1f"), "step_tok_s": ("step tok/s", ".1f"),
             "floor_tok_s": ("floor tok/s", ".0f"), "of_floor": ("of floor", ".3f"), "x_e2e": (f"e2e x{ref}", ".2f"),
             "x_decode": (f"decode x{ref}", ".2f")}
    print(bm.table([{**r, **over_ref(rows[0], r)} for r in rows], "pipeline", extra))
    notes(args, rows, bw_gbs)
    if speedups:
        x = {k: "-" if v is None else f"{v:.2f}x" for k, v in speedups.items() if k not in ("dense", "sparse")}
        print(f"{speedups['sparse']} over {speedups['dense']}: encode {x['encode']} | prefill {x['prefill']} "
              f"(FLOPs predict {x['prefill_pred_flops']}) | decode {x['decode']} (bytes predict "
              f"{x['decode_pred_bytes']}) | end to end {x['e2e']}")
    for c in checks:
        print(f"target: {c['what']}: {c['value']:.3g} ({c['target']}: {'met' if c['met'] else 'MISSED'})")
    print(json.dumps({"bench": "e2e", "preset": args.preset, "model": args.model, "images": args.images,
                      "frames": args.frames, "decode_context": args.decode_context, "rounds": args.rounds,
                      "new_tokens": args.new_tokens, "prefill_keep": args.prefill_keep,
                      "decode_keep": args.decode_keep, "warmup": args.warmup, "repeats": args.repeats,
                      "max_seq_len": max_seq_len, "options": dataclasses.asdict(args.opts),
                      "copy_gbs": bw_gbs, **environment(args.device), "rows": rows, "sparse_vs_dense": speedups,
                      "targets": checks, "failed": failed}))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model:  # a name under checkpoints/ or a folder, as tinyvila.load takes it
        args.model = str(resolve_model(args.model))
    base = VLMConfig.load(args.model) if args.model else preset(args.preset)
    if args.dtype and not args.model:
        base = dataclasses.replace(base, dtype=args.dtype)
    tok, template = tokenizer_and_template(args, base)
    turns = conversation(args, base, tok, template)
    max_seq_len = context_needed(base, turns, args.new_tokens, tok, template)
    bw_gbs = copy_bandwidth_gbs(args.device)
    args.baseline_bytes = torch.cuda.memory_allocated() if torch.device(args.device).type == "cuda" else 0
    rows, failed = [], []
    for name in args.pipelines.split(","):
        try:
            rows.append(measure(name, args, base, turns, max_seq_len, tok, template, bw_gbs))
        except Exception as e:  # report it and measure the other pipelines: a GPU run is too dear to lose whole
            if name == "hf" and isinstance(e, ImportError):  # transformers not installed: skipped, said plainly
                print(f"skipping {name}: {e}", file=sys.stderr)
                continue
            traceback.print_exc()
            print(f"FAILED: pipeline {name} (above); continuing with the others", file=sys.stderr)
            failed.append(name)
            gc.collect()
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
    if not rows:
        return 1
    by_name = {r["pipeline"]: r for r in rows}
    dense = by_name.get("quant") or by_name.get("fp16")
    speedups = stage_speedups(dense, by_name["sparse"]) if dense and "sparse" in by_name else None
    report(args, rows, speedups, targets(args, by_name, speedups), bw_gbs, max_seq_len, failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
