"""The trainers' device mesh for FSDP2: full sharding, or HSDP (shard inside a node, replicate
across nodes).

Which one is hpcrl.job.mesh_choice.choose_mesh, pure logic that `hpcrl plan` runs on the login node too, so
the mesh a user reads before submitting is the one the launch builds; here only the torch side.
"""

from __future__ import annotations

from hpcrl.job.mesh_choice import MeshChoice, choose_mesh
from hpcrl.job.model_shape import count_parameters

__all__ = ["MeshChoice", "build_mesh", "choose_mesh", "count_parameters"]


def build_mesh(choice: MeshChoice, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, choice.shape, mesh_dim_names=choice.dim_names)
