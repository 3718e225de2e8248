"""scripts/bench.py runs end to end on CPU on a tiny model (so the script never rots), in each of its
modes: image conversation, decode at a given context, video with the KV cache sized to fit."""

import dataclasses
import importlib.util
import json

import pytest

from scripts import bench
from scripts.benches import cost_model as cm
from tinyvila.config import preset
from tinyvila.options import Options

TINY = ["--preset", "tiny-siglip-llama", "--device", "cpu", "--group-size", "32"]


def run_bench(argv, capsys) -> tuple[dict, str]:
    rc = bench.main(TINY + argv)
    out = capsys.readouterr().out
    assert rc == 0
    return json.loads(out.strip().splitlines()[-1]), out


def has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def test_image_conversation_every_pipeline(capsys):
    pipelines = ["hf", "fp16", "quant", "sparse"] if has_transformers() else ["fp16", "quant", "sparse"]
    report, out = run_bench(["--rounds", "2", "--new-tokens", "3", "--pipelines", ",".join(pipelines),
                             "--prefill-keep", "0.5", "--decode-keep", "0.5"], capsys)
    rows = {r["pipeline"]: r for r in report["rows"]}
    assert list(rows) == pipelines
    for r in rows.values():
        assert r["decode_tokens"] == 2 * 3  # exactly --new-tokens per round, stop tokens ignored
        assert r["e2e_ms"] == pytest.approx(r["encode_ms"] + r["prefill_ms"] + r["decode_ms"])
        first = r["turns"][0]
        assert r["ttft_ms"] == pytest.approx(first["encode_ms"] + first["prefill_ms"] + first["first_token_ms"])
        assert 0 < r["ttft_ms"] < r["e2e_ms"] and r["floor_tok_s"] > 0 and r["of_floor"] > 0
        second = r["turns"][1]  # the follow-up TTFT column: the median over rounds 2.. (one here)
        assert r["followup_ttft_ms"] == pytest.approx(second["encode_ms"] + second["prefill_ms"] +
                                                      second["first_token_ms"])
    assert "follow-up TTFT ms" in out
    # Prefill pruning keeps half of the 16 visual tokens; decode attends over fewer rows than the cache.
    assert rows["sparse"]["visual"] == "8/16" and rows["quant"]["visual"] == "16/16"
    assert rows["sparse"]["prefill_tokens"] == rows["quant"]["prefill_tokens"] - 8
    assert 0 < rows["sparse"]["decode_rows"] < rows["sparse"]["context_tokens"] - 3
    s = report["sparse_vs_dense"]
    assert s["dense"] == "quant" and s["prefill_pred_flops"] > 1 and s["decode_pred_bytes"] > 1
    assert "sparse over quant" in out and "FLOPs predict" in out and "bytes predict" in out
    assert any("TTFT" in t["what"] for t in report["targets"])
    assert report["gpu"] == "cpu" and report["commit"] and "triton" in report
    if "hf" in rows:  # HF re-prefills the image and question every round; tinyvila prefills it once
        assert rows["hf"]["prefill_tokens"] == 2 * rows["fp16"]["turns"][0]["prefill_tokens"]
        assert any(t["what"] == "quant end to end over hf" for t in report["targets"])


def test_decode_mode_counts_the_bytes_each_step_reads(capsys):
    pipelines = "hf,quant" if has_transformers() else "quant"
    report, out = run_bench(["--decode-context", "300", "--new-tokens", "6", "--pipelines", pipelines,
                             "--repeats", "3"], capsys)
    row = report["rows"][-1]
    # Three measured runs: the row is the median one by end to end, its TTFT the median TTFT.
    runs = row["e2e_runs_ms"]
    assert report["repeats"] == 3 and len(runs) == 3 and runs == sorted(runs)
    assert row["e2e_ms"] == pytest.approx(runs[1]) and row["ttft_ms"] == row["ttft_runs_ms"][1]
    assert row["pipeline"] == "quant" and row["prefill_tokens"] == 300  # the byte tokenizer hits it exactly
    assert row["visual"] == "-" and row["context_tokens"] == 306
    # 5 decode steps (the first token comes from the prefill); step j attends over 300 + j rows.
    cfg = bench.pipeline_config(preset("tiny-siglip-llama"), "quant", bench.parse_args(TINY))
    W, kv = cm.decode_weight_bytes(cfg), cm.kv_row_bytes(cfg)
    assert row["decode_gb"] * 1e9 == pytest.approx(5 * W + kv * sum(300 + j for j in range(1, 6)))
    floor = row["floor_tok_s"]
    assert floor == pytest.approx(report["copy_gbs"] * 1e9 / (row["decode_gb"] * 1e9 / 5))
    assert row["of_floor"] == pytest.approx(row["step_tok_s"] / floor)
    assert "of bandwidth floor" in out and "floor tok/s" in out
    if "hf" in pipelines:
        assert any(t["what"] == "quant decode tok/s over hf" for t in report["targets"])


