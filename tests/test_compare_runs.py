"""benchmarks/compare_runs.py: the rows with a torch peer, side by side across runs."""
import json

from benchmarks import compare_runs


def _run(folder, pipeline_ratio, overhead_x, commit):
    folder.mkdir()
    (folder / "pipeline.json").write_text(json.dumps([
        {"suite": "pipeline", "shape": "1f1b p2 v1 m8", "method": "torch", "speedup_paired": 1.0,
         "status": "ok", "commit": commit},
        # the pipeline's vs_torch is a ratio of medians, time over time: the paired ratio is taken
        {"suite": "pipeline", "shape": "1f1b p2 v1 m8", "method": "pyfused",
         "speedup_paired": pipeline_ratio, "vs_torch": 1 / pipeline_ratio, "status": "ok",
         "commit": commit},
    ]))
    (folder / "overhead.json").write_text(json.dumps([
        {"suite": "overhead", "op": "matmul_all_reduce", "shape": "16x256x256", "method": "unfused",
         "world_size": 1, "overhead_x": overhead_x, "status": "ok", "commit": commit},
        {"suite": "overhead", "op": "matmul_all_reduce", "shape": "16x256x256", "method": "unfused",
         "world_size": 2, "overhead_x": 9.0, "status": "ok", "commit": commit},
    ]))
    (folder / "ddp.json").write_text(json.dumps([
        {"suite": "ddp", "shape": "mlp", "method": "pyfused zero2", "vs_peer": 0.98,
         "vs_fsdp2": 1.5, "status": "ok", "commit": commit},
        {"suite": "ddp", "shape": "mlp", "method": "torch-zero1", "vs_peer": 1.0,
         "status": "ok", "commit": commit},
    ]))
    return folder


def test_rows_side_by_side_with_worst_and_spread(tmp_path):
    runs = [_run(tmp_path / "a", 1.10, 1.04, "aaa"), _run(tmp_path / "b", 0.90, 1.02, "aaa")]
    lines = compare_runs.table(runs, None).splitlines()
    assert "| pipeline | 1f1b p2 v1 m8: pyfused | 1.100 | 0.900 | 0.900 | 20.0% |" in lines
    # the overhead's worst run is its largest multiple of torch's time; world size 2 is left out
    assert ("| overhead | matmul_all_reduce 16x256x256: unfused | 1.040 | 1.020 | 1.040 | 1.9% |"
            in lines)
    assert "| ddp | mlp: pyfused zero2 (vs FSDP2) | 1.500 | 1.500 | 1.500 | 0.0% |" in lines
    assert not any("torch" in line.split("|")[2] for line in lines[2:] if line.startswith("|"))
    assert sum(line.startswith("| ") for line in lines) == 5  # header and four rows
    assert compare_runs.table(runs, ["pipeline"]).count("| pipeline |") == 1
    assert "overhead" not in compare_runs.table(runs, ["pipeline"])


def test_cells_show_the_interval_and_flag_a_losing_one(tmp_path):
    """A row that records its 95% interval shows it; ``!`` marks an interval wholly under 1.0 (a
    ratio against torch) or wholly over 1.03 (the per-call goal of overhead_x)."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "tp_mlp.json").write_text(json.dumps([
        {"suite": "tp_mlp", "shape": "s", "method": "auto", "vs_peer": 0.98, "vs_peer_lo": 0.95,
         "vs_peer_hi": 1.02, "status": "ok", "commit": "c"},
        {"suite": "tp_mlp", "shape": "s", "method": "unfused", "vs_peer": 0.95, "vs_peer_lo": 0.93,
         "vs_peer_hi": 0.97, "status": "ok", "commit": "c"},
    ]))
    (folder / "overhead.json").write_text(json.dumps([
        {"suite": "overhead", "op": "op", "shape": "x", "method": "auto", "world_size": 1,
         "overhead_x": 1.05, "overhead_x_lo": 1.04, "overhead_x_hi": 1.06, "status": "ok",
         "commit": "c"},
    ]))
    lines = compare_runs.table([folder], None).splitlines()
    assert "| tp_mlp | s: auto | 0.980 (0.95-1.02) | 0.980 | 0.0% |" in lines
    assert "| tp_mlp | s: unfused | 0.950 (0.93-0.97) ! | 0.950 | 0.0% |" in lines
    assert "| overhead | op x: auto | 1.050 (1.04-1.06) ! | 1.050 | 0.0% |" in lines
