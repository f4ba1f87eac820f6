"""The compute side's start on this machine: mpiexec (the PyPI mpich runtime) runs
`python -m hpcrl.compute.launch RUN_DIR` as 4 tasks of the local site with 4 fake GPUs (3 trainers +
1 server); each reports its row and what it really got, and failures end every rank within a
bound, naming the rank at fault. First the parts in-process: wire format, node channel,
watchdog hub, mesh choice."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import conftest

from hpcrl.job import rundir
from hpcrl.job.rundir import FAILURE_FILE, read_failure
from hpcrl.compute.inference.vllm_engine import MULTIPROCESSING_ENV
from hpcrl.compute.launch import outcome, wire
from hpcrl.compute.launch.node_channel import NodeChannel, NodeServerChannel, PeerClosed, socket_name
from hpcrl.job.mesh_choice import choose_mesh
from hpcrl.job.model_shape import count_parameters
from hpcrl.compute.launch.watchdog import Hub, Peer, Watchdog
from hpcrl.job.spec import JobSpec
from support import check_probe_transfer, check_trainer_imports_overlap, run_survivors
from hpcrl.login.compose import compose

PY = sys.executable
MPIEXEC = str(Path(PY).parent / "mpiexec") if (Path(PY).parent / "mpiexec").exists() else shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")


# ============================================================================ in-process parts
def test_wire_carries_tensors_out_of_band_bitwise():
    torch = pytest.importorskip("torch")
    a, b = socket.socketpair()
    msg = {"token_ids": torch.arange(10, dtype=torch.int64), "logprobs": -torch.rand(3, 5),
           "bf16": torch.randn(4, 4).to(torch.bfloat16), "scalar": torch.tensor(3.5),
           "empty": torch.empty(0, 7), "strided": torch.arange(12).reshape(3, 4).t(), "text": ["x", 1]}
    wire.send_msg(a, msg)
    got = wire.recv_msg(b, timeout=5)
    for key in ("token_ids", "logprobs", "bf16", "scalar", "empty", "strided"):
        assert got[key].dtype == msg[key].dtype and got[key].shape == msg[key].shape
        assert torch.equal(got[key], msg[key]), key
    assert got["text"] == ["x", 1]
    data, buffers = wire.encode(msg)
    assert len(buffers) == 6 and len(data) < 2000          # the tensor bytes are not in the pickle


def test_wire_refuses_a_peer_without_the_secret():
    a, b = socket.socketpair()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "server", _try(wire.authenticate_server_side, a, b"right" * 8)))
    t.start()
    t0 = time.monotonic()
    with pytest.raises(wire.AuthError, match="refused this task's proof"):
        wire.authenticate_client_side(b, b"wrong" * 8, 5)
    t.join(5)
    assert isinstance(result["server"], wire.AuthError) and time.monotonic() - t0 < 1


def _try(fn, sock, secret):
    try:
        fn(sock, secret, 5)
    except Exception as e:
        sock.close()                     # as every server does with a failed peer
        return e


def test_node_channel_round_trips_and_turns_strangers_away():
    torch = pytest.importorskip("torch")
    secret = os.urandom(32)
    node = int.from_bytes(os.urandom(2), "big")             # a name no other test run uses
    server = NodeServerChannel(secret, node, [0, 1], 2)
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(socket_name(secret, 2))

    def trainer(rank):
        ch = NodeChannel.connect(secret, node, rank, 2, timeout=10)
        reply = ch.request({"op": "gen", "prompt_ids": torch.arange(5) + rank}, timeout=10)
        assert torch.equal(reply["completion_ids"], torch.arange(5) + rank + 100)
        ch.close()

    threads = [threading.Thread(target=trainer, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    stranger.sendall(b"HPC1" + b"\0" * 64)                   # knows the name, not the secret
    server.accept_all(timeout=10)
    assert server.ranks == (0, 1) and server.rejected
    served, closed = set(), set()
    while len(closed) < 2:
        try:
            rank, msg = server.recv_any(timeout=10)
        except PeerClosed as e:
            closed.add(e.rank)
            continue
        server.reply(rank, {"completion_ids": msg["prompt_ids"] + 100})
        served.add(rank)
    for t in threads:
        t.join(5)
    assert served == {0, 1}
    with pytest.raises(TimeoutError):
        server.recv_any(timeout=0.1)
    server.close()


@pytest.fixture
def verdicts():
    """The verdicts the watchdogs reach, recorded instead of ending the test process."""
    return []


def _hub_with_peers(verdicts: list, n: int, timeout_s: float):
    secret = os.urandom(32)
    hub = Hub(secret, n, timeout_s, "127.0.0.1").start()
    dogs = [Watchdog(Peer(r, 0, r, "trainer", "h", 1000 + r), secret, timeout_s,
                     on_fatal=lambda who, reason: verdicts.append((who, reason))) for r in range(n)]
    threads = [threading.Thread(target=d.connect, args=(hub.address, n, 10)) for d in dogs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    # Rank 0 (the hub's own) holds every rank's entry; the others the hub's alone.
    assert [p.rank for p in dogs[0].peers] == list(range(n))
    assert all([p.rank for p in d.peers] == [0] for d in dogs[1:])
    return hub, dogs


def _shut(hub, dogs):
    """Goodbyes first, so the end of the hub is no verdict."""
    for d in dogs:
        d.close()
    hub.close(0.5)


def _wait_for(cond, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.02)
    return cond()


def test_hub_names_a_rank_whose_connection_drops(verdicts):
    hub, dogs = _hub_with_peers(verdicts, 3, timeout_s=30)
    t0 = time.monotonic()
    dogs[2]._sock.shutdown(socket.SHUT_RDWR)                # rank 2 dies: no goodbye
    assert _wait_for(lambda: len([v for v in verdicts if "rank 2 (node 0" in v[1]]) >= 2, 5)
    assert time.monotonic() - t0 < 1.0                      # no heartbeat timeout needed
    assert all("connection closed without a goodbye" in r for w, r in verdicts if "rank 2 (node 0" in r)
    _shut(hub, dogs)


def test_hub_names_a_rank_that_stops_heartbeating(verdicts, monkeypatch):
    """Rank 1 is frozen (its socket open, nothing sent): found after peer_failure_timeout_s."""
    hub, dogs = _hub_with_peers(verdicts, 3, timeout_s=0.6)
    monkeypatch.setattr(dogs[1], "_send", lambda msg: None)  # rank 1 is frozen, its socket open
    t0 = time.monotonic()
    assert _wait_for(lambda: any("rank 1 (node 0" in r and "no heartbeat" in r for _, r in verdicts), 5)
    assert time.monotonic() - t0 < 0.6 + 0.5
    _shut(hub, dogs)


def test_a_rank_that_fails_tells_everyone_why_and_keeps_it_as_the_jobs_reason(verdicts, tmp_path, monkeypatch):
    """The verdict every rank reaches, and the job's reason (failure.txt) in the same words, kept by
    the failing rank itself: once it exits, the launcher may kill rank 0 (and the hub with it) before
    any rank the hub told has written it (a loaded CI machine: `hpcrl run` ended with no reason)."""
    monkeypatch.setattr(outcome, "_record", tmp_path / FAILURE_FILE)
    hub, dogs = _hub_with_peers(verdicts, 3, timeout_s=30)
    dogs[1].fail("ValueError: reward function crashed", grace_s=0)
    said = "rank 1 (node 0, trainer, host h, pid 1001) failed: ValueError: reward function crashed"
    assert read_failure(tmp_path) == said        # before any verdict: the ranks told only record theirs here
    assert _wait_for(lambda: len(verdicts) >= 2, 5)
    assert sorted(who for who, _ in verdicts) == ["rank 0 (node 0, trainer)", "rank 2 (node 0, trainer)"]
    assert all(reason == said for _, reason in verdicts)
    _shut(hub, dogs)


def test_goodbyes_end_the_hub_at_once(verdicts):
    hub, dogs = _hub_with_peers(verdicts, 4, timeout_s=30)
    for d in dogs:
        d.close()
    t0 = time.monotonic()
    assert hub.close(wait_s=10) == {}
    assert time.monotonic() - t0 < 1.0 and not verdicts


def test_every_ranks_row_reaches_rank_0_and_a_missing_one_is_named(verdicts):
    """A probe's rows (hpcrl/compute/launch/probe.py) go to rank 0 over the hub, not through the
    launcher's merged output; a rank whose row never comes is named, with the field that bounds the wait."""
    hub, dogs = _hub_with_peers(verdicts, 3, timeout_s=30)
    for d in (dogs[2], dogs[0]):
        d.send_row("probe", {"rank": d.me.rank, "text": "x" * 4000})     # longer than srun's 1,024-byte pieces
    with pytest.raises(TimeoutError, match=r"1 rank\(s\) sent no probe row within 0 s \(launch.collective_timeout_s\): "
                                           r"rank\(s\) 1$"):
        hub.wait_rows("probe", 0.3)
    dogs[1].send_row("probe", {"rank": 1, "text": "y"})
    rows = hub.wait_rows("probe", 5)
    assert sorted(rows) == [0, 1, 2] and all(row["rank"] == rank for rank, row in rows.items())
    assert rows[2]["text"] == "x" * 4000
    _shut(hub, dogs)


