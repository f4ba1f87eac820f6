"""Issue #27, items 9 and 5 (its cache part): the site's fabric and caches in the rendered script.

  - site.nccl.socket_ifname / ib_hca exported as NCCL_SOCKET_IFNAME / NCCL_IB_HCA, quoted; a bad value is
    one line naming the field, from a site file as from key=value
  - CUDA_DEVICE_ORDER=PCI_BUS_ID on every NVIDIA site (the core map follows the PCI order)
  - site.hf_home: HF_HOME never under $HOME ("auto": the shell's own outside $HOME, else beside the run
    directory; the hub cache the login node checked stays the job's)
  - the cuda site stages the model to node-local storage
  - site.stage.kernel_cache: a persistent kernel cache copied to node-local storage at stage time and
    the new kernels copied back at the end, best effort (the script's own lines run here with stand-ins
    for srun and sbcast)
  - MPI's world of one under an srun of many tasks (Open MPI with --mpi=pmi2) is named, with the fix;
    a forced launch.rendezvous=mpi fails on it, and only on it
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hpcrl.job.errors import UserError
from hpcrl.login import profiles
from hpcrl.login.compose import compose, resource_flags
from hpcrl.login.render import render_sbatch


def _spec(tmp_path, site: str, *assignments: str, name: str = "run"):
    flags = resource_flags(nodes=2, time="01:00:00", account="abc123" if site == "frontier" else None)
    return compose(None, site, list(assignments), flags, run_dir=str(tmp_path / "runs" / name))


def _exports(script: str) -> dict[str, str]:
    return dict(re.findall(r"^export ([A-Z_][A-Z0-9_]*)=(.*)$", script, re.M))


# ------------------------------------------------------------------------------------------ NCCL
def test_nccl_fields_are_exported_quoted(tmp_path):
    spec = _spec(tmp_path, "cuda", "site.nccl.socket_ifname=^docker,lo", "site.nccl.ib_hca=mlx5_0:1,mlx5_1:1")
    exports = _exports(render_sbatch(spec))
    assert exports["NCCL_SOCKET_IFNAME"] == "'^docker,lo'"          # quoted: one literal word
    assert exports["NCCL_IB_HCA"] == "mlx5_0:1,mlx5_1:1"
    assert spec.site.nccl.socket_ifname == "^docker,lo"


def test_unset_nccl_fields_leave_nccl_its_choice(tmp_path):
    exports = _exports(render_sbatch(_spec(tmp_path, "cuda")))
    assert "NCCL_SOCKET_IFNAME" not in exports and "NCCL_IB_HCA" not in exports


def test_frontier_names_its_slingshot_interfaces_in_its_nccl_table(tmp_path):
    assert profiles.load("frontier").nccl.socket_ifname == "hsn0,hsn1,hsn2,hsn3"
    assert _exports(render_sbatch(_spec(tmp_path, "frontier")))["NCCL_SOCKET_IFNAME"] == "hsn0,hsn1,hsn2,hsn3"


def test_the_sites_env_wins_over_its_nccl_table(tmp_path):
    spec = _spec(tmp_path, "frontier", "site.env.NCCL_SOCKET_IFNAME=hsn0")
    assert _exports(render_sbatch(spec))["NCCL_SOCKET_IFNAME"] == "hsn0"


@pytest.mark.parametrize("field, value", [
    ("socket_ifname", "eth0; touch pwned"), ("socket_ifname", "ib0 ib1"), ("socket_ifname", "$(id)"),
    ("socket_ifname", "eth0,"), ("ib_hca", "mlx5_0:one"), ("ib_hca", "mlx5 0"), ("ib_hca", "mlx5_0|x"),
])
def test_a_bad_nccl_value_is_one_line_naming_the_field(hpcrl, field, value):
    r = hpcrl("render", "--site", "cuda", f"site.nccl.{field}={value}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"hpcrl: error: site.nccl.{field}: ") and r.stderr.count("\n") == 1, r.stderr
    assert not (hpcrl.work / "runs").exists()           # nothing written


def test_a_bad_nccl_value_in_a_site_file_is_refused_as_data(hpcrl, tmp_path):
    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "mycluster.toml").write_text('extends = "cuda"\n[nccl]\nib_hca = "mlx5_0 mlx5_1"\n')
    r = hpcrl("render", "--site", "mycluster", env={"HPCRL_SITES_PATH": str(sites)})
    assert r.returncode == 2 and r.stderr.startswith("hpcrl: error: site.nccl.ib_hca: 'mlx5_0 mlx5_1' is not"), r.stderr
    (sites / "mycluster.toml").write_text('extends = "cuda"\n[nccl]\nsocket_ifname = "ib0"\nib_hca = "=mlx5_0"\n')
    r = hpcrl("render", "--site", "mycluster", env={"HPCRL_SITES_PATH": str(sites)})
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------ GPU order
@pytest.mark.parametrize("site", ["cuda", "testbed"])
def test_nvidia_sites_number_gpus_in_pci_order(tmp_path, site):
    assert _exports(render_sbatch(_spec(tmp_path, site)))["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_a_site_extending_cuda_keeps_pci_order_whatever_its_env(hpcrl, tmp_path):
    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "mine.toml").write_text('extends = "cuda"\ngpu_vendor = "nvidia"\n[env]\nNCCL_DEBUG = "INFO"\n')
    r = hpcrl("render", "--site", "mine", env={"HPCRL_SITES_PATH": str(sites)})
    assert r.returncode == 0, r.stderr
    run_dir = Path(r.stdout.splitlines()[0].split(":", 1)[1].strip())
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID\n" in (run_dir / "job.sbatch").read_text()


def test_amd_sites_get_no_cuda_device_order(tmp_path):
    assert "CUDA_DEVICE_ORDER" not in _exports(render_sbatch(_spec(tmp_path, "frontier")))


# ---------------------------------------------------------------------------------------- HF_HOME
def test_cuda_hf_home_auto_goes_beside_the_run_directory_and_keeps_the_checked_hub_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "login-hub"))
    spec = _spec(tmp_path, "cuda")
    exports = _exports(render_sbatch(spec))
    assert exports["HF_HOME"] == str(tmp_path / "runs" / ".hf-home")
    assert exports["HF_HUB_CACHE"] == str(tmp_path / "login-hub")
    # job.json holds the concrete path: a resubmission runs with the same caches.
    saved = json.loads((spec.to_json()))["site"]
    assert saved["hf_home"] == str(tmp_path / "runs" / ".hf-home")


def test_hf_home_auto_takes_the_shells_own_outside_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "scratch" / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    exports = _exports(render_sbatch(_spec(tmp_path, "cuda")))
    assert exports["HF_HOME"] == str(tmp_path / "scratch" / "hf") and "HF_HUB_CACHE" not in exports


def test_hf_home_auto_never_lands_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / ".cache" / "huggingface"))      # under $HOME: not taken
    with pytest.raises(UserError, match=r"^site\.hf_home: \"auto\" found no place outside \$HOME"):
        _spec(tmp_path, "cuda")
    spec = _spec(tmp_path, "cuda", "site.hf_home=/scratch/$USER/hf", name="run2")
    assert _exports(render_sbatch(spec))["HF_HOME"] == '"/scratch/$USER/hf"'


@pytest.mark.parametrize("value", ["$HOME/hf", "~/hf", "${HOME}/.cache/hf"])
def test_hf_home_under_home_is_refused(hpcrl, value):
    r = hpcrl("render", "--site", "cuda", f"site.hf_home={value}")
    assert r.returncode == 2 and r.stderr.startswith("hpcrl: error: site.hf_home: ") and "under $HOME" in r.stderr, r.stderr


def test_hf_home_is_quoted(hpcrl):
    r = hpcrl("render", "--site", "cuda", "site.hf_home=/scratch/a b/$(id)")
    assert r.returncode == 2 and r.stderr.startswith("hpcrl: error: site.hf_home: "), r.stderr


def test_a_sites_own_hf_home_in_env_wins_over_auto(tmp_path):
    spec = _spec(tmp_path, "cuda", "site.env.HF_HOME=/lscratch/$USER/hf")
    exports = _exports(render_sbatch(spec))
    assert exports["HF_HOME"] == '"/lscratch/$USER/hf"' and "HF_HUB_CACHE" not in exports


# --------------------------------------------------------------------------------- model staging
def test_cuda_stages_the_model_to_node_local_storage(tmp_path):
    stage = profiles.load("cuda").stage
    assert stage.model_dest.startswith("/tmp/") and stage.model_via == "sbcast"
    # A model path only the compute nodes see (its top directory is absent here) is staged as given.
    spec = _spec(tmp_path, "cuda", "model.path=/cluster-only/models/tiny")
    script = render_sbatch(spec)
    assert spec.model_source == "/cluster-only/models/tiny"
    assert "HPCRL_MODEL_SRC=/cluster-only/models/tiny\n" in script
    assert 'HPCRL_MODEL_DEST="/tmp/hpcrl-model-$USER"\n' in script


# ---------------------------------------------------------------------------------- kernel cache
def test_kernel_cache_variables_point_into_the_node_local_copy(tmp_path):
    frontier = _exports(render_sbatch(_spec(tmp_path, "frontier")))
    for key, sub in (("TRITON_CACHE_DIR", "triton"), ("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                     ("MIOPEN_USER_DB_PATH", "miopen"), ("MIOPEN_CUSTOM_CACHE_DIR", "miopen")):
        assert frontier[key] == f'"/mnt/bb/$USER/kernels/{sub}"', key
    cuda = _exports(render_sbatch(_spec(tmp_path, "cuda", name="run2")))
    assert cuda["TRITON_CACHE_DIR"] == '"/tmp/hpcrl-kernels-$USER/triton"' and "MIOPEN_USER_DB_PATH" not in cuda


def test_without_a_kernel_cache_the_sites_env_keeps_its_caches(tmp_path):
    spec = _spec(tmp_path, "frontier", "site.stage.kernel_cache=")
    script = render_sbatch(spec)
    assert _exports(script)["TRITON_CACHE_DIR"] == '"/mnt/bb/$USER/triton"'
    assert "HPCRL_KERNEL_CACHE" not in script


def test_kernel_cache_auto_is_beside_the_run_directory(tmp_path):
    spec = _spec(tmp_path, "frontier")
    assert spec.site.stage.kernel_cache == str(tmp_path / "runs" / ".kernel-cache")
    assert f"HPCRL_KERNEL_CACHE={tmp_path / 'runs' / '.kernel-cache'}\n" in render_sbatch(spec)


@pytest.mark.parametrize("field, value", [("kernel_cache", "relative/dir"), ("kernel_cache", "/a b"),
                                          ("kernel_cache_dest", "/tmp/$(id)")])
def test_a_bad_kernel_cache_path_is_one_line_naming_the_field(hpcrl, field, value):
    r = hpcrl("render", "--site", "cuda", f"site.stage.{field}={value}")
    assert r.returncode == 2 and r.stderr.startswith(f"hpcrl: error: site.stage.{field}: "), r.stderr


def _script_part(script: str, start: str, end: str) -> str:
    i = script.index(start)
    return script[i:script.index(end, i) + len(end)]


STAND_INS = """
set -euo pipefail
hpcrl_each_node() { "$@"; }          # one node: this machine
sbcast() { [ -z "${SBCAST_FAILS:-}" ] || return 1; cp "$2" "$3"; }
"""


def _run_bash(text: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", STAND_INS + text], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=60)


def _kernel_cache_lines(tmp_path):
    """(the shared cache, its node-local copy, the script's stage-in lines, its copy-back lines)."""
    cache, dest = tmp_path / "shared" / "kernels", tmp_path / "local" / "kernels"
    spec = _spec(tmp_path, "cuda", f"site.stage.kernel_cache={cache}", f"site.stage.kernel_cache_dest={dest}")
    script = render_sbatch(spec)
    stage_in = _script_part(script, "HPCRL_KERNEL_CACHE=", 'rm -f "$HPCRL_KERNEL_DEST.pack"\n')
    copy_back = _script_part(script, '{ tar -cf - -C "$HPCRL_KERNEL_DEST"', "kernel cache $HPCRL_KERNEL_CACHE\" >&2\n")
    return cache, dest, stage_in, copy_back


def test_the_kernel_cache_is_copied_in_at_stage_time_and_new_kernels_back_at_the_end(tmp_path):
    cache, dest, stage_in, copy_back = _kernel_cache_lines(tmp_path)
    (cache / "triton" / "abc").mkdir(parents=True)
    (cache / "triton" / "abc" / "k.json").write_text("old")
    r = _run_bash(stage_in + "echo staged", {})
    assert r.returncode == 0 and r.stdout == "staged\n", r.stderr
    assert (dest / "triton" / "abc" / "k.json").read_text() == "old"
    assert not list(dest.parent.glob("*.pack")) and not list(dest.parent.glob("*.tar"))
    # The job compiles a new kernel, and rewrites one the cache has: the new one goes back, the old stays.
    (dest / "vllm" / "torch_compile_cache").mkdir(parents=True)
    (dest / "vllm" / "torch_compile_cache" / "graph.py").write_text("new")
    (dest / "triton" / "abc" / "k.json").write_text("rewritten")
    r = _run_bash(stage_in.split("\n{", 1)[0] + "\n" + copy_back + "echo kept", {})
    assert r.returncode == 0 and r.stdout == "kept\n", r.stderr
    assert (cache / "vllm" / "torch_compile_cache" / "graph.py").read_text() == "new"
    assert (cache / "triton" / "abc" / "k.json").read_text() == "old"


@pytest.mark.slurm
def test_the_kernel_cache_goes_through_a_real_job_on_the_testbed(testbed, hpcrl, tmp_path):
    """The same lines in a real 2-node job: sbcast to every node, the tasks' cache variables pointing
    into the copy, and a kernel the nodes' copy holds that the cache lacks goes back at the end."""
    import time

    cache, dest = tmp_path / "shared" / "kernels", tmp_path / "local" / "kernels"
    (cache / "triton").mkdir(parents=True)
    (cache / "triton" / "old.json").write_text("old")
    (dest / "vllm").mkdir(parents=True)                     # what a job compiled: the copy-back finds it
    (dest / "vllm" / "new.py").write_text("new")
    r = hpcrl("submit", "--site", "testbed", "-N", "2", "-t", "5", "mode=control",
              f"site.stage.kernel_cache={cache}", f"site.stage.kernel_cache_dest={dest}")
    assert r.returncode == 0, r.stderr
    job_id, run_dir = r.stdout.strip(), Path(r.stderr.rsplit("run directory ", 1)[1].strip())
    deadline = time.monotonic() + 240
    while (state := json.loads(hpcrl("status", job_id, "--json").stdout)["state"]) not in (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
        assert time.monotonic() < deadline, f"job {job_id} still {state} after 240 s"
        time.sleep(2)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "kernel cache" not in log, log[-3000:]             # neither copy warned
    assert (dest / "triton" / "old.json").read_text() == "old"
    assert (cache / "vllm" / "new.py").read_text() == "new"
    assert f"export TRITON_CACHE_DIR={dest}/triton" in (run_dir / "job.sbatch").read_text()


def test_a_failed_kernel_cache_copy_never_fails_the_job(tmp_path):
    cache, dest, stage_in, copy_back = _kernel_cache_lines(tmp_path)
    r = _run_bash(stage_in + "echo went-on", {"SBCAST_FAILS": "1"})
    assert r.returncode == 0 and r.stdout == "went-on\n", r.stderr
    assert "was not copied to every node; their kernels compile anew" in r.stderr
    # The shared cache cannot take the new kernels (here: it is a file, not a directory).
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "x").write_text("new")
    (tmp_path / "not-a-dir").write_text("")
    r = _run_bash(stage_in.split("\n{", 1)[0] + f"\nHPCRL_KERNEL_CACHE={tmp_path / 'not-a-dir'}\n" + copy_back
                  + "echo went-on", {})
    assert r.returncode == 0 and r.stdout == "went-on\n", r.stderr
    assert "not every new kernel went back to the kernel cache" in r.stderr


def test_a_container_binds_the_kernel_caches_node_local_copy(tmp_path):
    spec = _spec(tmp_path, "cuda", "site.container.image=nvcr.io#nvidia/pytorch:25.01-py3", "site.python=python3")
    script = render_sbatch(spec)
    assert "/tmp/hpcrl-kernels-$USER:/tmp/hpcrl-kernels-$USER" in script.split("HPCRL_CONTAINER=(", 1)[1].split("\n")[0]


def test_the_login_side_knows_the_job_env_without_heavy_imports():
    code = ("import sys; import hpcrl.login.job_env, hpcrl.login.render; "
            "print(sorted(m for m in ('torch', 'vllm', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------ MPI world of one
SLURM_ENV = {"SLURM_PROCID": "5", "SLURM_NODEID": "1", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
             "SLURM_JOB_ID": "42", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
             "SLURM_STEP_NUM_NODES": "2", "SLURMD_NODENAME": "n2", "PMI_FD": "7"}


@pytest.fixture
def mpi_world_of(monkeypatch):
    """mpi4py importable, and MPI_Init giving each task the world size asked for."""
    from hpcrl.compute.launch import rendezvous

    fake = types.ModuleType("mpi4py")
    fake.MPI = types.ModuleType("mpi4py.MPI")
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake.MPI)

    def world(size: int):
        ident = rendezvous.Identity(rank=0, size=size, node=0, local_rank=0, local_size=size, nodes=1,
                                    host="h", node_name="n2", source="mpi")
        monkeypatch.setattr(rendezvous, "mpi_identity", lambda environ, fake=0: (ident, "WORLD", "NODE"))
        return rendezvous
    return world


def test_a_world_of_one_under_an_srun_of_many_is_named_with_the_fix(mpi_world_of):
    rendezvous = mpi_world_of(1)
    ident, world, _, note = rendezvous.discover(SLURM_ENV)
    assert (ident.rank, ident.size, ident.source, world) == (5, 8, "slurm", None)
    assert note.startswith("MPI sees a world of 1 but Slurm started 8 tasks (srun --mpi=pmi2 does not match")
    assert "--mpi=pmix for Open MPI" in note and "site.srun_options" in note and "\n" not in note


def test_a_forced_mpi_rendezvous_fails_on_a_world_of_one(mpi_world_of):
    rendezvous = mpi_world_of(1)
    with pytest.raises(rendezvous.LaunchError, match=r"^launch\.rendezvous=mpi but MPI sees a world of 1 but Slurm "
                                                     r"started 8 tasks .*--mpi=pmix.*site\.srun_options"):
        rendezvous.discover(SLURM_ENV, "mpi")


@pytest.mark.parametrize("mode", ["auto", "mpi"])
def test_a_world_of_one_is_fine_where_slurm_started_one_task(mpi_world_of, mode):
    rendezvous = mpi_world_of(1)
    one = {**SLURM_ENV, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "1",
           "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_NUM_NODES": "1"}
    ident, world, _, note = rendezvous.discover(one, mode)
    assert (ident.size, ident.source, world, note) == (1, "mpi", "WORLD", "")
    ident, world, _, note = rendezvous.discover({}, mode)               # mpiexec -n 1, no Slurm
    assert (ident.size, world, note) == (1, "WORLD", "")


@pytest.mark.parametrize("mode", ["auto", "mpi"])
def test_a_whole_mpi_world_is_taken_as_it_is(mpi_world_of, mode):
    rendezvous = mpi_world_of(8)
    ident, world, _, note = rendezvous.discover(SLURM_ENV, mode)
    assert (ident.size, ident.source, world, note) == (8, "mpi", "WORLD", "")
