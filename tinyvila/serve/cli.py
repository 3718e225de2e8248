"""Serve one model over HTTP, OpenAI-compatible, with a web chat page at / (`python -m tinyvila.serve` runs `main`).

    python -m tinyvila.serve --model vila-8b-awq                       # http://127.0.0.1:8000
    python -m tinyvila.serve --model demo --port 8001 --api-key secret --prefill-keep 0.4 --decode-keep 0.25
    python -m tinyvila.serve --model vila-40b-awq --tp 2               # tensor parallel: rank 0 serves, rank 1 follows

Needs the `serve` extra (Starlette, uvicorn): without it this prints the pip command. Binds 127.0.0.1 unless
--host says otherwise: put an API key (--api-key or $TINYVILA_API_KEY) on any server other machines can reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from .. import tp

INSTALL = 'pip install "tinyvila[serve]"   (in a checkout: pip install -e ".[serve]")'


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tinyvila.serve", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model", required=True, help="checkpoint folder, or a name under checkpoints/ ('demo': the tiny random one)")
    a("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    a("--port", type=int, default=8000)
    a("--api-key", default=os.environ.get("TINYVILA_API_KEY"), help="require 'Authorization: Bearer KEY' "
      "(default: $TINYVILA_API_KEY; none: open)")
    a("--served-model-name", help="the model id /v1/models lists (default: the checkpoint folder's name); requests "
      "may name any model")
    a("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    a("--dtype", choices=["float16", "bfloat16", "float32"], help="default: the checkpoint's")
    a("--max-seq-len", type=int, help="each conversation's KV cache size (default: the model's context)")
    a("--system", help="system prompt for requests without a system message (default: the template's)")
    a("--max-tokens", type=int, default=512, help="answer length when a request sets no max_tokens")
    a("--temperature", type=float, default=0.0, help="when a request sets none (default 0: greedy)")
    a("--prefill-keep", type=float, help="SparseVILA: fraction of each image's visual tokens kept")
    a("--decode-keep", type=float, help="SparseVILA: fraction of the cached visual tokens each question decodes over")
    a("--cache-size", type=int, default=4, help="conversations kept for prefix reuse (0: none; on CUDA also "
      "bounded by free GPU memory)")
    a("--max-queue", type=int, default=64, help="requests waiting for the worker before new ones get 503")
    a("--max-body-mb", type=float, default=100, help="request size limit (413 past it)")
    a("--allowed-local-media-path", type=Path, help="serve file:// media URLs under this folder (default: refused)")
    a("--allow-http-media", action="store_true", help="fetch http(s) media URLs (default: refused; send data: URLs)")
    a("--allow-private-media-hosts", action="store_true", help="with --allow-http-media, also from loopback, private "
      "and link-local addresses (default: public hosts only)")
    a("--video-frames", type=int, default=8, help="frames sampled from a video without max_frames (VILA1.5's 8)")
    a("--max-frames", type=int, default=64, help="the most frames a request may ask for")
    a("--no-cuda-graph", action="store_true", help="run eagerly, without CUDA graphs (debugging)")
    a("--tp", type=tp.world_size, default=1, metavar="N", help="tensor parallel over N ranks (GPUs cuda:0..N-1, or gloo on "
      "CPU): rank 0 serves, the others run its requests on their shards (torchrun works too)")
    a("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p.parse_args(argv)


def _device(args: argparse.Namespace) -> str:
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def load_model(args: argparse.Namespace, rank=None):
    """The model as the flags say; with `rank` (a tp.Rank), that rank's shard."""
    import torch

    from ..api import load
    from ..options import Options

    options = Options.from_env()
    if args.no_cuda_graph:
        options = options.with_(cuda_graph=False)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if rank is None:
        return load(args.model, device=_device(args), dtype=dtype, options=options)
    return tp.load(args.model, rank, device=tp.rank_device(_device(args), rank.rank), dtype=dtype, options=options)


def build(args: argparse.Namespace, vlm=None):
    """Load the model (unless given: under --tp, rank 0's tp.LeadModel) and make (app, engine) as the flags say."""
    from .app import create_app
    from .engine import Engine
    from .media import MediaPolicy
    from .protocol import Defaults

    vlm = vlm or load_model(args)
    vlm.cfg.text.check_context(args.max_seq_len, "--max-seq-len")
    keeps = {k: v for k, v in (("prefill_keep", args.prefill_keep), ("decode_keep", args.decode_keep)) if v is not None}
    engine = Engine(vlm, sparsity=dataclasses.replace(vlm.cfg.sparsity, **keeps), max_seq_len=args.max_seq_len,
                    cache_size=args.cache_size, max_queue=args.max_queue)
    name = args.served_model_name or vlm.folder.name
    policy = MediaPolicy(local_root=args.allowed_local_media_path, allow_http=args.allow_http_media,
                         allow_private_hosts=args.allow_private_media_hosts,
                         video_frames=args.video_frames, max_frames=args.max_frames)
    defaults = Defaults(model=name, max_tokens=args.max_tokens, temperature=args.temperature, system=args.system)
    app = create_app(engine, model_name=name, api_key=args.api_key, max_body=int(args.max_body_mb * 2**20),
                     policy=policy, defaults=defaults)
    return app, engine


def _tp_rank(rank: int, world: int, args: argparse.Namespace) -> int:
    """One rank under --tp: every rank loads its shard; rank 0 serves, the others follow its requests."""
    return tp.run_rank(rank, world, _device(args), lambda r: serve(args, r), lambda r: (None, load_model(args, r)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"error: python -m tinyvila.serve needs Starlette and uvicorn ({e.name} is not installed): {INSTALL}",
              file=sys.stderr)
        return 1
    env = tp.from_env()
    if env is not None and args.tp not in (1, env[1]):
        print(f"error: --tp {args.tp}, but torchrun started {env[1]} ranks (WORLD_SIZE)", file=sys.stderr)
        return 1
    if env is not None:
        return _tp_rank(*env, args)
    return tp.launch(args.tp, _tp_rank, args) if args.tp > 1 else serve(args)


def serve(args: argparse.Namespace, rank=None) -> int:
    """Build and run the server (under --tp: rank 0's, over its tp.LeadModel) until it is stopped."""
    import uvicorn

    from ..errors import TinyVilaError

    try:
        app, engine = build(args, None if rank is None else tp.LeadModel(load_model(args, rank), rank))
    except (TinyVilaError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without an API key: anyone who reaches it can use it", file=sys.stderr)
    print(f"serving {args.model} at http://{args.host}:{args.port} (web page at /, API at /v1)", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