def test_small_broadcasts_travel_through_the_hub(verdicts):
    hub, dogs = _hub_with_peers(verdicts, 3, timeout_s=30)
    dogs[0].bcast("trainer_store", ("10.0.0.1", 29500))
    assert [d.wait_bcast("trainer_store", 5) for d in dogs[1:]] == [("10.0.0.1", 29500)] * 2
    _shut(hub, dogs)


def _spec(tmp_path, *overrides, nodes=1, site="local") -> JobSpec:
    # Mesh choices for models no demo batch fits: the fit check is tests/job/test_estimate.py's.
    return compose(None, site, list(overrides), {"resources.nodes": nodes}, str(tmp_path / f"r-{uuid.uuid4().hex[:6]}"),
                   check_fit=False, check_inputs=False)


def test_mesh_choice(tmp_path):
    assert choose_mesh(*_with_plan(_spec(tmp_path, "site.node.gpus=4"))).kind == "fsdp"          # one node
    small = choose_mesh(*_with_plan(_spec(tmp_path, nodes=2, site="testbed")))
    assert (small.kind, small.shape, small.dim_names) == ("hsdp", (2, 3), ("replicate", "shard"))
    forced = choose_mesh(*_with_plan(_spec(tmp_path, "trainer.mesh=fsdp", nodes=2, site="testbed")))
    assert (forced.kind, forced.shape) == ("fsdp", (6,))
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({"hidden_size": 8192, "num_hidden_layers": 80, "vocab_size": 128256,
                                                 "intermediate_size": 28672, "num_attention_heads": 64,
                                                 "num_key_value_heads": 8}))
    choice = choose_mesh(*_with_plan(_spec(tmp_path, f"model.path={big}", nodes=2, site="cuda")))
    assert choice.kind == "fsdp" and 69e9 < choice.params < 72e9          # a 70B model: shard everywhere


