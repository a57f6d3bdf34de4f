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
