"""Placement as pure logic: the plan for the frontier and cuda profiles at 1, 2 and 64 nodes
against the machines' published GPU/NUMA facts (written out here, independently of the site
files), `hpcrl plan --json` against the plan, and how a task turns its row into pinning and
checks the launcher's identity against it (pinning.py, rendezvous.py). No hardware needed."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from hpcrl.login import profiles
from hpcrl.login.cli import main as cli_main
from hpcrl.compute.launch import pinning, rendezvous
from hpcrl.compute.launch.pinning import PinningError
from hpcrl.compute.launch.rendezvous import Identity
from hpcrl.job.placement import format_cores, make_plan

# OLCF Frontier user guide: hardware threads -> GCD. -S 8 reserves the first core of each region.
FRONTIER_REGION = {4: range(0, 8), 5: range(8, 16), 2: range(16, 24), 3: range(24, 32),
                   6: range(32, 40), 7: range(40, 48), 0: range(48, 56), 1: range(56, 64)}
FRONTIER_MI250X = [{0, 1}, {2, 3}, {4, 5}, {6, 7}]     # GCD pairs on one package (200 GB/s)


def _check_common(plan, nodes: int, gpus_per_node: int, server_gpus: int, shared_cores: bool = False,
                  tp: int = 1) -> None:
    engines = server_gpus // tp
    trainers = gpus_per_node - server_gpus
    per_node = trainers + engines
    assert (plan.nodes, plan.tasks_per_node, plan.world_size) == (nodes, per_node, nodes * per_node)
    assert plan.num_trainers == nodes * trainers and plan.engines_per_node == engines
    trainer_ranks = [t.trainer_rank for t in plan.tasks if t.role == "trainer"]
    assert trainer_ranks == list(range(plan.num_trainers))      # dense, in rank order
    for t in plan.tasks:
        assert t.rank == t.node * per_node + t.local_rank       # Slurm's block distribution
    for n in range(nodes):
        tasks = plan.node_tasks(n)
        assert [t.role for t in tasks] == ["trainer"] * trainers + ["server"] * engines
        servers = plan.node_servers(n)
        assert [s.engine for s in servers] == list(range(engines))
        assert all(len(s.gpus) == tp for s in servers) and servers[0].gpus[-1] == gpus_per_node - 1
        assert sorted(g for s in servers for g in s.gpus) == list(range(gpus_per_node - server_gpus, gpus_per_node)) \
            or gpus_per_node == 8 and plan.tensor_parallel_size < 2   # Frontier's GCD pairs: see below
        used = [g for t in tasks for g in t.gpus]
        assert sorted(used) == list(range(gpus_per_node))       # every GPU once
        cores = [c for t in tasks for c in t.cores]
        assert shared_cores or len(cores) == len(set(cores))    # no core shared on a node
        # Every engine: one sender among the trainers it serves, every trainer served, evenly.
        for s in servers:
            assert s.server_rank == s.rank and not s.servers and not s.sends_to
            assert sum(s.rank in t.sends_to for t in tasks) == 1
            assert plan.sender_of(s.rank) in plan.served_by(s.rank)
        for t in tasks[:trainers]:
            assert t.servers and t.server_rank == t.servers[0] and t.sender == bool(t.sends_to)
            assert set(t.sends_to) <= set(t.servers) <= {s.rank for s in servers}
        load = [len(plan.served_by(s.rank)) for s in servers]
        assert max(load) - min(load) <= 1


@pytest.mark.parametrize("nodes", [1, 2, 64])
def test_frontier_plan_matches_the_node(nodes):
    plan = make_plan(profiles.load("frontier"), nodes)
    _check_common(plan, nodes, 8, 1)
    for t in plan.tasks:
        (gpu_region,) = {g: FRONTIER_REGION[g] for g in t.gpus}.values()
        # the 7 cores of the GCD's own L3/NUMA region, less the one core spec reserves
        assert t.cores == tuple(gpu_region)[1:], t
        if t.role == "trainer":
            assert len(t.gpus) == 1 and t.gpus[0] != 7
    for n in range(nodes):
        sender = plan.sender_of(plan.node_servers(n)[0].rank)
        # GCD 6 shares an MI250X with the server's GCD 7: the fastest path for the weights
        assert sender.gpus == (6,) and {6, 7} in FRONTIER_MI250X
        assert sender.local_rank == 6 and sender.rank == n * 8 + 6
    if nodes == 64:
        assert plan.world_size == 512 and plan.num_trainers == 448 and plan.tasks[-1].rank == 511


def test_frontier_tensor_parallel_server_takes_one_whole_mi250x():
    plan = make_plan(profiles.load("frontier"), 2, server_gpus=2, tensor_parallel_size=2)
    _check_common(plan, 2, 8, 2, tp=2)
    server = plan.node_tasks(0)[-1]
    assert server.gpus == (6, 7)
    assert server.cores == tuple(FRONTIER_REGION[6])[1:] + tuple(FRONTIER_REGION[7])[1:]
    # No trainer shares the server's package; the sender is then the highest trainer GCD.
    assert plan.sender_of(server.rank).gpus == (5,)


@pytest.mark.parametrize("nodes", [1, 2, 64])
def test_cuda_plan_matches_the_node(nodes):
    site = profiles.load("cuda")
    plan = make_plan(site, nodes)
    _check_common(plan, nodes, 8, 1)
    for t in plan.tasks:
        (gpu,) = t.gpus
        assert t.cores == tuple(range(12 * gpu, 12 * gpu + 12))     # 96 cores, 12 per GPU
    for n in range(nodes):
        # NVSwitch: every GPU is one hop away, the sender is the highest trainer GPU
        assert plan.sender_of(plan.node_servers(n)[0].rank).gpus == (6,)
    assert plan.world_size == 8 * nodes


def test_testbed_plan_gives_the_server_its_own_core():
    plan = make_plan(profiles.load("testbed"), 2)
    _check_common(plan, 2, 4, 1, shared_cores=True)          # 2 real cores for 8 tasks
    assert [t.cores for t in plan.node_tasks(1)] == [(0,), (0,), (0,), (1,)]


# ------------------------------------------------------------------ several engines per node
@pytest.mark.parametrize("nodes", [1, 64])
@pytest.mark.parametrize("engines, tp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_frontier_engines_sit_beside_their_senders_on_one_mi250x(nodes, engines, tp):
    plan = make_plan(profiles.load("frontier"), nodes, server_gpus=engines * tp, tensor_parallel_size=tp)
    _check_common(plan, nodes, 8, engines * tp, tp=tp)
    for n in (0, nodes - 1):
        for server in plan.node_servers(n):
            sender = plan.sender_of(server.rank)
            package = next(p for p in FRONTIER_MI250X if set(server.gpus) & p)
            if tp == 1:
                # one GCD of an MI250X generates, the other GCD of the same package sends
                assert set(server.gpus) | set(sender.gpus) == package
            else:
                # a TP-2 engine is one whole MI250X; no trainer shares its package, so its sender
                # is the highest trainer GCD not sending already
                assert set(server.gpus) == package
                assert sender.gpus == (7 - engines * tp - server.engine,)
            assert sender.cores == tuple(FRONTIER_REGION[sender.gpus[0]])[1:]
    # 4 engines of 1 GCD: every trainer is a sender and feeds only its own engine
    if (engines, tp) == (4, 1):
        assert all(t.sends_to == t.servers and len(t.servers) == 1 for t in plan.node_tasks(0)[:4])


@pytest.mark.parametrize("nodes", [1, 64])
@pytest.mark.parametrize("engines, tp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_cuda_engines_take_the_highest_gpus_and_distinct_senders(nodes, engines, tp):
    plan = make_plan(profiles.load("cuda"), nodes, server_gpus=engines * tp, tensor_parallel_size=tp)
    _check_common(plan, nodes, 8, engines * tp, tp=tp)
    servers = plan.node_servers(nodes - 1)
    # NVSwitch: no link groups; engines in blocks from the top, senders the highest trainer GPUs
    assert [s.gpus for s in servers] == [tuple(range(8 - (e + 1) * tp, 8 - e * tp)) for e in range(engines)]
    senders = [plan.sender_of(s.rank).gpus[0] for s in servers]
    assert senders == list(range(7 - engines * tp, 7 - engines * tp - engines, -1))
    assert plan.sync_rounds == 1


def test_more_engines_than_trainers_share_the_senders_and_sync_in_rounds():
    site = profiles.load("local")
    plan = make_plan(replace(site, node=replace(site.node, gpus=3)), 1, server_gpus=2)
    (trainer,) = plan.node_tasks(0)[:1]
    assert trainer.servers == trainer.sends_to == (1, 2) and plan.sync_rounds == 2
    assert plan.senders() == {1: 0, 2: 0}


@pytest.mark.parametrize("overrides, message", [
    (["inference.gpus=3", "inference.tensor_parallel_size=2"], "inference.tensor_parallel_size: 2 must divide inference.gpus=3"),
    (["inference.tensor_parallel_size=2"], "for one engine of 2 GPUs set inference.gpus=2"),
    (["inference.gpus=8", "inference.tensor_parallel_size=4"], "inference.gpus: 8 server GPU(s) leave no trainer"),
])
def test_a_split_that_cannot_be_is_one_line(overrides, message, capsys):
    assert cli_main(["plan", "--site", "frontier", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("site, nodes", [("frontier", 2), ("cuda", 64), ("testbed", 2)])
def test_hpcrl_plan_json_is_the_plan(site, nodes, capsys):
    assert cli_main(["plan", "--site", site, "-N", str(nodes), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    plan = make_plan(profiles.load(site), nodes)
    # Each row is the task's plus its memory estimate (none for the demo model, built in the job).
    assert all(row.pop("est_memory_gb") is None for row in shown["tasks"])
    assert shown["tasks"] == [json.loads(json.dumps(t.to_dict())) for t in plan.tasks]
    assert shown["senders"] == {str(t.rank): t.rank - 1 if site == "frontier" else plan.sender_of(t.rank).rank
                                for t in plan.tasks if t.role == "server"}


# ------------------------------------------------------------------------------ pinning
def test_nvidia_task_sees_exactly_its_gpu_among_what_slurm_gave():
    site = profiles.load("testbed")
    task = make_plan(site, 2).task(6)
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "ROCR_VISIBLE_DEVICES": "0,1,2,3"}
    assert pinning.gpu_environment(site, task, env) == ({"CUDA_VISIBLE_DEVICES": "2"}, ("ROCR_VISIBLE_DEVICES",))
    # the g-th device the job holds, whatever its id
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert pinning.gpu_environment(site, task, env)[0] == {"CUDA_VISIBLE_DEVICES": "6"}
    assert pinning.gpu_environment(site, task, {})[0] == {"CUDA_VISIBLE_DEVICES": "2"}


@pytest.mark.parametrize("tp", [1, 2])
def test_rocm_tasks_get_the_rocr_mask_and_servers_a_hip_one_relative_to_it(tp):
    """Issue #27, item 2: a server had ROCR_VISIBLE_DEVICES alone, and Ray (which vLLM starts for a
    tensor-parallel engine) refuses that; a server's HIP_VISIBLE_DEVICES indexes into its ROCr mask
    (absolute ids there would be "invalid device ordinal"). Trainers keep one mask."""
    site = profiles.load("frontier")
    plan = make_plan(site, 1, server_gpus=2, tensor_parallel_size=tp)
    env = {"ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    servers = [t for t in plan.tasks if t.role == "server"]
    assert [len(t.gpus) for t in servers] == [tp] * (2 // tp)
    for task in plan.tasks:
        set_vars, removed = pinning.gpu_environment(site, task, env)
        after = {k: v for k, v in env.items() if k not in removed} | set_vars
        mask = {"ROCR_VISIBLE_DEVICES": ",".join(map(str, task.gpus))}
        if task.role == "server":
            mask["HIP_VISIBLE_DEVICES"] = "0,1"[:2 * tp - 1]       # "0" or "0,1"
        assert after == mask, (task.rank, task.role, after)


def test_launcher_binding_one_gpu_per_task_is_refused_clearly():
    site = profiles.load("cuda")
    with pytest.raises(PinningError, match=r"--gpu-bind=none"):
        pinning.gpu_environment(site, make_plan(site, 1).task(3), {"CUDA_VISIBLE_DEVICES": "3"})


def test_cpu_set_intersects_with_what_the_task_may_use():
    site = profiles.load("cuda")
    task = make_plan(site, 1).task(1)                          # cores 12-23
    cores, dropped, warning = pinning.cpu_set(site, task, allowed=set(range(16, 96)), existing=set(range(96)),
                                              tasks_per_node=8)
    assert cores == tuple(range(16, 24)) and dropped == tuple(range(12, 16)) and warning == ""


def test_cpu_set_fails_clearly_on_a_core_the_node_lacks():
    site = profiles.load("frontier")
    task = make_plan(site, 1).task(0)                          # GCD 0: cores 49-55
    with pytest.raises(PinningError, match=r"core\(s\) 49-55, which this node does not have \(it has 0-1\)"):
        pinning.cpu_set(site, task, allowed={0, 1}, existing={0, 1}, tasks_per_node=8)


def test_cpu_set_outside_the_jobs_cpuset_falls_back_to_an_even_share_with_a_warning():
    """A non-exclusive job or an SMT node: Slurm's 96 CPUs are not the cores 0-95 the site maps.
    Every task of the node gets its share of what the job holds, and says so once."""
    site = profiles.load("cuda")
    plan = make_plan(site, 1)
    allowed = set(range(0, 48)) | set(range(112, 160))          # 48 cores and their SMT siblings
    shares = []
    for rank in range(4, 8):                                     # GPUs 4-7: planned cores 48-95
        cores, dropped, warning = pinning.cpu_set(site, plan.task(rank), allowed=allowed,
                                                  existing=set(range(224)), tasks_per_node=8)
        assert dropped == plan.task(rank).cores and cores and set(cores) <= allowed
        assert f"rank {rank} is planned on core(s) {format_cores(plan.task(rank).cores)}" in warning
        assert "pinned to" in warning and "--exclusive" in warning and "--cpu-bind" not in warning
        shares.append(set(cores))
    assert all(not (a & b) for i, a in enumerate(shares) for b in shares[i + 1:])    # disjoint shares
    assert pinning.even_share([0, 1], 5, 8) == (1,)             # fewer cores than tasks: share one


def test_local_site_gpu_slots_set_no_variable():
    site = replace(profiles.load("local"), node=replace(profiles.load("local").node, gpus=4))
    assert pinning.gpu_environment(site, make_plan(site, 1).task(0), {}) == ({}, ())


# ------------------------------------------------------------------------------ identity vs plan
SLURM_ENV = {"SLURM_PROCID": "5", "SLURM_NODEID": "1", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
             "SLURM_JOB_ID": "42", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
             "SLURM_STEP_NUM_NODES": "2", "SLURMD_NODENAME": "n2"}


def test_slurm_variables_give_the_plans_row():
    ident = rendezvous.slurm_identity(SLURM_ENV)
    assert (ident.rank, ident.size, ident.node, ident.local_rank, ident.local_size, ident.nodes) == (5, 8, 1, 1, 4, 2)
    assert ident.node_name == "n2" and ident.source == "slurm"
    assert rendezvous.placement_problem(ident, make_plan(profiles.load("testbed"), 2)) is None
    assert rendezvous.launch_id(SLURM_ENV) == "slurm-42.0-r0"


def test_uneven_tasks_per_node_are_read():
    assert rendezvous._expand_tasks_per_node("4(x2),3") == [4, 4, 3]


def test_forced_slurm_source_never_touches_mpi():
    ident, world, node_comm, note = rendezvous.discover(SLURM_ENV, "slurm")
    assert (ident.rank, world, node_comm) == (5, None, None) and "slurm" in note


def test_without_mpi4py_slurm_variables_take_over(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)        # as if not installed
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    ident, world, _, note = rendezvous.discover(SLURM_ENV)
    assert (ident.rank, ident.node, ident.source, world) == (5, 1, "slurm", None)
    assert "mpi4py is unusable" in note


def test_without_mpi4py_outside_slurm_the_error_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(rendezvous.LaunchError, match=r"not a Slurm step .*`hpcrl run` or srun"):
        rendezvous.discover({})


def _ident(**kw) -> Identity:
    base = dict(rank=5, size=8, node=1, local_rank=1, local_size=4, nodes=2, host="h", node_name="n2", source="mpi")
    return Identity(**{**base, **kw})


def test_missing_tasks_are_named():
    plan = make_plan(profiles.load("testbed"), 2)
    problem = rendezvous.placement_problem(_ident(size=7), plan)
    assert "started 7 task(s) but the plan has 8" in problem and "missing rank 7 (node 1, server)" in problem


def test_cyclic_layout_is_refused_with_the_fix():
    plan = make_plan(profiles.load("testbed"), 2)
    problem = rendezvous.placement_problem(_ident(rank=1, node=1, local_rank=0), plan)   # srun -m cyclic
    assert "rank 1 landed on node 1" in problem and "--distribution=block" in problem


def test_fake_nodes_on_one_machine_are_told_apart():
    assert rendezvous.node_name({"PMI_RANK": "6"}, tasks_per_fake_node=4).endswith("-fake1")


def test_gloo_binds_to_the_sites_interface_or_the_one_that_reaches_rank_0():
    assert rendezvous.gloo_interface(profiles.load("frontier"), "10.0.0.1") == "hsn0"
    assert rendezvous.gloo_interface(profiles.load("testbed"), "127.0.0.1") == "lo"
