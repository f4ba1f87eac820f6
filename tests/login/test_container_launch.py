"""site.container (issue #27, item 4): OLCF runs ROCm vLLM in Apptainer images, CUDA clusters run
enroot images through pyxis. The script runs every Python step inside the image (the launch, the
packed environment's unpack, the model copy, the /dev/shm sweep) with the run directory, node-local
storage and the site's binds; values are quoted; mistakes are refused at render in one line naming
the field. The testbed runs it: tests/e2e/test_e2e_slurm.py (the staged environment and model)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

SIF = "/lustre/orion/abc123/vllm-rocm.sif"
FRONTIER = ["--site", "frontier", "-A", "abc123", "-N", "2", f"site.container.image={SIF}", "site.python=python3"]


def _render(hpcrl, *args) -> tuple[Path, str]:
    r = hpcrl("render", *args)
    assert r.returncode == 0, r.stderr
    run_dir = Path(r.stdout.splitlines()[0].split(":", 1)[1].strip())
    subprocess.run(["bash", "-n", str(run_dir / "job.sbatch")], check=True)
    return run_dir, (run_dir / "job.sbatch").read_text()


def _model(tmp_path) -> Path:
    """A model directory as render's checks want it (hpcrl.login.inputs), without weights."""
    model = tmp_path / "shared" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, '
                                       '"vocab_size": 128, "num_attention_heads": 4}')
    (model / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (model / "tokenizer.json").write_text("{}")
    return model


def _container_words(script: str) -> list[str]:
    """The HPCRL_CONTAINER array as bash splits it ($VARIABLES left as written)."""
    line = next(l for l in script.splitlines() if l.startswith("HPCRL_CONTAINER=("))
    return shlex.split(line[len("HPCRL_CONTAINER=("):-1])


def test_frontier_runs_every_python_step_in_the_apptainer_image(hpcrl):
    _, script = _render(hpcrl, *FRONTIER, "site.stage.python_env=/lustre/orion/abc123/env.tar.gz",
                        "site.container.net_plugin_dir=/opt/rccl-net-plugin/lib")
    assert _container_words(script) == [
        "apptainer", "exec", "--rocm", "--pwd", "$HPCRL_RUN_DIR", "--bind", "$HPCRL_RUN_DIR",
        "--bind", "/lustre/orion", "--bind", "/mnt/bb/$USER", "--bind", "/opt/rccl-net-plugin/lib", SIF]
    launch = next(l for l in script.replace("\\\n", " ").splitlines() if l.startswith("srun --kill-on-bad-exit"))
    assert launch.split("--gpu-bind=none", 1)[1].split() == \
        ['"${HPCRL_CONTAINER[@]}"', '"$HPCRL_PYTHON"', "-u", "-m", "hpcrl.compute.launch", '"$HPCRL_RUN_DIR"', "&"]
    # The unpack's lock is the host's (flock), its tar the image's.
    for step in ('flock -w 900 -E 75 "$HPCRL_ENV_DEST.lock" "${HPCRL_CONTAINER[@]}" bash -c "$HPCRL_ENV_UNPACK"',
                 '"${HPCRL_CONTAINER[@]}" "$HPCRL_PYTHON" -m hpcrl.compute.launch.shm_sweep'):
        assert f'hpcrl_each_node {step}' in script, step
    # Host-side steps stay outside: sbcast and the directories they fill.
    assert 'hpcrl_each_node mkdir -p "${HPCRL_ENV_DEST%/*}"' in script


def test_pyxis_is_srun_options_before_the_program(hpcrl):
    _, script = _render(hpcrl, "--site", "cuda", "-N", "2", "site.container.image=nvcr.io#nvidia/pytorch:25.01-py3",
                        "site.python=python3", "site.container.binds=[/scratch, /scratch/models]",
                        "site.container.options=[--no-container-mount-home]")
    assert _container_words(script) == [
        "--container-image=nvcr.io#nvidia/pytorch:25.01-py3",
        # /scratch/models is inside /scratch; the kernel cache's node-local copy (site.stage.kernel_cache) is bound
        "--container-mounts=$HPCRL_RUN_DIR:$HPCRL_RUN_DIR,/scratch:/scratch,/tmp/hpcrl-kernels-$USER:/tmp/hpcrl-kernels-$USER",
        "--container-workdir=$HPCRL_RUN_DIR", "--no-container-mount-home"]
    assert 'hpcrl_each_node "${HPCRL_CONTAINER[@]}" "$HPCRL_PYTHON" -m hpcrl.compute.launch.shm_sweep' in script
    assert '  "${HPCRL_CONTAINER[@]}" "$HPCRL_PYTHON" -u -m hpcrl.compute.launch' in script


def test_without_a_container_the_script_has_none(hpcrl):
    _, script = _render(hpcrl, "--site", "frontier", "-A", "abc123")
    assert "HPCRL_CONTAINER" not in script and "apptainer" not in script


def test_values_are_quoted_and_variables_expand_only_in_binds(hpcrl, tmp_path):
    odd = "/lustre/orion/my images/v$(touch pwned).sif"
    run_dir, script = _render(hpcrl, "--site", "frontier", "-A", "abc123", f"site.container.image={odd}",
                              "site.python=python3", "site.container.options=[--env=A=$(id)]")
    words = _container_words(script)
    assert words[-1] == odd and "--env=A=$(id)" in words        # literal: single-quoted
    assert "'/lustre/orion/my images/v$(touch pwned).sif'" in script
    assert '--bind "/mnt/bb/$USER"' in script                             # expands in the job's shell
    # bash hands the runtime these words, and runs nothing of the user's
    line = next(l for l in script.splitlines() if l.startswith("HPCRL_CONTAINER="))
    out = subprocess.run(["bash", "-c", f'HPCRL_RUN_DIR=/run USER=me\n{line}\nprintf "%s\\n" "${{HPCRL_CONTAINER[@]}}"'],
                         capture_output=True, text=True, cwd=tmp_path, check=True).stdout.splitlines()
    assert out[out.index("--pwd") + 1] == "/run" and "/mnt/bb/me" in out and out[-1] == odd
    assert not (tmp_path / "pwned").exists()


def test_a_model_copied_on_each_node_gets_its_directory_made_then_bound(hpcrl, tmp_path):
    model = _model(tmp_path)
    _, script = _render(hpcrl, "--site", "testbed", "site.container.image=/images/x.sif", "site.python=python3",
                        f"model.path={model}", "site.stage.model_via=srun", "site.stage.model_dest=/local/hpcrl/model",
                        "grpo.max_steps=1")
    assert _container_words(script)[-3:] == ["--bind", "/local/hpcrl", "/images/x.sif"]
    make = script.index('HPCRL_MODEL_PARENT=/local/hpcrl\nhpcrl_each_node mkdir -p "$HPCRL_MODEL_PARENT"')
    assert make < script.index('hpcrl_each_node "${HPCRL_CONTAINER[@]}" "$HPCRL_PYTHON" -m hpcrl.compute.stage')


@pytest.mark.parametrize("overrides, said", [
    (["site.container.runtime=docker"], "site.container.runtime: expected one of 'apptainer', 'singularity', 'pyxis', "
                                      "got 'docker'"),
    (["site.container.binds=[relative/dir]"], "site.container.binds[0]: 'relative/dir' is not a directory to bind"),
    (["site.container.binds=[/a:/b]"], "site.container.binds[0]: '/a:/b' is not a directory to bind"),
    (["site.container.net_plugin_dir=/x/$(id)"], "site.container.net_plugin_dir: '/x/$(id)' is not a directory to bind"),
    (["site.container.options=[--bind /x]"], "site.container.options[0]: '--bind /x' is not one option word"),
    (["site.container.options=[exec]"], "site.container.options[0]: 'exec' is not one option word"),
    (["site.python=auto"], "site.python: the tasks run inside /images/x.sif, where the interpreter hpcrl runs from "
                         "here (python = \"auto\") is not"),
    (["site.launcher=mpiexec", "site.container.runtime=pyxis"], "site.container.runtime: pyxis is a plugin of srun"),
])
def test_container_mistakes_are_refused_in_one_line(hpcrl, tmp_path, overrides, said):
    r = hpcrl("render", "--site", "testbed", "site.container.image=/images/x.sif", "site.python=python3",
              *overrides, "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_a_bind_that_names_the_node_is_refused(hpcrl, tmp_path):
    model = _model(tmp_path)
    r = hpcrl("render", "--site", "testbed", "site.container.image=/images/x.sif", "site.python=python3",
              f"model.path={model}", "site.stage.model_via=srun", "site.stage.model_dest=/local/$SLURMD_NODENAME/model",
              "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "site.stage.model_dest: its directory /local/$SLURMD_NODENAME names the node" in r.stderr


def test_hpcrl_run_refuses_a_container(hpcrl):
    r = hpcrl("run", "--site", "local", "site.container.image=/images/x.sif", "site.python=python3")
    assert r.returncode == 2 and "site.container.image: `hpcrl run` starts its tasks through mpiexec" in r.stderr


def test_sites_says_the_tasks_run_in_the_image(hpcrl, tmp_path):
    r = hpcrl("sites", "frontier")
    assert r.returncode == 0 and re.search(r'"binds": \[\s*"/lustre/orion",\s*"/mnt/bb/\$USER"', r.stdout)
    mine = tmp_path / "xdg" / "hpcrl" / "sites"
    mine.mkdir(parents=True)
    (mine / "frontier.toml").write_text(f'python = "python3"\n[container]\nimage = "{SIF}"\n')
    r = hpcrl("sites", "frontier", env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert f"tasks run: python3 inside {SIF} (apptainer, site.container)" in r.stderr, r.stderr


def test_a_recipe_names_its_own_image(hpcrl, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("site:\n  python: python3\n  container: {image: /lustre/orion/abc123/other.sif, "
                      "options: [--cleanenv]}\n")
    _, script = _render(hpcrl, "--site", "frontier", "-A", "abc123", str(recipe))
    assert _container_words(script)[-2:] == ["--cleanenv", "/lustre/orion/abc123/other.sif"]
