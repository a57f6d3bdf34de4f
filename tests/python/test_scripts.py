"""scripts/gpu_session.sh gathers its results in the folder it is given."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_script_gathers_its_results_in_the_folder_it_is_given(tmp_path):
    import os
    import subprocess
    import tarfile

    env = {**os.environ, "MEGAMOE_OUT": str(tmp_path / "results"), "MEGAMOE_TAR": str(tmp_path / "results.tar.gz"),
           "MEGAMOE_WHEELS": str(tmp_path / "no-wheels")}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh"), "no-such-stage"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown stage no-such-stage" in run.stdout
    assert (tmp_path / "results" / "bench").is_dir()
    with tarfile.open(tmp_path / "results.tar.gz") as packed:
        assert "./bench" in packed.getnames()


def test_ncu_source_lines_reads_metrics_from_the_end_of_each_line(tmp_path, capsys, monkeypatch):
    """Nsight Compute's per-line CSV can break its quoting inside the source text; the summary reads
    each line's metrics from the end of its row, so a broken line still counts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ncu_source_lines",
                                                  ROOT / "scripts" / "experiments" / "ncu_source_lines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    csv_text = "\n".join([
        '"File Path","/src/first"',
        '"Function Name","kernel"',
        '"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
        '"stall_wait","stall_barrier"',
        '"10","x = y;","-","-","30","100","20","10"',
        '"","","0x10","FADD R1, R2, R3","30","100","20","10"',
        '"11","asm("max %0" : "=f"(r));","-","-","70","5","0","70"',
        '"File Path","/src/second"',
        '"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
        '"stall_wait","stall_barrier"',
        '"3","z;","-","-","0","0","0","0"',
    ])
    path = tmp_path / "source.csv"
    path.write_text(csv_text)
    lines = module.read_lines(path)
    assert [(file, line) for file, line, _ in lines] == [("/src/first", 10), ("/src/first", 11), ("/src/second", 3)]
    assert lines[1][2]["Warp Stall Sampling (All Samples)"] == 70.0 and lines[1][2]["stall_barrier"] == 70.0
    monkeypatch.setattr("sys.argv", ["ncu_source_lines.py", str(path), "--lines", "1"])
    module.main()
    out = capsys.readouterr().out
    assert "100.0%" in out and "first:11  barrier 100%" in out
