"""`python -m tinyvila.chat`: chat with a VILA model about images, one-shot or interactively.

    python -m tinyvila.chat --model vila-8b-awq --image x.jpg                  # multi-turn REPL
    python -m tinyvila.chat --model demo --image x.jpg -p "Describe it."      # one-shot
    python -m tinyvila.chat --model demo --video clip.mp4 --num-frames 8 -p "What happens?"   # a video's frames
    python -m tinyvila.chat --model vila-8b-awq --image x.jpg -p "Describe it." --benchmark --warmup

In the REPL: /image PATH adds an image to the next question, /video PATH a video's sampled frames (as
--num-frames and --fps say), /discard drops the images not yet asked about, /clear starts over, /stats
prints the last turn's numbers, /quit (or Ctrl-D) leaves; Ctrl-C stops an answer. An error in one turn (a
bad image, a question too long for the context) is reported and the conversation goes on. `--benchmark`
prints each answer's breakdown (tinyvila/benchmark.py, as scripts/bench.py does) and, when the
conversation ends (/clear or exit), a table of its answers and their total. The only module that does
terminal I/O; everything else goes through the Python API (tinyvila.api).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from . import benchmark, tp
from .api import Chat, load
from .errors import ArgumentError, ContextLimitError, EvalModeError, TinyVilaError
from .generate import SamplingParams
from .options import Options

HELP = "commands: /image PATH  /video PATH  /discard  /clear  /stats  /quit   (Ctrl-D quits, Ctrl-C stops an answer)"
# API argument names -> the flags that set them (errors speak the CLI's language)
FLAGS = {name: "--" + name.replace("_", "-") for name in
         ("temperature", "top_k", "top_p", "max_new_tokens", "seed", "max_seq_len", "num_frames", "fps")}
# C0 control characters other than tab and newline (and DEL) are not printed: a model's output must
# not be able to drive the terminal (escape sequences, bells).
_CONTROL = {c: None for c in [*range(0, 9), *range(11, 32), 127]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tinyvila.chat", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder, or a name under checkpoints/ ('demo' builds a tiny random one)")
    p.add_argument("--image", action="append", default=[], help="image file for the first question (repeatable)")
    p.add_argument("--video", action="append", default=[], help="video file (or folder of frames) whose sampled "
                   "frames go with the first question, one image each (repeatable; needs tinyvila[video])")
    p.add_argument("--num-frames", type=int, default=8, help="frames sampled from each video, uniformly (default 8)")
    p.add_argument("--fps", type=float, help="sample at most this many frames a second of video, spread over the "
                   "whole clip (and at most --num-frames)")
    p.add_argument("-p", "--prompt", help="ask this once, print the answer and exit")
    p.add_argument("--system", help="replace the template's system prompt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], help="default: the checkpoint's")
    p.add_argument("--verify", action="store_true", default=None,
                   help="check at load that every weight is finite also on the CPU (always done on a GPU)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--max-seq-len", type=int, help="KV cache size (default: the model's context)")
    p.add_argument("--no-stats", action="store_true", help="do not print the stats line after answers")
    p.add_argument("--benchmark", action="store_true", help="after each answer print its breakdown (encode, "
                   "prefill, decode, TTFT, tok/s, tokens, context, visual kept, decode rows, peak GPU memory, "
                   "first-use kernel loads); when the conversation ends, a table of its answers and the total")
    p.add_argument("--warmup", action="store_true", help="with -p: answer the prompt once unseen first, so that "
                   "kernel compilation and autotuning stay out of the numbers")
    p.add_argument("--prefill-keep", type=float, help="fraction of each image's visual tokens kept (SparseVILA "
                   "prefill pruning; default: the checkpoint's, 1.0 = dense)")
    p.add_argument("--prefill-method", choices=["sparsevila", "random", "visionzip"],
                   help="how kept visual tokens are chosen (default sparsevila)")
    p.add_argument("--prefill-positions", choices=["contiguous", "original"],
                   help="RoPE positions of kept visual tokens (default contiguous)")
    p.add_argument("--decode-keep", type=float, help="fraction of the cached visual tokens each question decodes "
                   "over, chosen per question (SparseVILA retrieval; default: the checkpoint's, 1.0 = dense)")
    p.add_argument("--eval-multiturn", action="store_true", help="evaluation mode: each question is answered "
                   "against system + image only (the previous question and answer are evicted)")
    p.add_argument("--no-cuda-graph", action="store_true", help="run eagerly, without CUDA graphs (debugging)")
    p.add_argument("--options", default="", metavar="NAME=VALUE,...",
                   help="runtime switches (tinyvila.Options, e.g. 'pdl=0,fused_norm_gemv=off'); for A/B runs")
    p.add_argument("--tp", type=tp.world_size, default=1, metavar="N", help="tensor parallel over N ranks (GPUs cuda:0..N-1, or "
                   "CPU processes with --device cpu), spawned here; under torchrun its ranks are used")
    return p.parse_args(argv)


def answer(chat: Chat, question: str, show_stats: bool, recorder: benchmark.Recorder | None = None) -> None:
    """Stream one answer to stdout; Ctrl-C stops it and keeps the conversation usable."""
    stream = chat.ask(question)
    try:
        for piece in stream:
            print(piece.translate(_CONTROL), end="", flush=True)
    except KeyboardInterrupt:
        print(" [stopped]", end="")
    finally:
        stream.close()  # its stats are final
    print()
    if recorder is not None:
        print(f"[benchmark: {benchmark.line(recorder.record(chat.stats))}]", file=sys.stderr)
    elif show_stats:
        print(f"[{chat.stats.line()}]", file=sys.stderr)


def explain(e: Exception, chat: Chat | None, one_shot: bool) -> str:
    """An error's message in the CLI's terms: its flags and /commands, not the Python API's names."""
    if isinstance(e, ArgumentError) and e.name in FLAGS:
        msg = str(e)
        for api_name in (f"SamplingParams.{e.name}", e.name):
            if msg.startswith(api_name):
                return FLAGS[e.name] + msg[len(api_name):]
    if isinstance(e, ContextLimitError) and chat is not None:
        ctx, declared = chat.decoder.max_len, chat.vlm.cfg.text.max_seq_len
        larger = f"a larger --max-seq-len (the model's context is {declared})" if declared > ctx else "a model with a longer context"
        if one_shot:
            return (f"the prompt does not fit: the context is {ctx} tokens; shorten -p, pass fewer --image or "
                    f"--num-frames, or use {larger}")
        queued = chat.queued()
        return (f"this question does not fit: the context is {ctx} tokens; ask a shorter one, /clear to start over, "
                f"or restart with {larger}" + (f". The {queued} queued: /discard drops them" if queued else ""))
    return str(e) if isinstance(e, TinyVilaError) else f"{type(e).__name__}: {e}"


