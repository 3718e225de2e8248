"""scripts/bench.py runs end to end on CPU on a tiny model (so the script never rots)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("pipelines", ["fp16,quant,sparse", "hf,fp16"])
def test_bench_runs_every_pipeline_and_reports_json(pipelines, capsys):
    if "hf" in pipelines:
        pytest.importorskip("transformers")
    bench = load_bench()
    rc = bench.main(["--preset", "tiny-siglip-llama", "--device", "cpu", "--rounds", "2", "--new-tokens", "3",
                     "--group-size", "32", "--pipelines", pipelines, "--prefill-keep", "0.5", "--decode-keep", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out.strip().splitlines()[-1])
    rows = {r["pipeline"]: r for r in report["rows"]}
    assert list(rows) == pipelines.split(",")
    for r in rows.values():
        assert r["decode_tokens"] == 2 * 3  # exactly --new-tokens per round, stop tokens ignored
        assert r["e2e_ms"] > 0 and r["prefill_tokens"] > 0
    if "sparse" in rows:  # prefill pruning keeps half of the 16 visual tokens
        assert rows["sparse"]["prefill_tokens"] < rows["quant"]["prefill_tokens"]
