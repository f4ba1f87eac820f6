"""The compute side's start: every task of a job runs `python -m hpcrl.compute.launch RUN_DIR`.

rendezvous.py  identity from MPI (or SLURM_* variables), bootstrap, the trainers' group
pinning.py     the task's GPU visibility variable and CPU affinity, as the plan says
supervisor.py  each task's first process: bounds the rendezvous, names a task that dies
watchdog.py    bounded waits after the rendezvous: the hub every rank heartbeats to
node_channel.py node-local messages between a node's trainers and its server
mesh.py        the trainers' FSDP / HSDP device mesh
context.py     LaunchContext, what role functions receive
main.py        the sequence of a task: rendezvous, role, the end
probe.py       the "probe" mode: each task's plan row against what it really got, the links checked
probe_transfer.py  the probe's weight-transport check: a bucket from each sender to each engine it syncs
wire.py        framed, authenticated messages over sockets: the channel's and the watchdog's format
stop.py        the stop request (Slurm's warning signal, scancel's SIGTERM): checkpoint and end
outcome.py     why a job ended: the first fatal line of any task, kept in failure.txt
reason.py      a failed task's reason in one line (the exception's real cause, not its wrapper)
leave.py       how a task leaves: at once when failed, past Python's finalization when finished
shm_sweep.py   /dev/shm leftovers of a killed attempt, removed before the next one starts
faults.py      fault injection for the failure tests (HPCRL_FAULT)

Nothing in this package imports mpi4py or torch at module level.
"""