def end_conversation(recorder: benchmark.Recorder | None) -> None:
    """With --benchmark: the finished conversation's table (nothing if it had no answer)."""
    if recorder is not None and recorder.turns:
        print(f"[benchmark: conversation]\n{recorder.report()}", file=sys.stderr)


def add_video(chat: Chat, path: str, args: argparse.Namespace | None) -> str:
    """Queue a video's sampled frames (as --num-frames and --fps say); returns what to tell the user."""
    times = chat.add_video(path, args.num_frames if args else 8, args.fps if args else None)
    return f"[video added: {path}, {len(times)} frames at {times[0]:.1f}-{times[-1]:.1f} s; they go with your next question]"


def command(chat: Chat, line: str, recorder: benchmark.Recorder | None = None,
            args: argparse.Namespace | None = None) -> bool:
    """Run a /command (`args`: the flags /video samples with); returns False when the REPL should end."""
    name, _, arg = line.partition(" ")
    if name == "/quit":
        return False
    if name in ("/image", "/video"):
        if not arg.strip():
            print(f"usage: {name} PATH")
            return True
        try:
            if name == "/video":
                print(add_video(chat, arg.strip(), args))
                return True
            chat.add_image(arg.strip())
        except EvalModeError:
            print("error: evaluation mode (--eval-multiturn) answers every question against the first question's "
                  "images: /clear starts a new evaluation; without --eval-multiturn images can be added as you go",
                  file=sys.stderr)
            return True
        print(f"[image added: {arg.strip()}; it goes with your next question]")
    elif name == "/discard":
        n = len(chat.images)
        chat.discard_pending()
        print(f"[{n} image{'s' if n != 1 else ''} discarded]")
    elif name == "/clear":
        end_conversation(recorder)
        chat.clear()
        print("[conversation cleared]")
    elif name == "/stats":
        print(f"[{chat.stats.line()}]")
    elif name in ("/help", "/?"):
        print(HELP)
    else:
        print(f"unknown command {name}; {HELP}")
    return True


