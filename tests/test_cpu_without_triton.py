"""The CPU runtime without Triton (a `pip install -e .` with no extras): the demo-sized models chat end to end with
`import triton` failing, and a kernel launcher called there says what to install instead of crashing somewhere
inside. Each case runs in a fresh interpreter where sys.modules["triton"] = None makes every import of triton raise.

    python -m pytest -q tests/test_cpu_without_triton.py
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import tinyvila

REPO = Path(tinyvila.__file__).resolve().parents[1]
DEMO_IMAGE = Path(tinyvila.__file__).parent / "assets" / "demo.png"

# Runs first in every child: from here on `import triton` (and triton.anything) raises ModuleNotFoundError.
NO_TRITON = "import sys\nsys.modules['triton'] = None\n"


def run_without_triton(body: str) -> dict:
    """Runs `body` (which prints one JSON line last) in a fresh interpreter without Triton; returns that JSON."""
    code = NO_TRITON + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_demo_models_chat_on_cpu_without_triton():
    out = run_without_triton(f"""
        import dataclasses, json
        import tinyvila
        from tinyvila.config import QuantConfig, preset
        from tinyvila.generate import SamplingParams

        def turn(cfg):
            chat = tinyvila.api.from_config(cfg).chat(sampling=SamplingParams(max_new_tokens=6))
            chat.add_image({str(DEMO_IMAGE)!r})
            text = "".join(chat.ask("What is in the image?"))
            return chat.stats.decode_tokens

        w4 = dataclasses.replace(preset("tiny-siglip-llama"), quant=QuantConfig(llm="w4a16", group_size=32))
        tokens = [turn("tiny-siglip-llama"), turn(w4)]
        print(json.dumps({{
            "tokens": tokens,
            "triton": sorted(k for k, v in sys.modules.items() if k.split(".")[0] == "triton" and v is not None),
            "kernels": sorted(k for k in sys.modules if k.startswith("csrc_triton.")),
        }}))
    """)
    assert all(n > 0 for n in out["tokens"]), out
    assert out["triton"] == [], f"the CPU path imported Triton: {out['triton']}"
    # The references the CPU path ran live in the kernel files: they were imported, without Triton.
    for mod in ("csrc_triton.add_rms_norm", "csrc_triton.silu_mul", "csrc_triton._common"):
        assert mod in out["kernels"], out["kernels"]


def test_kernel_launcher_without_triton_says_what_to_install():
    out = run_without_triton("""
        import json
        import torch
        from csrc_triton.quant_per_token import quant_per_token
        from csrc_triton.silu_mul import silu_mul, silu_mul_ref
        from csrc_triton.w4a16_gemv import w4a16_gemv
        x = torch.randn(2, 64, dtype=torch.half)
        ref = silu_mul_ref(x)  # the reference runs without Triton
        errors = []
        # Three ways a launcher reaches Triton: a cached Launch (silu_mul), kernel[grid] (the GEMV), the row
        # quantizers' launch sizes (triton.next_power_of_2) and then kernel[grid].
        for call in (lambda: silu_mul(x), lambda: quant_per_token(x), lambda: w4a16_gemv(
                x, torch.zeros(8, 8, dtype=torch.int32), torch.ones(8, 2, dtype=torch.half), torch.zeros(8, 2))):
            try:
                call()
                errors.append(None)
            except ImportError as e:
                errors.append(str(e))
        print(json.dumps({"ref_shape": list(ref.shape), "errors": errors}))
    """)
    assert out["ref_shape"] == [2, 32]
    for message in out["errors"]:
        assert message is not None, "a kernel launcher ran without Triton"
        assert "Triton" in message and 'pip install -e ".[gpu]"' in message, message
