"""Why one image's encode took ~13 ms on some H200 hosts when the encoder graph takes ~2.5 ms (issue 7, runs
S7-A/D/E/G, docs/perf_notes.md session 7): Chat.add_image after idle gaps of 0-1 s, the float32 pixel upload
repeated on one tensor, encode_images from GPU and from CPU pixels, and a profiler table of one add_image, for
bench.py's quant and fp16 pipelines (vila-8b, synthetic weights). scripts/benches/encode_path.py is the
maintained part-by-part breakdown of the encode path; this is the diagnostic the session-7 numbers came from.

    PYTHONPATH=. python scripts/diag/encode_gaps.py     (one GPU, ~40 s)
"""

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench  # noqa: E402
from tinyvila.config import preset  # noqa: E402
from tinyvila.image import preprocess  # noqa: E402

GAPS = (0.0, 0.0, 0.0, 0.01, 0.05, 0.2, 1.0, 0.0)  # idle seconds before each add_image


def smi() -> str:
    """SM and memory clocks, power, P-state and throttle reasons now."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,pstate,"
                               "clocks_throttle_reasons.active", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return repr(e)


def timed_ms(fn, n: int = 5) -> list[float]:
    """Wall ms of n synchronised calls of fn."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(round(1000 * (time.perf_counter() - t0), 3))
    return out


def diagnose(name: str, args, base, turns, max_seq_len: int, tok, template) -> None:
    pipe = bench.build(name, args, base, turns, max_seq_len, tok, template)
    pipe.run(turns, 4)
    pipe.run(turns, 4)
    chat, model, img = pipe.chat, pipe.vlm.model, turns[0].images
    by_gap: dict[float, list[float]] = {}
    for gap in GAPS:
        time.sleep(gap)
        chat.clear()
        chat.add_image(img)
        by_gap.setdefault(gap, []).append(round(chat._encode_ms, 2))
    print(name, "add_image ms by idle gap before:", by_gap, flush=True)
    px = preprocess(img, model.cfg.vision)
    print(name, "float32 upload + cast ms", timed_ms(lambda: px.to("cuda", model.dtype)))
    gpu_px = px.to("cuda", model.dtype)
    with torch.inference_mode():
        print(name, "encode_images(gpu pixels) ms", timed_ms(lambda: model.encode_images(gpu_px, chat.sparsity)))
        print(name, "encode_images(cpu pixels) ms", timed_ms(lambda: model.encode_images(px, chat.sparsity)))
    print("smi", smi())
    chat.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        chat.add_image(img)
    print(name, "profiled add_image ms", chat._encode_ms)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


def main() -> None:
    args = bench.parse_args(["--images", "1", "--rounds", "1", "--new-tokens", "4", "--pipelines", "quant"])
    base = preset(args.preset)
    tok, template = bench.tokenizer_and_template(args, base)
    turns = bench.conversation(args, base, tok, template)
    max_seq_len = bench.context_needed(base, turns, 4, tok, template)
    for name in ("quant", "fp16"):
        diagnose(name, args, base, turns, max_seq_len, tok, template)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