def repl(chat: Chat, show_stats: bool, recorder: benchmark.Recorder | None = None,
         args: argparse.Namespace | None = None) -> None:
    """Read questions and /commands until /quit or Ctrl-D; one failed turn never ends the conversation."""
    print(HELP)
    while True:
        try:
            line = input(">>> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not line:
            continue
        try:
            if line.startswith("/"):
                if not command(chat, line, recorder, args):
                    return
            else:
                answer(chat, line, show_stats, recorder)
        except KeyboardInterrupt:  # during a command (a slow image) or a prefill: that turn is undone
            print("[stopped]")
        except Exception as e:  # noqa: BLE001 - a bad image, a full context, any error: say so, keep the session
            where = f"{line}: " if line.startswith("/") and not isinstance(e, TinyVilaError) else ""
            print(f"error: {where}{explain(e, chat, one_shot=False)}", file=sys.stderr)


def open_chat(args: argparse.Namespace) -> Chat:
    """Load the model and open the chat the flags describe (the sampling flags are checked first)."""
    options = Options.parse(args.options, Options.from_env())
    if args.no_cuda_graph:
        options = options.with_(cuda_graph=False)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, seed=args.seed)
    rank = getattr(args, "tp_rank", None)  # tp.Rank under --tp (tp_main)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if rank is None:
        vlm = load(args.model, device=args.device, dtype=dtype, options=options, verify=args.verify)
    else:
        vlm = tp.load(args.model, rank, device=tp.rank_device(args.device, rank.rank), dtype=dtype, options=options,
                      verify=args.verify)
    if vlm.cfg.synthetic and not (rank is not None and rank.rank):
        print(f"note: {vlm.folder} is a synthetic checkpoint with RANDOM weights; "
              "its answers are meaningless text.", file=sys.stderr)
    prefill = {k: v for k, v in (("prefill_keep", args.prefill_keep), ("prefill_method", args.prefill_method),
                                 ("prefill_positions", args.prefill_positions),
                                 ("decode_keep", args.decode_keep)) if v is not None}
    sparsity = dataclasses.replace(vlm.cfg.sparsity, **prefill)
    vlm.cfg.text.check_context(args.max_seq_len, "--max-seq-len")
    chat = vlm.chat(system=args.system, sampling=sampling, max_seq_len=args.max_seq_len, sparsity=sparsity,
                    mode="eval" if args.eval_multiturn else "chat")
    return chat if rank is None or rank.rank else tp.Leader(chat, rank)


def tp_main(args: argparse.Namespace) -> int:
    """--tp N (or torchrun): every rank loads its shard; rank 0 runs this CLI, the others follow its requests."""
    env = tp.from_env()
    if env is not None and args.tp not in (1, env[1]):
        print(f"error: --tp {args.tp}, but torchrun started {env[1]} ranks (WORLD_SIZE)", file=sys.stderr)
        return 1
    return _tp_rank(*env, args) if env is not None else tp.launch(args.tp, _tp_rank, args)


def _tp_rank(rank: int, world: int, args: argparse.Namespace) -> int:
    """One rank of tp_main; errors are rank 0's to print (every rank meets the same ones)."""
    ranked = lambda r: argparse.Namespace(**vars(args), tp_rank=r)  # noqa: E731
    return tp.run_rank(rank, world, args.device, lambda r: main(args=ranked(r)), lambda r: (open_chat(ranked(r)), None))


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = parse_args(argv) if args is None else args
    if getattr(args, "tp_rank", None) is None and (args.tp > 1 or tp.from_env() is not None):
        return tp_main(args)
    if args.warmup and args.prompt is None:
        print("error: --warmup needs -p (the REPL's questions are not known in advance)", file=sys.stderr)
        return 1
    chat = None
    try:
        chat = open_chat(args)
        if args.warmup:
            warm_up(chat, args, args.prompt)
        recorder = benchmark.Recorder(args.device) if args.benchmark else None
        try:
            add_media(chat, args, quiet=args.prompt is not None)
            if args.prompt is not None:
                answer(chat, args.prompt, not args.no_stats, recorder)
            else:
                repl(chat, not args.no_stats, recorder, args)
            end_conversation(recorder)
        finally:
            if recorder is not None:
                recorder.close()
    except (TinyVilaError, ValueError) as e:
        print(f"error: {explain(e, chat, one_shot=args.prompt is not None)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # while loading or encoding: nothing to keep
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


def add_media(chat: Chat, args: argparse.Namespace, quiet: bool = True) -> None:
    """The --image and --video inputs, queued for the first question."""
    for image in args.image:
        chat.add_image(image)
    for video in args.video:
        said = add_video(chat, video, args)
        if not quiet:
            print(said)


def warm_up(chat: Chat, args: argparse.Namespace, prompt: str) -> None:
    """Answer the one-shot prompt once, unseen, then forget it: the real answer then runs the same
    shapes with every kernel compiled and tuned."""
    add_media(chat, args)
    for _ in chat.ask(prompt):
        pass
    chat.clear()


if __name__ == "__main__":
    sys.exit(main())
