"""scripts/profile_decode.py: its options flags, and a CPU run on a tiny model (eager and "graph" tok/s, one
variant, the JSON line). The GPU-only part, the per-kernel profile, runs on the H200."""

import dataclasses
import json

import pytest

from scripts import profile_decode
from tinyvila.options import Options

TINY = ["--preset", "tiny-siglip-llama", "--device", "cpu", "--group-size", "32", "--context", "24",
        "--new-tokens", "4"]


def test_options_and_variants_parse_on_top_of_each_other():
    args = profile_decode.parse_args(TINY + ["--options", "pdl=0", "--variant", "fused_silu=0,dense_gemv=off",
                                             "--variant", "fused_norm_gemv=off"])
    assert args.opts == Options.from_env().with_(pdl=False)
    assert list(args.variant_opts) == ["fused_silu=0,dense_gemv=off", "fused_norm_gemv=off"]
    assert args.variant_opts["fused_silu=0,dense_gemv=off"] == args.opts.with_(fused_silu=False, dense_gemv=False)
    assert args.variant_opts["fused_norm_gemv=off"] == args.opts.with_(fused_norm_gemv="off")


@pytest.mark.parametrize("flag,value", [("--options", "pdl=maybe"), ("--variant", "no_such=1"),
                                        ("--variant", "w4_gemv_kernel=tiles"), ("--options", "pdl")])
def test_bad_options_are_rejected(flag, value):
    with pytest.raises(SystemExit):
        profile_decode.parse_args(TINY + [flag, value])


def test_cpu_run_prints_a_json_line_with_each_variant(capsys):
    assert profile_decode.main(TINY + ["--quant", "w4a16", "--variant", "fused_silu=0"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["bench"] == "profile_decode" and report["gpu"] == "cpu" and report["commit"]
    assert report["eager_tok_s"] > 0 and report["graph_tok_s"] > 0
    assert list(report["variants"]) == ["fused_silu=0"] and report["variants"]["fused_silu=0"] > 0
    assert report["options"] == dataclasses.asdict(Options.from_env())
