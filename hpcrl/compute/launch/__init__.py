"""The compute side's start: every task of a job runs `python -m hpcrl.compute.launch RUN_DIR`.

rendezvous.py  identity from MPI (or SLURM_* variables), bootstrap, the trainers' group
pinning.py     the task's GPU visibility variable and CPU affinity, as the plan says
supervisor.py  each task's first process: bounds the rendezvous, names a task that dies
watchdog.py    bounded waits after the rendezvous: the hub every rank heartbeats to
channel.py     node-local messages between a node's trainers and its server
mesh.py        the trainers' FSDP / HSDP device mesh
context.py     LaunchContext, what role functions receive
main.py        the sequence; probe.py the "probe" mode

Nothing in this package imports mpi4py or torch at module level.
"""