def test_video_conversation_sizes_the_cache_to_fit(capsys):
    # 36 frames x 16 tokens = 576 visual tokens: more than the preset's 512-token context.
    report, _ = run_bench(["--frames", "36", "--rounds", "2", "--new-tokens", "3", "--prefill-keep", "0.25",
                           "--decode-keep", "0.25", "--warmup", "short"], capsys)
    assert report["max_seq_len"] > 576 + 2 * 3 and report["max_seq_len"] % 256 == 0
    rows = {r["pipeline"]: r for r in report["rows"]}
    assert list(rows) == ["quant", "sparse"]  # the video default: no HF
    assert rows["quant"]["visual"] == "576/576" and rows["sparse"]["visual"] == "144/576"
    assert rows["quant"]["context_tokens"] > preset("tiny-siglip-llama").text.max_seq_len
    s = report["sparse_vs_dense"]
    assert s["prefill_pred_flops"] > 2 and s["decode_pred_bytes"] > 1


def test_options_flag_reaches_the_models_and_the_report(capsys):
    report, _ = run_bench(["--decode-context", "40", "--new-tokens", "3", "--pipelines", "quant", "--warmup", "short",
                           "--options", "cuda_graph=0,fused_silu=off"], capsys)
    assert report["options"] == dataclasses.asdict(Options.from_env().with_(cuda_graph=False, fused_silu=False))
    assert report["rows"][0]["decode_tokens"] == 3
    for bad in ("cuda_graph=maybe", "no_such_option=1", "pdl"):
        with pytest.raises(SystemExit):
            bench.parse_args(TINY + ["--options", bad])


@pytest.mark.gpu
def test_on_cuda_the_warmup_leaves_nothing_to_compile_and_peaks_are_per_pipeline(capsys):
    pipelines = "hf,fp16,quant,sparse" if has_transformers() else "fp16,quant,sparse"
    rc = bench.main(["--preset", "tiny-siglip-llama", "--dtype", "float16", "--device", "cuda",
                     "--group-size", "32", "--rounds", "3",
                     "--new-tokens", "20", "--pipelines", pipelines, "--prefill-keep", "0.5",
                     "--decode-keep", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["gpu"] != "cpu" and report["copy_gbs"] > 100
    for r in report["rows"]:
        assert r["first_use"] == 0, f"{r['pipeline']}: the measured run compiled or autotuned"
        assert r["resident_gb_before"] < 0.1 and r["peak_gb"] > 0
    assert "WARNING" not in out


def test_cpu_bench_runs_each_pipeline_and_reports_json(capsys):
    """scripts/bench_cpu.py at one layer: every pipeline answers and lands in the JSON line (timings not asserted:
    they are the bench's job on a quiet machine, docs/benchmarks.md)."""
    from scripts import bench_cpu

    assert bench_cpu.main(["--layers", "1", "--new-tokens", "3", "--repeats", "1"]) == 0  # fp16: w4 takes the int4 form
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["pipeline"] for r in out["rows"]] == ["dense", "w4", "w4+ref", "w4+cache"]
    assert all(r["decode_tok_s"] > 0 and len(r["runs_tok_s"]) == 1 for r in out["rows"])


def test_load_bench_times_both_ways(capsys, tmp_path):
    from scripts import bench_load

    assert bench_load.main(["--preset", "tiny-siglip-llama", "--device", "cpu", "--repeats", "1",
                            "--dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["load_ms"] > 0 and out["load_verify_ms"] > 0 and out["weights_gb"] > 0
    assert not any(tmp_path.iterdir())  # the temporary checkpoint is gone
