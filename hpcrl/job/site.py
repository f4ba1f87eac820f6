"""A site profile as data: everything machine-specific, as typed dataclasses, validated when
built. Finding and merging the TOML files is the login side's (hpcrl.login.profiles); the compute
side gets the resolved Site inside the job spec."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from hpcrl.job.errors import UserError

# A value that ends up on an #SBATCH line or as a bare word in the script must be one token.
SAFE_WORD = re.compile(r"^[A-Za-z0-9_.+:=,@%/\-]+$")
# site.signal: a signal and its lead in seconds, or "auto" for hpcrl.job.signal_lead to derive it.
SIGNAL = re.compile(r"^(SIG)?[A-Z0-9]+@(\d+|auto)$")
# Slurm's --signal takes a lead of 0..65535 seconds.
SLURM_MAX_SIGNAL_LEAD_S = 65535
# A directory a container binds: absolute, or from a plain variable ($USER, ${HOME}); never ":" or
# ",", which separate binds for apptainer and pyxis, nor quotes, backslashes or `$(`.
_VAR = r"\$[A-Za-z_][A-Za-z0-9_]*|\$\{[A-Za-z_][A-Za-z0-9_]*\}"
BIND_PATH = re.compile(rf"^(?:/|{_VAR})(?:[^$`\"'\\:,\s]|{_VAR})*$")
# Control characters (a newline, a tab) would break the script's line a value lands on.
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
# NCCL's interface and HCA lists: names separated by commas, the whole list optionally prefixed by
# "^" (exclude) and/or "=" (exact names); an HCA may carry its port ("mlx5_0:1").
_NCCL_NAME = r"[A-Za-z0-9_.\-]+"
NCCL_IFNAME = re.compile(rf"^\^?=?{_NCCL_NAME}(?:,{_NCCL_NAME})*$")
NCCL_HCA = re.compile(rf"^\^?=?{_NCCL_NAME}(?::\d+)?(?:,{_NCCL_NAME}(?::\d+)?)*$")
# The user's home directory as a path is written in a site file: what "outside $HOME" refuses.
HOME_WORDS = re.compile(r"^(?:~|\$HOME\b|\$\{HOME\})")


@dataclass(frozen=True)
class WalltimeBin:
    """Jobs of up to `max_nodes` nodes may run at most `max_time` (a Slurm time string)."""
    max_nodes: int
    max_time: str


@dataclass(frozen=True)
class Partition:
    max_nodes: Optional[int] = None
    max_time: Optional[str] = None
    walltime_bins: tuple[WalltimeBin, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class Qos:
    max_time: Optional[str] = None
    max_nodes: Optional[int] = None
    max_running_jobs: Optional[int] = None
    allows_dependencies: bool = True
    description: str = ""


@dataclass(frozen=True)
class Node:
    """One compute node as a job sees it. GPU ids are physical ids (as the site numbers them)."""
    gpus: int = 1
    cores: int = 1
    # Physical GPU id -> the CPU cores closest to it (its NUMA/L3 region), as a range list "1-7,9".
    gpu_cores: dict[str, str] = field(default_factory=dict)
    # Groups of GPUs that share the fastest link (the two GCDs of one MI250X, an NVLink island);
    # the trainer sharing a group with the server's GPU sends it the weights.
    gpu_links: tuple[tuple[int, ...], ...] = ()
    memory_gb: float = 0.0
    gpu_memory_gb: float = 0.0
    # srun -c per task; 0 = cores / tasks per node. (Frontier: 7, after -S 8 core specialization.)
    cpus_per_task: int = 0
    # Interface for the trainers' rendezvous address ("" = the hostname's address).
    rendezvous_interface: str = ""

    def validate(self, where: str) -> None:
        if self.gpus < 1:
            raise UserError(f"{where}.gpus: must be at least 1, got {self.gpus}")
        for gpu, cores in self.gpu_cores.items():
            if not gpu.isdigit() or not 0 <= int(gpu) < self.gpus:
                raise UserError(f"{where}.gpu_cores: GPU id {gpu!r} is not in 0..{self.gpus - 1} "
                                f"(node.gpus is {self.gpus}: give gpu_cores for exactly those GPUs)")
            parse_cpu_list(cores, f"{where}.gpu_cores.{gpu}")
        for group in self.gpu_links:
            for gpu in group:
                if not 0 <= gpu < self.gpus:
                    raise UserError(f"{where}.gpu_links: GPU id {gpu} is not in 0..{self.gpus - 1}")


@dataclass(frozen=True)
class Stage:
    """Copy a packed Python environment (conda-pack tarball) to node-local storage before the run:
    importing Python from a shared file system at scale takes minutes (OLCF measured an import at 8
    nodes: 2 s from NVMe, 51 s from Lustre, almost 4 min from NFS)."""
    # A packed environment on the shared file system (conda pack -o env.tar.gz; any tar the script's
    # `tar -xf` reads, with an optional bin/conda-unpack), or "auto": hpcrl packs the job's own (the
    # virtual or conda environment of site.python) beside the run directory (hpcrl.login.python_env).
    # "" = no staging, unless python_env_from_nodes says otherwise.
    python_env: str = ""
    # At this many nodes or more, an empty python_env is "auto" (0 = never): the site's scale where
    # imports from its shared file system cost more than staging does.
    python_env_from_nodes: int = 0
    # Where each node unpacks python_env: a directory of it a tarball, named after the tarball.
    dest: str = "/mnt/bb/$USER/hpcrl-env"
    # The longest a node's unpack waits for another's into the same dest (two jobs of a user on a
    # shared node, nodes that share a disk): a holder stuck on a hung file system ends the job in one
    # line instead of holding it to its time limit.
    unpack_wait_s: int = 900
    # The model, copied to each node's local storage before the run, where every node loads its own
    # copy: the shared file system is read once instead of by every node, and loading sends no
    # weight byte between nodes. "" = every node reads model.path where it is.
    model_dest: str = ""
    # "sbcast": the batch host reads the model once and Slurm fans it out (model_dest is one path,
    # expanded there); "srun": one task per node copies it (model_dest is expanded on each node,
    # so it may name the node, e.g. $SLURMD_NODENAME where nodes share a disk).
    model_via: Literal["sbcast", "srun"] = "sbcast"
    # A persistent cache of compiled kernels (Triton's, vLLM's, and on AMD MIOpen's) on the shared file
    # system: copied to each node's kernel_cache_dest before the run (TRITON_CACHE_DIR, VLLM_CACHE_ROOT,
    # MIOPEN_* point there), and what the job compiled anew copied back at its end, best effort. Without
    # it the caches on node-local storage are empty in every job, and every job compiles again. "" =
    # none; "auto" = .kernel-cache beside the run directory (the runs directory, which compute nodes
    # write); else a directory.
    kernel_cache: str = ""
    # Node-local storage the kernel cache is copied to (one path, the same on every node).
    kernel_cache_dest: str = "/tmp/hpcrl-kernels-$USER"

    def validate(self, where: str) -> None:
        if self.python_env_from_nodes < 0:
            raise UserError(f"{where}.python_env_from_nodes: must be >= 0 (0: never), got {self.python_env_from_nodes}")
        if self.unpack_wait_s < 1:
            raise UserError(f"{where}.unpack_wait_s: must be >= 1 (seconds), got {self.unpack_wait_s}")
        if self.kernel_cache not in ("", "auto"):
            _check_path(self.kernel_cache, f"{where}.kernel_cache", "a directory on the shared file system")
        _check_path(self.kernel_cache_dest, f"{where}.kernel_cache_dest", "a node-local directory")


@dataclass(frozen=True)
class Nccl:
    """NCCL's view of the cluster's fabric, exported as NCCL_SOCKET_IFNAME and NCCL_IB_HCA when set:
    left to itself NCCL picks the first interface it likes (often the management Ethernet, or a
    docker bridge) and every InfiniBand HCA, storage ones included. A site's [env] may set the same
    variables; [env] wins."""
    # Interfaces for NCCL's bootstrap and socket transport: "ib0", "eth0,eth1", "^docker,lo" (all
    # but), "=eth0" (exactly). "" = NCCL's own choice.
    socket_ifname: str = ""
    # The HCAs (and ports) for NCCL's InfiniBand/RoCE transport: "mlx5_0:1,mlx5_1:1", "^mlx5_4"
    # (all but), "=mlx5_0" (exactly). "" = every HCA NCCL finds.
    ib_hca: str = ""

    def validate(self, where: str) -> None:
        if self.socket_ifname and not NCCL_IFNAME.match(self.socket_ifname):
            raise UserError(f"{where}.socket_ifname: {self.socket_ifname!r} is not a list of network interfaces "
                            f"like \"ib0\", \"eth0,eth1\" or \"^docker,lo\" (names, commas, an optional leading ^ or =)")
        if self.ib_hca and not NCCL_HCA.match(self.ib_hca):
            raise UserError(f"{where}.ib_hca: {self.ib_hca!r} is not a list of HCAs like \"mlx5_0:1,mlx5_1:1\" or "
                            f"\"^mlx5_4\" (names with an optional :port, commas, an optional leading ^ or =)")


@dataclass(frozen=True)
class Container:
    """The image the job's Python runs in: the compute step, and every staging step that runs Python
    (the packed environment's unpack, the model copy, the /dev/shm sweep). OLCF ships vLLM for ROCm
    as Apptainer images; CUDA clusters often run enroot images through pyxis.

    The runtimes take it in two forms, both placed right before the program on the srun line:
    apptainer and singularity are a command (`srun ... apptainer exec --bind DIR IMAGE python ...`),
    pyxis is options of srun itself (`srun ... --container-image=IMAGE --container-mounts=DIR:DIR
    python ...`; srun reads options up to the program)."""
    # "" = no container. A .sif file (or any image apptainer exec takes: docker://...), or pyxis's
    # --container-image (a squashfs file, or registry#image:tag).
    image: str = ""
    runtime: Literal["apptainer", "singularity", "pyxis"] = "apptainer"
    # Host directories the tasks need inside, bound at the same path: the file systems the model,
    # data and checkpoints are on, node-local storage. The run directory, the parents of the staging
    # directories (stage.dest, stage.model_dest) and net_plugin_dir are bound without being listed.
    binds: tuple[str, ...] = ()
    # The directory of the site's NCCL/RCCL network plugin (libnccl-net*.so: aws-ofi-nccl on
    # Slingshot), which an image does not carry ("" = none): bound at the same path.
    net_plugin_dir: str = ""
    # More options of the runtime, one word each ("--option" or "--option=value"): apptainer exec's
    # (e.g. "--cleanenv"), or srun's for pyxis (e.g. "--no-container-mount-home").
    options: tuple[str, ...] = ()

    @property
    def srun_options_form(self) -> bool:
        """pyxis: the container is options of srun, not a command srun runs."""
        return self.runtime == "pyxis"

    def validate(self, where: str) -> None:
        if CONTROL_CHARS.search(self.image):
            raise UserError(f"{where}.image: control characters (newline, tab, ...) are not allowed")
        for i, path in enumerate(self.binds):
            _check_bind(path, f"{where}.binds[{i}]")
        if self.net_plugin_dir:
            _check_bind(self.net_plugin_dir, f"{where}.net_plugin_dir")
        for i, opt in enumerate(self.options):
            if not opt.startswith("-") or re.search(r"\s", opt) or CONTROL_CHARS.search(opt):
                raise UserError(f"{where}.options[{i}]: {opt!r} is not one option word like \"--cleanenv\" "
                                f"or \"--env=NAME=value\"")


def _check_path(path: str, where: str, what: str) -> None:
    if not BIND_PATH.match(path):
        raise UserError(f"{where}: {path!r} is not {what}: an absolute path (plain $VARIABLES allowed), "
                        f"without : , quotes, backslashes or spaces")


def _check_bind(path: str, where: str) -> None:
    _check_path(path, where, "a directory to bind")


@dataclass(frozen=True)
class Site:
    name: str
    description: str = ""
    scheduler: Literal["slurm", "none"] = "slurm"
    launcher: Literal["srun", "mpiexec"] = "srun"
    # Which visibility variable pins a task to its GPU(s).
    gpu_vendor: Literal["nvidia", "amd", "none"] = "nvidia"
    # The torch device trainers compute on ("cpu" where the GPUs are fake or absent).
    device: Literal["cuda", "cpu"] = "cuda"
    fake_gpus: bool = False
    account_required: bool = False
    partition: str = ""            # default partition ("" = the cluster's default)
    qos: str = ""
    partitions: dict[str, Partition] = field(default_factory=dict)
    qos_limits: dict[str, Qos] = field(default_factory=dict)
    node: Node = field(default_factory=Node)
    # Extra #SBATCH options, one per entry (e.g. "--constraint=nvme").
    sbatch_options: tuple[str, ...] = ()
    # How the script asks for GPUs; "" asks for none ({gpus} = GPUs per node).
    gpu_request: str = "--gpus-per-node={gpus}"
    # Signal sent before the time limit so trainers checkpoint; not USR1, which NCCL/RCCL catch.
    # "NAME@SECONDS", or "NAME@auto": hpcrl.job.signal_lead derives the lead from the checkpoint's
    # write (shared_fs_write_gb_s) and a step, and `hpcrl plan` says how. "" = no signal.
    signal: str = "USR2@auto"
    # GB/s (1e9 bytes) one node of a job can count on writing to the shared file system its
    # checkpoints go to: its share of a busy file system, not the peak. Sets "@auto" signal leads.
    shared_fs_write_gb_s: float = 1.0
    # Seconds from a job's start to the end of its first step here (staging, imports, model load,
    # engine start, one step), as measured on the site: a time limit must leave that and the
    # signal's lead, or every attempt is stopped before it trains.
    startup_s: int = 120
    srun_options: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    # Shell lines run before the job (module system set-up, conda activate). Site files only.
    setup: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    env_single_node: dict[str, str] = field(default_factory=dict)
    env_multi_node: dict[str, str] = field(default_factory=dict)
    # The interpreter that runs `python -m hpcrl.compute.launch`; "auto" = the one running hpcrl now.
    python: str = "auto"
    stage: Stage = field(default_factory=Stage)
    # The image the tasks' Python runs in (container.image "" = none).
    container: Container = field(default_factory=Container)
    # NCCL_SOCKET_IFNAME and NCCL_IB_HCA (nccl.* "" = NCCL's own choice).
    nccl: Nccl = field(default_factory=Nccl)
    # The tasks' HF_HOME (the Hugging Face caches: datasets' prepared data, the hub's files), never
    # under $HOME, which is small, slow or read-only on many clusters' compute nodes. "" = hpcrl sets
    # none (the job keeps the submitting shell's, or [env]'s); "auto" = the submitting shell's $HF_HOME
    # where that is outside $HOME, else .hf-home beside the run directory (the runs directory, on the
    # file system compute nodes write); else a directory.
    hf_home: str = ""
    runs_dir: str = "runs"
    # Directories compute nodes cannot write (Frontier mounts /ccs/home and /ccs/proj read-only
    # there): a run or checkpoint directory under one is refused at render, before the queue.
    readonly_on_compute: tuple[str, ...] = ()
    extends: str = ""

    def validate(self, where: str) -> None:
        for name in (self.partition, self.qos):
            if name and not SAFE_WORD.match(name):
                raise UserError(f"{where}: partition/qos {name!r} has characters Slurm names cannot have")
        if self.scheduler == "none" and self.launcher == "srun":
            raise UserError(f"{where}.launcher: a site without a scheduler needs launcher = \"mpiexec\"")
        for key in (*self.env, *self.env_single_node, *self.env_multi_node):
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise UserError(f"{where}.env: {key!r} is not a valid environment variable name")
        if self.signal and not SIGNAL.match(self.signal):
            raise UserError(f"{where}.signal: {self.signal!r} is not a signal and its lead in seconds like "
                            f"\"USR2@300\", or \"USR2@auto\" (\"\" = none)")
        if (self.signal_lead_s or 0) > SLURM_MAX_SIGNAL_LEAD_S:
            raise UserError(f"{where}.signal: a lead of {self.signal_lead_s} s is over Slurm's limit of "
                            f"{SLURM_MAX_SIGNAL_LEAD_S} s")
        if not self.shared_fs_write_gb_s > 0:
            raise UserError(f"{where}.shared_fs_write_gb_s: must be > 0 (GB/s a node writes), got "
                            f"{self.shared_fs_write_gb_s}")
        if self.startup_s < 0:
            raise UserError(f"{where}.startup_s: must be >= 0, got {self.startup_s}")
        if self.container.image:
            self._check_container(where)
        if self.hf_home not in ("", "auto"):
            if HOME_WORDS.match(self.hf_home):
                raise UserError(f"{where}.hf_home: {self.hf_home!r} is under $HOME, which compute nodes of many "
                                f"clusters cannot write (or not much): name a directory on the shared or scratch "
                                f"file system, or \"auto\"")
            _check_path(self.hf_home, f"{where}.hf_home", "a directory for HF_HOME")

    def _check_container(self, where: str) -> None:
        if self.scheduler == "none":
            raise UserError(f"{where}.container.image: `hpcrl run` starts its tasks through mpiexec on this "
                            f"machine, outside any container; containers are for Slurm sites")
        if self.container.srun_options_form and self.launcher != "srun":
            raise UserError(f"{where}.container.runtime: pyxis is a plugin of srun, and {self.name}'s launcher "
                            f"is {self.launcher}")
        if self.python == "auto" and not self.stage.python_env:
            raise UserError(f"{where}.python: the tasks run inside {self.container.image}, where the interpreter "
                            f"hpcrl runs from here (python = \"auto\") is not: set it to the image's (e.g. "
                            f"python3), or stage.python_env")

    @property
    def signal_name(self) -> str:
        """The name of site.signal without its SIG prefix (USR2 without one: the trainers' stop request)."""
        return (self.signal.partition("@")[0] or "USR2").removeprefix("SIG")

    @property
    def signal_lead_s(self) -> int | None:
        """Seconds before the time limit that site.signal gives (0 without a signal); None for
        "NAME@auto", whose lead a job's checkpoint sets (hpcrl.job.signal_lead)."""
        if not self.signal:
            return 0
        lead = self.signal.partition("@")[2]
        return None if lead == "auto" else int(lead)

    def check_time_limit(self, time_s: int, time_text: str, lead_s: int) -> None:
        """A time limit that leaves no step between start-up and the stop signal, which comes
        `lead_s` before it: every attempt would be stopped, and (before the trainers' progress check)
        requeued, during start-up."""
        if not self.signal:
            return
        needed = self.startup_s + lead_s
        if time_s <= needed:
            raise UserError(f"time: {time_text} leaves no time to train on {self.name}: start-up and a first step "
                            f"take about {self.startup_s} s (site startup_s) and Slurm's {self.signal_name} warning "
                            f"comes {lead_s} s before the limit (site.signal {self.signal}); ask for more than "
                            f"{needed} s")

    def gpu_cores(self, gpu: int) -> tuple[int, ...]:
        text = self.node.gpu_cores.get(str(gpu))
        return parse_cpu_list(text, "node.gpu_cores") if text else ()


def parse_cpu_list(text: str, where: str) -> tuple[int, ...]:
    """ "0-3,8" -> (0, 1, 2, 3, 8)."""
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise UserError(f"{where}: {text!r} is not a CPU list like \"1-7,9\"")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise UserError(f"{where}: range {part!r} runs backwards")
        out.extend(range(lo, hi + 1))
    return tuple(out)