def _with_plan(spec):
    return spec, spec.plan()


def test_parameter_count_from_config_and_safetensors(tmp_path):
    qwen = {"hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936, "intermediate_size": 4864,
            "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    assert abs(count_parameters(str(tmp_path)) - 494_032_768) / 494_032_768 < 0.001   # Qwen2-0.5B
    header = json.dumps({"a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
                         "b": {"dtype": "F32", "shape": [5], "data_offsets": [48, 68]},
                         "__metadata__": {"format": "pt"}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 68)
    assert count_parameters(str(tmp_path)) == 17                           # exact, from the header
    assert count_parameters(str(tmp_path / "absent")) is None
    # A file that is no safetensors (its first 8 bytes a length past its end): the config's estimate,
    # without reading (allocating) what those bytes say.
    (tmp_path / "model.safetensors").write_bytes(b"w" * 1000)
    assert abs(count_parameters(str(tmp_path)) - 494_032_768) / 494_032_768 < 0.001


# ============================================================================ under mpiexec
def _make_run_dir(tmp_path, *overrides, nodes=1) -> Path:
    spec = _spec(tmp_path, "mode=probe", *overrides, nodes=nodes)
    return rundir.create(spec.run_dir, spec.to_json(), None)


def _hpcrl_run(tmp_path, *overrides, nodes=1, env=None, timeout=120):
    run_dir = tmp_path / f"run-{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    cmd = [PY, "-m", "hpcrl", "run", "mode=probe", *overrides, "-N", str(nodes), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return proc, time.monotonic() - t0, run_dir


def _mpiexec(run_dir, n, *flags, env=None, timeout=120, args=None):
    t0 = time.monotonic()
    cmd = [MPIEXEC, *flags, "-n", str(n), PY, "-m", "hpcrl.compute.launch", str(run_dir)] if args is None else [MPIEXEC, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HPCRL_LAUNCH_ID": uuid.uuid4().hex[:8], **(env or {})})
    return proc, time.monotonic() - t0


def probe_rows(run_dir, stdout: str) -> list[dict]:
    """The rows rank 0 wrote, each also on its task's own output."""
    rows = conftest.probe_rows(run_dir)
    assert stdout.count('"hpcrl_probe"') == len(rows), stdout[-2000:]
    return rows


def check_rows_against_plan(rows, spec, source="mpi"):
    plan = spec.plan()
    assert [r["plan"] for r in rows] == [json.loads(json.dumps(t.to_dict())) for t in plan.tasks]
    var = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "ROCR_VISIBLE_DEVICES"}.get(spec.site.gpu_vendor)
    for row, task in zip(rows, plan.tasks):
        seen = row["observed"]
        assert (seen["rank"], seen["node"], seen["local_rank"], seen["role"], seen["sender"]) == \
            (task.rank, task.node, task.local_rank, task.role, task.sender)
        assert seen["affinity"] == list(task.cores) and seen["source"] == source
        expected = {var: ",".join(map(str, task.gpus))} if var else {}
        if var and spec.site.gpu_vendor == "amd" and task.role == "server":   # relative to the ROCr mask
            expected["HIP_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(task.gpus)))
        assert seen["gpu_env"] == expected, (task.rank, seen["gpu_env"])
        if task.role == "trainer":          # gloo binds to the interface that reaches trainer rank 0
            assert seen["gloo_socket_ifname"] in {name for _, name in socket.if_nameindex()}, seen
        assert all(check["ok"] for check in row["checks"].values()), row["checks"]
        if task.role == "server":
            assert row["checks"]["channel"]["served"] == [t.rank for t in plan.served_by(task.rank)]
        else:
            assert row["checks"]["channel"]["server_rank"] == task.server_rank
            n = plan.num_trainers
            assert row["checks"]["all_reduce"]["sum"] == n * (n + 1) / 2
    check_probe_transfer(rows, spec.recipe.inference.sync_bucket_mb << 20)


@needs_mpi
def test_probe_on_rocm_gives_a_tensor_parallel_server_a_hip_mask_inside_its_rocr_one(tmp_path):
    """Issue #27, item 2, through the real launch: the server of 2 GPUs sees ROCR_VISIBLE_DEVICES=2,3
    and HIP_VISIBLE_DEVICES=0,1 (what Ray, started by vLLM for tensor parallelism, insists on)."""
    proc, _, run_dir = _hpcrl_run(tmp_path, "site.node.gpus=4", "site.gpu_vendor=amd", "inference.gpus=2",
                                  "inference.tensor_parallel_size=2")
    assert proc.returncode == 0, proc.stderr
    rows = probe_rows(run_dir, proc.stdout)
    check_rows_against_plan(rows, JobSpec.load(run_dir))
    server = next(r for r in rows if r["plan"]["role"] == "server")
    assert server["observed"]["gpu_env"] == {"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "0,1"}


@needs_mpi
def test_probe_builds_a_shard_group_over_two_nodes_where_one_node_cannot_hold_the_state(tmp_path):
    """Issue #27, item 6, through the real launch: 4 nodes, a model whose state one node's trainer
    cannot hold but two nodes' can (the memory estimate, from its config.json): each shard group
    spans nodes 0-1 or 2-3, and the replicas are across them."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
        "vocab_size": 151936, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16"}))         # Qwen2-0.5B's shape, no weights
    (model / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (model / "tokenizer.json").write_text("{}")
    proc, _, run_dir = _hpcrl_run(tmp_path, f"model.path={model}", "site.node.memory_gb=14", "site.node.gpus=2",
                                  "grpo.per_device_train_batch_size=4", "grpo.num_generations=4",
                                  "grpo.max_completion_length=16", "inference.max_model_len=128", nodes=4)
    assert proc.returncode == 0, proc.stderr
    assert "mesh hsdp (replicate=2 x shard=2)" in proc.stderr and "shard over each 2 nodes" in proc.stderr
    rows = probe_rows(run_dir, proc.stdout)
    check_rows_against_plan(rows, JobSpec.load(run_dir))
    groups = {r["observed"]["node"]: r["checks"]["all_reduce"] for r in rows if r["plan"]["role"] == "trainer"}
    assert {n: g["mesh_shard_nodes"] for n, g in groups.items()} == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    assert {n: g["mesh_replicate_nodes"] for n, g in groups.items()} == {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}


@needs_mpi
def test_probe_three_trainers_and_a_server_match_the_plan(tmp_path):
    proc, seconds, run_dir = _hpcrl_run(tmp_path, "site.node.gpus=4", "site.gpu_vendor=nvidia")
    assert proc.returncode == 0, proc.stderr
    rows = probe_rows(run_dir, proc.stdout)
    assert len(rows) == 4
    check_rows_against_plan(rows, JobSpec.load(run_dir))
    assert [r["plan"]["rank"] for r in rows if r["observed"]["sender"]] == [2]     # GPU 2, beside the server
    assert rows[0]["observed"]["mesh"] == {"kind": "fsdp", "shape": [3], "dims": ["shard"]}
    check_trainer_imports_overlap(rows)
    assert (run_dir / "run.log").read_text().count("hpcrl_probe") == 4
    assert not (run_dir / ".launch").exists()           # the meeting files are gone
    print(f"probe: {seconds:.1f} s")


@needs_mpi
def test_two_fake_nodes_get_an_hsdp_mesh(tmp_path):
    proc, seconds, run_dir = _hpcrl_run(tmp_path, "site.node.gpus=2", nodes=2)
    assert proc.returncode == 0, proc.stderr
    rows = probe_rows(run_dir, proc.stdout)
    check_rows_against_plan(rows, JobSpec.load(run_dir))
    assert {r["observed"]["node_name"] for r in rows if r["observed"]["node"] == 1} != \
        {r["observed"]["node_name"] for r in rows if r["observed"]["node"] == 0}
    trainer = next(r for r in rows if r["plan"]["role"] == "trainer")
    assert trainer["observed"]["mesh"] == {"kind": "hsdp", "shape": [2, 1], "dims": ["replicate", "shard"]}


@needs_mpi
def test_slurm_variables_alone_place_the_same_tasks(tmp_path):
    """The SLURM_* fallback (no MPI at all), with the variables srun would set, under mpiexec."""
    run_dir = _make_run_dir(tmp_path, "site.node.gpus=2", "launch.rendezvous=slurm", nodes=2)
    args = []
    for rank in range(4):
        node, local = divmod(rank, 2)
        args += ["-n", "1", "-env", "SLURM_PROCID", str(rank), "-env", "SLURM_NODEID", str(node),
                 "-env", "SLURM_LOCALID", str(local), "-env", "SLURMD_NODENAME", f"fake{node}",
                 PY, "-m", "hpcrl.compute.launch", str(run_dir), ":"]
    env = {"SLURM_JOB_ID": str(os.getpid()), "SLURM_STEP_ID": uuid.uuid4().hex[:6],
           "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_NODES": "2"}
    proc, _ = _mpiexec(run_dir, 4, env=env, args=args[:-1])
    assert proc.returncode == 0, proc.stderr
    rows = probe_rows(run_dir, proc.stdout)
    assert len(rows) == 4
    check_rows_against_plan(rows, JobSpec.load(run_dir), source="slurm")


@needs_mpi
def test_a_killed_trainer_is_named_and_the_run_ends(tmp_path):
    proc, seconds, _ = _hpcrl_run(tmp_path, "site.node.gpus=4", "launch.peer_failure_timeout_s=5",
                                  env={"HPCRL_FAULT": "die-after-rendezvous:1"})
    assert proc.returncode != 0
    assert "hpcrl: rank 1 (node 0, trainer) was killed by SIGKILL" in proc.stderr
    assert seconds < 30, seconds
    print(f"killed trainer: run over in {seconds:.1f} s")


@needs_mpi
@pytest.mark.parametrize("lost, role", [(1, "trainer"), (0, "trainer"), (3, "server")])
def test_every_rank_exits_naming_a_lost_one(tmp_path, lost, role):
    """mpiexec told not to clean up: hpcrl's own watchdog must end everyone, naming the rank."""
    run_dir = _make_run_dir(tmp_path, "site.node.gpus=4", "launch.peer_failure_timeout_s=3")
    proc, seconds = _mpiexec(run_dir, 4, "-disable-auto-cleanup", env={"HPCRL_FAULT": f"exit-after-rendezvous:{lost}"})
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.endswith("; exiting")]
    others = sorted(int(line.split()[2]) for line in lines)
    assert others == [r for r in range(4) if r != lost], proc.stderr
    if lost == 0:
        assert all("lost the watchdog hub on rank 0 (node 0, trainer" in line for line in lines)
    else:
        assert all(f"rank {lost} (node 0, {role}, host" in line and "is gone" in line for line in lines)
    assert seconds < 3 + 10, seconds
    print(f"rank {lost} lost: all out in {seconds:.1f} s")


@needs_mpi
def test_a_frozen_rank_is_found_by_its_missing_heartbeats(tmp_path):
    proc, seconds, _ = _hpcrl_run(tmp_path, "site.node.gpus=4", "launch.peer_failure_timeout_s=2",
                                  env={"HPCRL_FAULT": "freeze-after-rendezvous:2"})
    assert proc.returncode != 0
    assert "rank 2 (node 0, trainer, host" in proc.stderr and "sent no heartbeat" in proc.stderr
    assert seconds < 2 + 15, seconds
    print(f"frozen rank: found and all out in {seconds:.1f} s")


@needs_mpi
def test_a_rank_that_never_arrives_is_named_within_the_bound(tmp_path):
    proc, seconds, _ = _hpcrl_run(tmp_path, "site.node.gpus=4", "launch.rendezvous_timeout_s=3",
                                  env={"HPCRL_FAULT": "hang-before-rendezvous:3"})
    assert proc.returncode != 0
    assert "the rendezvous did not complete within 3 s" in proc.stderr
    assert "never arrived: rank 3 (node 0, server)" in proc.stderr
    assert seconds < 3 + 12, seconds
    print(f"rank that never arrives: all out in {seconds:.1f} s")


@needs_mpi
def test_a_missing_task_is_named_at_once(tmp_path):
    run_dir = _make_run_dir(tmp_path, "site.node.gpus=4")
    proc, seconds = _mpiexec(run_dir, 3)
    assert proc.returncode != 0
    assert "the launcher started 3 task(s) but the plan has 4" in proc.stderr
    assert "missing rank 3 (node 0, server)" in proc.stderr
    assert seconds < 20, seconds


def test_dry_run_prints_the_command_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "never"
    proc = subprocess.run([PY, "-m", "hpcrl", "run", "--dry-run", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "-m hpcrl.compute.launch" in proc.stdout and " -n 2 " in proc.stdout
    assert not run_dir.exists()


def test_run_refuses_a_slurm_site(tmp_path):
    proc = subprocess.run([PY, "-m", "hpcrl", "run", "--site", "testbed", "--run-dir", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "hpcrl submit --site testbed" in proc.stderr


def test_console_leaves_tracebacks_and_the_mpich_banner_to_the_log():
    from hpcrl.login.local.console import ConsoleFilter

    out = ["Traceback (most recent call last):\n", '  File "x.py", line 1, in f\n', "    f()\n",
           "ValueError: inner\n", "\n", "The above exception was the direct cause of the following exception:\n", "\n",
           "Traceback (most recent call last):\n", '  File "y.py", line 2, in g\n',
           "hpcrl: rank 1 (node 0, server): rank 0 is gone; exiting\n", "    g()\n", "ValueError: outer\n",
           "[hpcrl 10:00:00 rank 0 node 0 trainer] next\n"]
    banner = ["=" * 83 + "\n", "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n", "=   EXIT CODE: 9\n",
              "=" * 83 + "\n", "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n",
              "This typically refers to a problem with your application.\n",
              "Please see the FAQ page for debugging suggestions\n"]
    console = ConsoleFilter()
    assert [line for line in out if console.show(line, "stderr")] == [out[9], out[12]]
    assert [line for line in banner if console.show(line, "stdout")] == []
    assert console.tracebacks == 1


@needs_mpi
def test_a_job_failing_on_its_data_ends_with_its_one_line(tmp_path):
    """A corrupt row past the first passes the login node's look at the data; the job fails on
    it and `hpcrl run` ends with the failure in one line, the tracebacks left to run.log."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1="}\n{"prompt": broken\n')
    run_dir = tmp_path / "run"
    proc = subprocess.run([PY, "-m", "hpcrl", "run", f"data.path={data}", "model.path=demo:tiny:random",
                           "grpo.max_steps=1", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    reason = rundir.read_failure(run_dir)
    assert reason and f"data.path: {data} line 2 is not JSON" in reason, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"hpcrl: error: {reason}"
    assert "BAD TERMINATION" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    log = (run_dir / rundir.LOCAL_LOG_FILE).read_text()
    assert "Traceback (most recent call last)" in log       # hydra's banner too, when the rank was killed


def _children(pid: int) -> list[tuple[int, str]]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append((int(proc.name), (proc / "cmdline").read_bytes().decode(errors="replace")))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _descendants(pid: int) -> list[int]:
    out = []
    for child, _ in _children(pid):
        out += [child, *_descendants(child)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["engine core", "trainer rank 0"])
def test_a_killed_engine_or_trainer_ends_the_run_in_seconds_with_its_cause_and_no_survivors(tmp_path, victim):
    """Issue #26, item 5: kill -9 of vLLM's EngineCore left the trainers waiting (minutes, until a
    request timed out); a killed trainer left vLLM's processes running, holding mpiexec's pipes, so
    the run ended only after peer_failure_timeout_s + 15 s (325 s). The vLLM engine where it is
    installed (the transformers engine has no processes of its own), its engine core in a process of
    its own as on GPUs (on CPU hpcrl runs it in the server's: vllm_engine.MULTIPROCESSING_ENV)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpcrl", "run", "--run-dir", str(run_dir), "grpo.max_steps=100000",
           "grpo.per_device_train_batch_size=16", "grpo.num_generations=8"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, MULTIPROCESSING_ENV: "1"})
    metrics = run_dir / rundir.METRICS_FILE
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = {r["role"]: r["pid"] for r in json.loads((run_dir / rundir.RANKS_FILE).read_text())}
    engine = [pid for pid, cmdline in _children(pids["server"]) if "EngineCore" in cmdline]
    if victim == "engine core" and not engine:
        proc.kill()
        pytest.skip("the transformers engine runs inside the server task")
    engine_tree = engine + [d for e in engine for d in _descendants(e)]
    records = list((run_dir / rundir.SERVERS_DIR).glob("shm-*.json"))
    buffers = [name for r in records for name in json.loads(r.read_text())["files"]]
    assert buffers or not engine, "the server recorded none of its engine's /dev/shm buffers"
    t0 = time.monotonic()
    os.kill(engine[0] if victim == "engine core" else pids["trainer"], 9)
    out, err = proc.communicate(timeout=120)
    seconds = time.monotonic() - t0
    assert proc.returncode != 0
    assert seconds < 15, (seconds, err[-2000:])
    reason = err.strip().splitlines()[-1]
    if victim == "engine core":     # its server ends the job, naming itself and how the engine died
        assert reason.startswith("hpcrl: error: rank 1 (node 0, server, host ") and (
            f") failed: vLLM's EngineCore (pid {engine[0]}) was killed by SIGKILL" in reason), err[-2000:]
    else:
        assert reason.startswith("hpcrl: error: rank 0 (node 0, trainer) was killed by SIGKILL"), err[-2000:]
    time.sleep(1)
    assert run_survivors(run_dir) == []
    alive = [p for p in engine_tree if Path(f"/proc/{p}").exists()
             and (Path(f"/proc/{p}") / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert alive == [], alive       # the engine's processes (their environment is overwritten by vLLM's titles)
    assert [b for b in buffers if Path("/dev/shm", b).exists()] == []      # 160-250 MB each, left by the kill
    print(f"{victim} killed: run over in {seconds:.1f} s")


def test_resume_refuses_changes_and_slurm_run_dirs(tmp_path):
    run_dir = _make_run_dir(tmp_path)
    for extra, said in ((["-N", "2"], "--nodes"), (["grpo.beta=0.1"], "recipe/key=value")):
        r = subprocess.run([sys.executable, "-m", "hpcrl", "run", "--resume", str(run_dir), *extra],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr
    (run_dir / rundir.FINISHED_MARKER).write_text("3\n")
    r = subprocess.run([sys.executable, "-m", "hpcrl", "run", "--resume", str(run_dir)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "already finished" in r.stderr, r.stderr


def test_the_probes_engine_side_fails_without_its_senders_bucket():
    """The engine's transfer check is not ok when no bucket came, or another trainer's did."""
    from hpcrl.compute.launch.probe_transfer import Receiver

    assert not Receiver().check(expected_sender=2)["ok"]
    receiver = Receiver()
    receiver.sender, receiver.bytes = 1, 1024
    assert not receiver.check(expected_sender=2)["ok"]
